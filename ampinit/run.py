"""``python -m ampinit.run [-m module | script.py] [args ...]``: run apex-era code on ampinit.

Installs the ``apex`` alias (:func:`ampinit.install_apex_alias`) and then runs the target as
``python`` would: ``sys.argv`` is the script and its arguments, it runs as ``__main__``, the
script's folder (or, with ``-m``, the current one) is first on ``sys.path``, and the exit code
is the script's.  Works under ``torchrun``: ``torchrun --nproc_per_node 2 -m ampinit.run train.py``.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

from .apex import install_apex_alias

USAGE = "usage: python -m ampinit.run [-m module | script.py] [args ...]"


def main(argv: Optional[List[str]] = None) -> None:
    """Run the target in this process (see the module docstring).  Raises ``SystemExit``
    with the usage on bad arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print(__doc__.strip().splitlines()[2].strip())
        raise SystemExit(0 if argv else 2)
    install_apex_alias()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(f"ampinit.run: -m needs a module name\n{USAGE}")
        module, args = argv[1], argv[2:]
        aliased = sys.modules.get(module)
        if aliased is not None and aliased.__name__ != module and callable(getattr(aliased, "main", None)):
            # An apex script module under the alias (apex.parallel.multiproc): runpy cannot run a
            # module under a second name, so its main() runs instead.
            sys.argv = [module] + args
            aliased.main(args)
            return
        sys.argv = [module] + args  # runpy replaces argv[0] with the module's path
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, args = argv[0], argv[1:]
    if not os.path.exists(script):
        raise SystemExit(f"ampinit.run: can't open file {script!r}: no such file\n{USAGE}")
    sys.argv = [script] + args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
