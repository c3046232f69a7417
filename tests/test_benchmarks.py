"""Every benchmark script runs end to end at tiny sizes on the CPU and prints its table.

The numbers are meaningless at these sizes; what is tested is that the scripts a GPU session
runs (``benchmarks/gpu/prove.sh``) and the CPU ones still work with the current API, so a lent
GPU's minutes are not spent on a script that broke since it last ran.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPTS = {
    "bench_unscale": ["--tensors", "4", "--numel", "1000", "--repeats", "1", "--device", "cpu"],
    "bench_optimizer_step": ["--tensors", "4", "--numel", "1000", "--repeats", "1", "--device", "cpu"],
    "bench_amp_step": ["--tensors", "4", "--numel", "1000", "--repeats", "1"],
    "bench_o1_outputs": ["--vocab", "64", "--seq", "8", "--batch", "2", "--repeats", "1"],
    "bench_fingerprint": ["--quick", "--repeats", "1"],
    "bench_state_dict": ["--layers", "1", "--width", "16", "--repeats", "1"],
    "bench_forward_hook": ["--layers", "2", "--width", "8", "--repeats", "1"],
    "bench_zero_grad_kept": ["--width", "16", "--steps", "1"],
    "bench_zero_grad": ["--layers", "2", "--width", "8", "--repeats", "1"],
    "bench_memory": ["--layers", "1", "--seq", "4", "--warmup", "2", "--steps", "1", "--config", "fp32",
                     "--config", "O5-rem-bf16"],
    "gpu/bench_grad_path": ["--device", "cpu", "--quick"],
    "gpu/bench_many_small": ["--device", "cpu", "--quick"],
    "gpu/bench_fused_adam": ["--device", "cpu", "--quick"],
    "gpu/bench_o2_step": ["--device", "cpu", "--quick"],
    "gpu/bench_gpt2": ["--device", "cpu", "--quick"],
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_script_runs_and_prints_its_table(script, tmp_path):
    args = list(SCRIPTS[script])
    if script.startswith("gpu/"):
        args += ["--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script + ".py"), *args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) >= 3, done.stdout[-3000:]  # a header, its rule and at least one row
    assert not any("error" in row.lower() or "n/a:" in row for row in rows), "\n".join(rows)
