"""The apex alias: apex's names resolve to ampinit, frameworks' detection finds it, a real apex is
respected, and ``python -m ampinit.run`` runs apex-era scripts unchanged."""
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import ampinit

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture
def alias():
    ampinit.install_apex_alias()
    yield
    ampinit.uninstall_apex_alias()


def run(args, cwd=ROOT, env=None, timeout=300):
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def test_names_resolve_to_ampinit(alias):
    import amp_C
    import apex
    import apex.amp._amp_state
    from apex import amp
    from apex.amp import _amp_state
    from apex.fp16_utils import FP16_Optimizer, to_python_float  # noqa: F401
    from apex.multi_tensor_apply import multi_tensor_applier  # noqa: F401
    from apex.optimizers import FusedAdam, FusedLAMB, FusedSGD  # noqa: F401
    from apex.parallel import LARC, DistributedDataParallel, SyncBatchNorm, convert_syncbn_model  # noqa: F401
    from apex.parallel.LARC import LARC as LARC2

    assert amp is ampinit and apex.amp is ampinit and _amp_state is ampinit._amp_state
    assert apex.amp._amp_state is ampinit._amp_state  # the instance, as in apex, also after the submodule import
    assert LARC2 is LARC and apex.parallel.LARC is LARC
    # apex.optimizers.FusedAdam is ampinit's, unless built with apex 0.1's arguments
    assert issubclass(apex.optimizers.FusedAdam, ampinit.optim.FusedAdam) and "multi_tensor_scale" in dir(amp_C)
    assert "state_dict" in amp.__dict__ and "load_state_dict" in amp.__dict__  # timm's check
    assert amp.__path__  # DeepSpeed logs it
    assert to_python_float(torch.tensor([2.5])) == 2.5


# Import forms of apex-era code (DeepLearningExamples, Megatron-LM, fairseq, old HF BERT, ...).
APEX_SUBMODULE_IMPORTS = [
    "from apex.amp.handle import scale_loss",
    "from apex.amp.handle import disable_casts",
    "from apex.amp._initialize import _initialize",
    "from apex.amp.amp import init, half_function, float_function, promote_function",
    "from apex.amp.amp import register_half_function, register_float_function, register_promote_function",
    "from apex.amp.frontend import initialize, state_dict, load_state_dict",
    "from apex.amp.scaler import LossScaler",
    "from apex.optimizers.fused_adam import FusedAdam",
    "from apex.optimizers.fused_lamb import FusedLAMB",
    "from apex.optimizers.fused_sgd import FusedSGD",
    "from apex.optimizers.fused_novograd import FusedNovoGrad",
    "from apex.optimizers.fused_adagrad import FusedAdagrad",
    "from apex.optimizers.fused_mixed_precision_lamb import FusedMixedPrecisionLamb",
    "from apex.optimizers import FP16_Optimizer, FusedAdam",  # pytorch-pretrained-BERT's examples
    "from apex.optimizers.fp16_optimizer import FP16_Optimizer",
    "from apex.optimizers.fused_adam_v1 import FusedAdam_v1",
    "from apex.parallel.sync_batchnorm import SyncBatchNorm",
    "from apex.parallel import multiproc",
    "import apex.parallel.multiproc",
    "from apex.fp16_utils.fp16_optimizer import FP16_Optimizer",
    "from apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler",
    "from apex.fp16_utils.fp16util import BN_convert_float, network_to_half, prep_param_lists, "
    "model_grads_to_master_grads, master_params_to_model_params, tofp16, FP16Model",
    "from apex.fp16_utils import LossScaler, DynamicLossScaler",
]


@pytest.mark.parametrize("statement", APEX_SUBMODULE_IMPORTS)
def test_apex_submodules_import(alias, statement):
    exec(statement, {})


def test_apex_submodules_are_ampinits_objects_and_load_no_second_copies(alias):
    """apex.amp is the ampinit package: its submodule names must not load ampinit's files again
    (a second ampinit.frontend with its own globals) nor rebind ampinit's attributes."""
    originals = {name: sys.modules[f"ampinit.{name}"] for name in ("frontend", "handle", "scaler")}
    from apex.amp.frontend import initialize
    from apex.amp.handle import scale_loss
    from apex.fp16_utils.loss_scaler import DynamicLossScaler
    from apex.optimizers.fused_adam import FusedAdam
    from apex.parallel.sync_batchnorm import SyncBatchNorm

    assert initialize is ampinit.initialize and scale_loss is ampinit.scale_loss
    assert FusedAdam is ampinit.apex.optimizers.FusedAdam and issubclass(FusedAdam, ampinit.optim.FusedAdam)
    assert SyncBatchNorm is ampinit.apex.parallel.SyncBatchNorm
    assert DynamicLossScaler is ampinit.apex.fp16_utils.DynamicLossScaler
    for name, module in originals.items():
        assert getattr(ampinit, name) is module
    assert not [name for name in sys.modules if name.startswith("apex.amp.")
                and sys.modules[name].__name__.startswith("apex.")]  # no module loaded under apex's name
    ampinit.uninstall_apex_alias()
    assert not [name for name in sys.modules if name.startswith("apex")]


def test_apex_amp_handle_reached_as_an_attribute_has_disable_casts(alias):
    """``amp.handle.disable_casts()`` (SwAV/UOTA heads) and ``import apex.amp.handle as h`` go
    through the attribute, which is ampinit's own handle module: it raised AttributeError."""
    import apex.amp.handle as handle_module
    from apex import amp
    assert amp.handle.disable_casts is ampinit.disable_casts and handle_module.disable_casts is ampinit.disable_casts
    model = amp.initialize(nn.Linear(4, 4), opt_level="O1", verbosity=0)
    with amp.handle.disable_casts():
        assert model(torch.randn(2, 4)).dtype == torch.float32
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32


def test_optimizer_amp_lazy_init_is_there_and_changes_nothing(alias):
    """Varuna's BERT and pipeline warm-ups call ``optimizer._amp_lazy_init()`` after initialize,
    then read ``_amp_stash``; apex put the method on every optimizer it processed."""
    from apex import amp
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model, optimizer = amp.initialize(model, torch.optim.AdamW(model.parameters()), opt_level="O2", verbosity=0)
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer._amp_lazy_init()
    assert [p for group in optimizer.param_groups for p in group["params"]] == masters
    assert len(optimizer._amp_stash.all_fp16_params) == len(optimizer._amp_stash.all_fp32_from_fp16_params) == 4


class _AdasumStyle:
    """Adasum's and BMUF's optimizers: after step(), write the masters through ``.data`` (an
    all-reduced or block-momentum value), then copy them into the model if the optimizer can."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        self.optimizer.step()
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for master in group["params"]:
                    master.data.copy_(master.data * 0.5 + 0.25)  # the "averaged" value
        if hasattr(self.optimizer, "_master_params_to_model_params"):
            self.optimizer._master_params_to_model_params()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O5"])
@pytest.mark.parametrize("wrapper", ["amp", "fp16_optimizer"])
def test_master_params_to_model_params_after_data_writes(alias, level, wrapper):
    """After the write, the model holds the written masters (rounded to its dtype), as under
    apex, and the next forward is the one an FP32 model with those masters, cast, computes.
    Without the method the fp16 model ran on the old weights (E12)."""
    from apex import amp
    from apex.fp16_utils import FP16_Optimizer
    if wrapper == "fp16_optimizer" and level != "O2":
        pytest.skip("FP16_Optimizer is fp16 with masters")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    if wrapper == "amp":
        model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                          opt_level=level, verbosity=0)
        masters = lambda: list(amp.master_params(optimizer))  # noqa: E731
    else:
        model = model.half()
        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), verbose=False)
        masters = lambda: [m for group in optimizer.fp32_from_fp16_groups for m in group]  # noqa: E731
    dtype = {"O2": torch.float16, "O5": torch.bfloat16}.get(level, torch.float32)
    adasum = _AdasumStyle(optimizer)
    x = torch.randn(16, 4)
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(x.to(dtype)).float().pow(2).mean()
        if wrapper == "amp":
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        else:
            optimizer.backward(loss)
        before = [m.detach().clone() for m in masters()]
        adasum.step()
        for param, master, old in zip(model.parameters(), masters(), before):
            assert not torch.equal(master, old)  # the step and the write happened
            assert torch.equal(param.detach(), master.detach().to(dtype))
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        for p, m in zip(reference.parameters(), masters()):
            p.copy_(m)
    if level != "O1":  # (O1's forward is autocast's; its parameters were compared above)
        with torch.no_grad():
            assert torch.equal(model(x.to(dtype)).float(), reference.to(dtype)(x.to(dtype)).float())


def test_apex_amp_internals_raise_clear_errors(alias):
    from apex.amp._initialize import _initialize
    from apex.amp.scaler import LossScaler
    with pytest.raises(RuntimeError, match=r"_amp_state.loss_scalers\[i\]"):
        LossScaler("dynamic")
    with pytest.raises(RuntimeError, match=r"apex.amp.initialize\(models, optimizers"):
        _initialize(nn.Linear(2, 2), None, None)


def test_multiproc_imports_and_running_it_names_torchrun(tmp_path):
    result = run(["-m", "ampinit.run", "-m", "apex.parallel.multiproc", "main.py", "--lr", "1"], cwd=tmp_path)
    assert result.returncode == 1 and "RuntimeError" in result.stderr and "torchrun --nproc_per_node" in result.stderr
    assert not list(tmp_path.iterdir())  # no GPU_*.log: nothing was launched


def test_frameworks_detection_finds_apex(alias):
    spec = importlib.util.find_spec("apex")
    assert spec is not None and importlib.util.find_spec("apex.amp") is not None
    assert importlib.metadata.version("apex").startswith("0.1")
    with pytest.raises(ModuleNotFoundError):  # what apex has and ampinit does not stays missing
        importlib.import_module("apex.normalization")


def test_uninstall_removes_everything():
    ampinit.install_apex_alias()
    ampinit.install_apex_alias()  # idempotent
    ampinit.uninstall_apex_alias()
    for name in ("apex", "apex.amp", "amp_C", "apex.optimizers"):
        assert name not in sys.modules
    assert importlib.util.find_spec("apex") is None
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("apex")


def test_gnmt_amp_state_pattern(alias):
    """DeepLearningExamples GNMT: initial scale 8192 and growth every 128 clean backwards, set
    through apex's private state (s_amp_state)."""
    import apex.amp._amp_state
    from apex import amp
    model = nn.Linear(4, 2)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), opt_level="O2", verbosity=0)
    loss_scaler = apex.amp._amp_state.loss_scalers[0]
    loss_scaler._loss_scale = 8192
    loss_scaler._scale_seq_len = 128
    assert loss_scaler.loss_scale() == 8192.0 and opt.amp.loss_scalers[0].growth_interval == 128
    for _ in range(128):
        opt.zero_grad()
        with amp.scale_loss(model(torch.randn(8, 4)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    assert loss_scaler._loss_scale == 16384.0 and loss_scaler._unskipped == 0
    assert amp._amp_state.opt_properties.opt_level == "O2" and amp._amp_state.opt_properties.master_weights
    with pytest.raises(AttributeError, match="not emulated"):
        loss_scaler.update_scale()


def test_initialize_keyword_arguments_as_frameworks_pass_them(alias):
    """NeMo passes models=/optimizers= by keyword, mmengine every apex option (None included),
    Lightning a list of optimizers; the optimizer then has apex's _amp_stash."""
    from apex import amp
    model = nn.Linear(4, 2)
    opts = [torch.optim.SGD(model.parameters(), lr=0.1)]
    _, out = amp.initialize(models=model, optimizers=opts, opt_level="O1", loss_scale="dynamic", enabled=True,
                            cast_model_type=None, patch_torch_functions=None, keep_batchnorm_fp32=None,
                            master_weights=None, cast_model_outputs=None, num_losses=1, verbosity=0,
                            min_loss_scale=None, max_loss_scale=16777216.0)
    assert isinstance(out, list) and hasattr(out[0], "_amp_stash")
    amp.end(model)
    assert not hasattr(opts[0], "_amp_stash")


def test_legacy_init_raises_with_the_replacement():
    with pytest.raises(RuntimeError, match=r"amp.initialize\(model, optimizer"):
        ampinit.init(enabled=True)
    with pytest.raises(RuntimeError, match=r"amp.initialize\(model, optimizer"):
        ampinit.init()
    # E12: scripts that call amp.init(allow_banned=True) before amp.initialize are told to delete it.
    with pytest.raises(RuntimeError, match=r"delete the amp.init line"):
        ampinit.init(allow_banned=True)


def test_legacy_init_disabled_is_apexs_no_op_handle():
    """maskrcnn-benchmark's test_net.py: ``amp.init(enabled=use_mixed_precision)``, False for
    fp32 configs; apex returned a handle that does nothing (it raised here).  A loop through it
    trains exactly like plain torch."""
    handle = ampinit.init(enabled=False, verbose=False)
    assert not handle.is_active() and handle.verbose is False

    def run(through_handle):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if through_handle:
            opt = handle.wrap_optimizer(opt)
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.ones(3, 4)).pow(2).sum()
            if through_handle:
                with handle._disable_casts(), opt.scale_loss(loss) as scaled:
                    scaled.backward()
                with handle.scale_loss(torch.zeros(()), opt) as zero:
                    assert zero.item() == 0.0
            else:
                loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)


# -- a real apex next to the alias -------------------------------------------------------------

def _fake_real_apex(tmp_path, with_amp):
    root = tmp_path / "site"
    (root / "apex" / "optimizers").mkdir(parents=True)
    (root / "apex" / "__init__.py").write_text("REAL = True\n")
    (root / "apex" / "optimizers" / "__init__.py").write_text("class FusedAdam:\n    REAL = True\n")
    (root / "apex" / "parallel").mkdir()
    (root / "apex" / "parallel" / "__init__.py").write_text("class SyncBatchNorm:\n    REAL = True\n")
    # apex's launcher runs when imported: the alias must find it without importing it.
    (root / "apex" / "parallel" / "multiproc.py").write_text(
        f"open({str(tmp_path / 'launched')!r}, 'w').close()\n")
    if with_amp:
        (root / "apex" / "amp").mkdir()
        (root / "apex" / "amp" / "__init__.py").write_text("REAL = True\n")
    return root


@pytest.mark.parametrize("with_amp", [False, True])
def test_a_real_apex_is_respected(tmp_path, with_amp):
    root = _fake_real_apex(tmp_path, with_amp)
    code = textwrap.dedent("""
        import json, logging, sys
        logging.basicConfig(level=logging.WARNING)
        import ampinit
        ampinit.install_apex_alias()
        import apex, apex.optimizers, apex.parallel
        from apex import amp
        print(json.dumps({"amp_is_ampinit": amp is ampinit,
                          "real_optimizers": getattr(apex.optimizers.FusedAdam, "REAL", False),
                          "real_syncbn": getattr(apex.parallel.SyncBatchNorm, "REAL", False),
                          "ddp_added": hasattr(apex.parallel, "DistributedDataParallel"),
                          "fp16_utils": "apex.fp16_utils" in sys.modules}))
    """)
    result = run(["-c", code], env={"PYTHONPATH": os.pathsep.join([str(root), ROOT])})
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "launched").exists()
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["real_optimizers"] and report["real_syncbn"]  # apex's own modules stay
    if with_amp:
        assert not report["amp_is_ampinit"] and not report["ddp_added"] and "leaves it alone" in result.stderr
    else:
        assert report["amp_is_ampinit"] and report["ddp_added"] and report["fp16_utils"]


# -- python -m ampinit.run --------------------------------------------------------------------------

APEX_SCRIPT = """
import sys, json
import torch
from apex import amp
from apex.optimizers import FusedAdam
from apex.fp16_utils import to_python_float

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = FusedAdam(model.parameters(), lr=1e-2)
model, optimizer = amp.initialize(model, optimizer, opt_level=sys.argv[1], verbosity=0)
x = torch.randn(64, 4); y = x.sum(1, keepdim=True)
losses = []
for step in range(30):
    optimizer.zero_grad()
    loss = ((model(x).float() - y) ** 2).mean()
    with amp.scale_loss(loss * (float("inf") if step == 3 else 1.0), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    losses.append(to_python_float(loss))
print(json.dumps({"name": __name__, "argv": sys.argv, "first": losses[0], "last": losses[-1],
                  "skipped": optimizer.amp.skipped_steps}))
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O5"])
def test_run_an_apex_script_unchanged(tmp_path, opt_level):
    script = tmp_path / "train.py"
    script.write_text(APEX_SCRIPT)
    result = run(["-m", "ampinit.run", str(script), opt_level], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["name"] == "__main__" and report["argv"] == [str(script), opt_level]
    # the planted overflow, and natural ones at a scale of 2**16
    assert report["skipped"] >= 1 and report["last"] < report["first"] / 4


def test_run_exit_codes_module_mode_and_errors(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(APEX_SCRIPT)
    assert run(["-m", "ampinit.run", str(script), "O2", "7"], cwd=tmp_path).returncode == 7
    (tmp_path / "trainer_pkg").mkdir()
    (tmp_path / "trainer_pkg" / "__init__.py").write_text("")
    (tmp_path / "trainer_pkg" / "train.py").write_text(APEX_SCRIPT)
    result = run(["-m", "ampinit.run", "-m", "trainer_pkg.train", "O1"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["name"] == "__main__"
    failing = tmp_path / "fail.py"
    failing.write_text("raise ValueError('boom')\n")
    result = run(["-m", "ampinit.run", str(failing)], cwd=tmp_path)
    assert result.returncode == 1 and "ValueError: boom" in result.stderr
    result = run(["-m", "ampinit.run", str(tmp_path / "missing.py")], cwd=tmp_path)
    assert result.returncode != 0 and "no such file" in result.stderr
    result = run(["-m", "ampinit.run"], cwd=tmp_path)
    assert result.returncode == 2 and "usage" in result.stdout


def test_alias_logging_is_quiet_by_default(caplog, alias):
    with caplog.at_level(logging.INFO, logger="ampinit"):
        ampinit.install_apex_alias()
    assert not caplog.records


@pytest.mark.parametrize("name", ["_prepare_amp_backward", "_post_amp_backward"])
def test_apex_backward_halves_say_to_use_scale_loss(name):
    """E13: hand-written ``scale_loss`` copies (six public files) call apex's private halves of
    its ``scale_loss``; they got a bare AttributeError.  The error now names the replacement;
    ``hasattr`` stays False, as for any optimizer apex did not process."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampinit.initialize(model, opt, opt_level="O2", verbosity=0)
    assert not hasattr(opt, name)
    with pytest.raises(AttributeError, match=r"with amp.scale_loss\(loss"):
        getattr(opt, name)()
