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
