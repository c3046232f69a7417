"""The environment report behind ``python -m ampinit``: what to paste into a bug report."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import List, Tuple

import torch

from . import ops
from ._version import __version__

__all__ = ["report"]

_OPTIONAL = ("numpy", "tqdm", "matplotlib", "scikit-learn", "lightning")


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _rows() -> List[Tuple[str, str]]:
    backend, reason = ops.backend()
    rows = [
        ("ampinit", __version__),
        ("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})"),
        ("python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("platform", f"{platform.platform()} {platform.machine()}"),
        ("ops backend", f"{backend}: {reason}"),
        ("compiled ops", "none in this build (pure-PyTorch fallback)" if backend == "torch" else backend),
        ("CPU", f"{os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}, "
                f"capability {torch.backends.cpu.get_cpu_capability()}"),
        ("CPU autocast dtypes", "float16, bfloat16"),
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            rows.append((f"cuda:{index}", f"{props.name}, sm_{props.major}{props.minor}, "
                                          f"{props.total_memory / 2 ** 30:.0f} GiB"))
        rows.append(("CUDA bf16", str(torch.cuda.is_bf16_supported())))
        rows.append(("cuDNN", str(torch.backends.cudnn.version())))
    else:
        rows.append(("CUDA", "not available"))
    rows.extend((name, _package_version(name)) for name in _OPTIONAL)
    for key in sorted(k for k in os.environ if k.startswith("AMPINIT_")):
        rows.append((key, os.environ[key]))
    return rows


def report() -> str:
    """A plain-text table of versions, devices and the live ops backend."""
    rows = _rows()
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)
