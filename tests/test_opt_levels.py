import pytest
import torch
from torch import nn

import ampinit as amp
from ampinit.opt_levels import OPT_LEVELS, resolve_config

# apex's documented table (cast_model_type, patch_torch_functions, keep_batchnorm_fp32,
# master_weights, loss_scale), plus the bf16 levels.
EXPECTED = {
    "O0": (torch.float32, False, None, False, 1.0, None),
    "O1": (None, True, None, False, "dynamic", torch.float16),
    "O2": (torch.float16, False, True, True, "dynamic", None),
    "O3": (torch.float16, False, False, False, 1.0, None),
    "O4": (None, True, None, False, 1.0, torch.bfloat16),
    "O5": (torch.bfloat16, False, True, True, 1.0, None),
}


@pytest.mark.parametrize("level", sorted(EXPECTED))
def test_presets_match_apex_table(level):
    c = resolve_config(level)
    assert (c.cast_model_type, c.patch_torch_functions, c.keep_batchnorm_fp32, c.master_weights,
            c.loss_scale, c.autocast_dtype) == EXPECTED[level]
    assert c.max_loss_scale == 2.0 ** 24 and c.min_loss_scale is None
    assert set(OPT_LEVELS) == set(EXPECTED)


def test_apex_string_overrides():
    c = resolve_config("O2", keep_batchnorm_fp32="False", master_weights="True", loss_scale="128.0")
    assert c.keep_batchnorm_fp32 is False and c.master_weights is True and c.loss_scale == 128.0
    assert resolve_config("O3", loss_scale="dynamic").loss_scale == "dynamic"
    assert resolve_config("O2", cast_model_type="torch.bfloat16").cast_model_type == torch.bfloat16
    assert resolve_config("O2", loss_scale=64).loss_scale == 64.0
    assert resolve_config("O0", loss_scale="dynamic").dynamic_loss_scale


@pytest.mark.parametrize("bad", ["01", "02", "05"])
def test_zero_instead_of_letter_o(bad):
    with pytest.raises(ValueError, match="letter O"):
        resolve_config(bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(opt_level="O9"), "unknown opt_level"),
    (dict(opt_level=2), "string"),
    (dict(opt_level="O1", cast_model_type=torch.float16), "autocast"),
    (dict(opt_level="O1", master_weights=True), "nothing to keep masters of"),
    (dict(opt_level="O0", keep_batchnorm_fp32=True), "keep_batchnorm_fp32"),
    (dict(opt_level="O2", loss_scale=0), "> 0"),
    (dict(opt_level="O2", loss_scale="huge"), "loss_scale"),
    (dict(opt_level="O2", loss_scale=float("inf")), "finite"),
    (dict(opt_level="O2", keep_batchnorm_fp32="yes"), "keep_batchnorm_fp32"),
    (dict(opt_level="O2", cast_model_type=torch.int8), "cast_model_type"),
    (dict(opt_level="O2", min_loss_scale=8.0, max_loss_scale=4.0), "larger than"),
    (dict(opt_level="O2", num_losses=0), "num_losses"),
    (dict(opt_level="O2", verbosity=5), "verbosity"),
    (dict(opt_level="O2", max_loss_scale=-1), "max_loss_scale"),
])
def test_contradictions_and_bad_values(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        resolve_config(**kwargs)


@pytest.mark.parametrize("level, scaling", [
    ("O0", dict(min_loss_scale=1.0)), ("O3", dict(min_loss_scale=1.0)),  # Jasper / early NeMo
    ("O1", dict(loss_scale=128.0, max_loss_scale=2.0 ** 13, min_loss_scale=1.0)),  # pytorch-tools fit_wrapper
    ("O2", dict(loss_scale=4.0, min_loss_scale=8.0)),
    ("O2", dict(loss_scale=128.0, min_loss_scale=4.0, max_loss_scale=2.0)),  # both ignored: no contradiction
])
def test_min_loss_scale_with_a_static_scale_is_ignored_as_in_apex(level, scaling):
    """From a review of apex scripts: apex stored min_loss_scale whatever the scale and used it
    only for a dynamic one; ampinit refused it next to a static scale, so the scripts stopped at
    initialize.  The static scale stays what it was, overflows included."""
    config = resolve_config(level, **scaling)
    assert config.min_loss_scale is None and not config.dynamic_loss_scale
    model = nn.Linear(4, 2).to(torch.float16 if level in ("O2", "O3") else torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **scaling)
    static = scaling.get("loss_scale", 1.0)
    for poison in (1.0, float("inf"), 1.0):
        with amp.scale_loss(model(torch.randn(3, 4).to(model.weight.dtype)).float().sum() * poison, opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
        assert opt.amp.loss_scale(0) == static
    assert opt.amp.skipped_steps == 1


def test_cast_model_type_false_means_no_cast_and_keeps_masters():
    """apex's code: cast_model_type=False does not cast; O2's master weights still apply to the
    low-precision parameters the user made, and the batch-norm rule is moot."""
    c = resolve_config("O2", cast_model_type=False)
    assert c.cast_model_type is None and c.master_weights is True and c.keep_batchnorm_fp32 is None
    assert c.loss_scale == "dynamic"
    assert resolve_config("O3", cast_model_type="False").cast_model_type is None


def test_dynamic_scale_options():
    c = resolve_config("O2", init_scale=2.0 ** 10, growth_interval=128, growth_factor=4.0, backoff_factor=0.25,
                       hysteresis=3)
    assert (c.init_scale, c.growth_interval, c.growth_factor, c.backoff_factor, c.hysteresis) == \
        (1024.0, 128, 4.0, 0.25, 3)
    assert resolve_config("O1", init_scale="256").init_scale == 256.0  # argparse strings, as apex's options
