"""The examples run (briefly) so they never rot."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_runs_and_shows_a_skipped_step():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "quickstart.py"), "--steps", "40",
         "--overflow-step", "20", "--log-every", "10", "--opt-level", "O5"],
        capture_output=True, text=True, timeout=300, check=True)
    lines = result.stdout.splitlines()
    assert any("loss scale" in line and "skipped steps 1" in line for line in lines), result.stdout
    assert "test accuracy" in lines[-1]


def test_ddp_torchrun_example_keeps_ranks_identical():
    from test_distributed import free_port
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), os.path.join(ROOT, "examples", "ddp_torchrun.py"),
         "--steps", "30", "--overflow-step", "25"],
        capture_output=True, text=True, timeout=300, check=True)
    assert "weights identical across ranks: True" in result.stdout, result.stdout + result.stderr
