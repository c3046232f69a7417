"""``apex.parallel.multiproc`` under ampinit's apex alias.

apex's launcher (``python -m apex.parallel.multiproc main.py ...``) started one process per
GPU with ``--rank``/``--world-size`` arguments.  ampinit does not emulate it: importing this
module does nothing, and running it raises a ``RuntimeError`` that names ``torchrun``.
"""

from __future__ import annotations

from typing import List, Optional

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> None:
    """Raise: launch with ``torchrun`` instead."""
    raise RuntimeError(
        "apex.parallel.multiproc is not provided by ampinit. Launch one process per device with torchrun "
        "instead: torchrun --nproc_per_node N -m ampinit.run main.py ... (torchrun sets RANK, WORLD_SIZE and "
        "LOCAL_RANK in the environment; read them instead of --rank/--world-size)")


if __name__ == "__main__":
    main()
