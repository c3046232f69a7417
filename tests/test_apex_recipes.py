"""Frameworks that use apex's amp, run unchanged on ampinit through ``python -m ampinit.run``
(examples/apex_recipes).  Each test runs where its framework is installed (the test extra pins
the last release with a working apex path) and is skipped with the reason otherwise."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "examples", "apex_recipes")


def needs(package, why):
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} is not installed: {why}")


def run_recipe(name, *args, timeout=600):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, "-m", "ampinit.run", os.path.join(RECIPES, name), *args], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@needs("transformers", "pip install 'transformers==4.57.6' accelerate (the last release with an apex backend)")
@pytest.mark.parametrize("opt_level, optim", [("O1", "adamw_torch"), ("O2", "adamw_torch"), ("O2", "adamw_apex_fused")])
def test_transformers_trainer_apex_backend(opt_level, optim, tmp_path):
    report = run_recipe("hf_trainer.py", "--opt-level", opt_level, "--optim", optim, "--poison-step", "4",
                        "--output-dir", str(tmp_path))
    assert report["use_apex"] and report["opt_level"] == opt_level
    assert report["skipped_steps"] >= 1 and report["finite"]  # the planted overflow (and natural ones at O2)
    assert report["last_loss"] < report["first_loss"]


@needs("deepspeed", "pip install 'deepspeed==0.18.2' (the newest release whose amp mode runs)")
@pytest.mark.parametrize("opt_level", ["O1"])  # on the CPU DeepSpeed all-reduces only FP32 gradients
def test_deepspeed_amp_mode(opt_level):
    report = run_recipe("deepspeed_amp.py", "--opt-level", opt_level, "--accumulate", "2", "--poison-step", "3")
    assert report["opt_level"] == opt_level and report["skipped_steps"] == 1 and report["finite"]
    assert report["last_loss"] < report["first_loss"]


@needs("mmengine", "pip install 'mmengine-lite==0.10.7'")
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_mmengine_apex_optim_wrapper(opt_level):
    report = run_recipe("mmengine_apex.py", "--opt-level", opt_level, "--poison-step", "3")
    assert report["opt_level"] == opt_level and report["skipped_steps"] == 1
    assert report["amp_state_saved"] and report["scale_kept"]
    assert report["last_loss"] < report["first_loss"]
