"""What the GPU benchmarks share: arguments, timing, the environment, and their output.

Every benchmark runs on ``--device cuda`` (the real measurement) or ``--device cpu --quick``
(tiny sizes: a smoke test of the script itself, numbers meaningless).  Each writes a JSON file
and a markdown section into ``--out`` (default ``benchmarks/out``), and prints the markdown.
Ratios are against torch measured in the same run; targets are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # run as a script from anywhere: the ampinit of this checkout
    sys.path.insert(0, ROOT)

import ampinit  # noqa: E402
import ampinit.ops  # noqa: E402


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats: checks the script runs")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions (median reported)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out"), help="folder for JSON and markdown")
    return p


def device_of(args) -> torch.device:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"{os.path.basename(sys.argv[0])}: --device cuda but torch sees no GPU; use --device cpu --quick "
                 "for a smoke test")
    return device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls after ``warmup`` calls: CUDA events
    around each call on a GPU (device time, launch gaps included), wall time on the CPU."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def environment(device: torch.device) -> Dict[str, str]:
    info = {
        "torch": torch.__version__,
        "ampinit": getattr(ampinit, "__version__", "?"),
        "python": platform.python_version(),
        "device": str(device),
        "backend": " / ".join(ampinit.ops.backend(device)),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2 ** 30:.0f} GiB"
        info["cuda"] = str(torch.version.cuda)
        module = ampinit._ext.EXTENSION
        if module is not None and hasattr(module, "cuda_kernel_param_bytes"):
            info["kernel_param_bytes"] = str(module.cuda_kernel_param_bytes())
    else:
        info["cpu"] = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return info


def param_spaces(device: torch.device) -> List[Optional[int]]:
    """The CUDA kernel-parameter spaces this build, driver and GPU can use (None: not CUDA)."""
    module = ampinit._ext.EXTENSION
    if device.type != "cuda" or module is None or not hasattr(module, "_set_cuda_kernel_param_bytes"):
        return [None]
    spaces = []
    for space in (4096, 32764):
        try:
            module._set_cuda_kernel_param_bytes(space)
            spaces.append(space)
        except ValueError:
            pass
    module._set_cuda_kernel_param_bytes(0)
    return spaces


def use_param_space(space: Optional[int]) -> None:
    module = ampinit._ext.EXTENSION
    if space is not None and module is not None and hasattr(module, "_set_cuda_kernel_param_bytes"):
        module._set_cuda_kernel_param_bytes(space)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value):
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def report(args, name: str, title: str, env: Dict[str, str], results: Dict[str, object], markdown: str) -> None:
    """Writes ``<out>/<name>.json`` and ``<out>/<name>.md`` and prints the markdown."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"name": name, "quick": args.quick, "environment": env, "results": results}, f, indent=2,
                  default=str)
    env_lines = "\n".join(f"- {key}: {value}" for key, value in env.items())
    text = f"## {title}\n\n{env_lines}\n\n{markdown}\n"
    if args.quick:
        text += "\n(--quick: tiny sizes, a smoke test of the script; the numbers mean nothing)\n"
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)


def verdict(value: Optional[float], target: float, higher_is_better: bool) -> str:
    if value is None:
        return "n/a"
    met = value >= target if higher_is_better else value <= target
    return "met" if met else "missed"
