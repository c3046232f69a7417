"""Every example runs (briefly) so none of them rots."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name, *args):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_quickstart_shows_a_skipped_step_and_writes_a_plot(tmp_path):
    out = run_example("quickstart.py", "--steps", "40", "--overflow-step", "20", "--log-every", "10",
                      "--opt-level", "O5", "--no-bar", "--plot", str(tmp_path / "q.png"))
    lines = out.splitlines()
    assert any("loss scale" in line and "skipped steps 1" in line for line in lines), out
    assert "(at step 20)" in out
    assert (tmp_path / "q.png").stat().st_size > 10_000


@pytest.mark.parametrize("name, args, expect", [
    ("digits_cnn.py", ["--steps", "5", "--opt-level", "O0", "O2"], "| O2 |"),
    ("char_transformer.py", ["--steps", "3", "--opt-level", "O0", "O5"], "| O5 |"),
    ("dcgan.py", ["--steps", "10"], "modes covered"),
    ("accumulate_clip_resume.py", ["--steps", "6", "--opt-level", "O5"], "bit for bit: True"),
])
def test_example_runs(name, args, expect, tmp_path):
    out = run_example(name, *args, "--no-bar", "--plot", str(tmp_path / "plot.png"))
    assert expect in out, out
    assert (tmp_path / "plot.png").exists()


def test_ddp_torchrun_example_keeps_ranks_identical():
    from _ranks import free_port
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), os.path.join(ROOT, "examples", "ddp_torchrun.py"),
         "--steps", "30", "--overflow-step", "25"],
        capture_output=True, text=True, timeout=300, check=True)
    assert "weights identical across ranks: True" in result.stdout, result.stdout + result.stderr


def test_environment_report():
    out = subprocess.run([sys.executable, "-m", "ampinit"], capture_output=True, text=True, check=True).stdout
    assert "ops backend" in out and "torch" in out and "CUDA" in out
