"""Timing and reporting helpers shared by the benchmark scripts."""

import platform
import statistics
import time

import torch

import ampinit.ops


def timed(fn, repeats, device):
    """Median wall time of ``fn`` in ms (after one warm-up call), synchronising on CUDA."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def environment(device):
    """One line per fact about what was measured on."""
    lines = [f"torch {torch.__version__}, ampinit {ampinit.__version__}, Python {platform.python_version()}",
             f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
             f"ATen capability {torch.backends.cpu.get_cpu_capability()}"]
    if device.type == "cuda":
        lines.append(f"GPU: {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}")
    name, reason = ampinit.ops.backend(device)
    lines.append(f"ampinit backend on {device.type}: {name} ({reason})")
    return lines


def devices(requested):
    if requested == "all":
        return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    return [torch.device(requested)]
