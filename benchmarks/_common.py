"""Timing, memory and reporting helpers shared by the benchmark scripts."""

import platform
import resource
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


def print_table_head(title, device, columns):
    """The heading, one line per fact about the machine (:func:`environment`), and the header
    of a markdown table whose first column is text and the others numbers."""
    print(f"{title}\n")
    for line in environment(device):
        print(f"- {line}")
    print("\n| " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * (len(columns) - 1))


def devices(requested):
    if requested == "all":
        return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    return [torch.device(requested)]


def memory_now(device):
    """(current, peak) bytes: RSS and its high-water mark on CPU, allocated on CUDA."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    peak = max(fields.get("VmHWM", 0), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return fields.get("VmRSS", 0), peak


def reset_peak(device):
    """Start a new high-water mark; returns whether it could (Linux: ``clear_refs`` 5)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def current_peak(device):
    """The high-water mark since :func:`reset_peak` (``VmHWM``; ``ru_maxrss`` is not reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
