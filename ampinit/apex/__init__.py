"""The opt-in ``apex`` alias: apex-era code runs on ampinit without being edited.

Most code written for apex's ``amp`` does not say ``from apex import amp`` in a file its user
edits: it sits inside a framework (transformers' Trainer, DeepSpeed's "amp" mode, mmengine's
``ApexOptimWrapper``) or a vendored trainer.  :func:`install_apex_alias` puts ampinit under
apex's names in ``sys.modules``:

=============================  ===============================================================
``apex``                       this package
``apex.amp``                   ``ampinit`` itself; ``apex.amp._amp_state`` is ``ampinit._amp_state``
``apex.optimizers``            ``FusedAdam``, ``FusedSGD`` (ampinit.optim) and ``FusedLAMB``,
                               ``FusedNovoGrad``, ``FusedAdagrad``; apex 0.1's ``FusedAdam``
                               (``max_grad_norm=...``) and ``FP16_Optimizer``
``apex.parallel``              ``DistributedDataParallel`` (torch's, with apex's arguments),
                               ``SyncBatchNorm``, ``convert_syncbn_model``, ``LARC``, ``Reducer``
``apex.fp16_utils``            ``to_python_float``, ``FP16_Optimizer`` (on ampinit's O2), ...,
                               ``LossScaler``, ``DynamicLossScaler`` (``.loss_scaler``)
``apex.multi_tensor_apply``    ``multi_tensor_applier``
``amp_C``, ``apex_C``          the multi-tensor ops scripts call, on ampinit's kernels
=============================  ===============================================================

apex's submodules that code imports from resolve too (``apex.optimizers.fused_adam``,
``apex.fp16_utils.fp16_optimizer``, ``apex.parallel.sync_batchnorm``, ``apex.amp.handle``, ...:
see ``ALIASED``).

A distribution named ``apex`` is registered with ``importlib.metadata`` too, since frameworks
ask for one before using it.  Install the alias before importing the framework: most of them
look for apex when they are imported.  ``python -m ampinit.run script.py`` does both.

If a real apex is installed, only what it lacks is added (``apex.amp`` and ``apex.fp16_utils``
went in 2025, with ``apex.parallel.DistributedDataParallel``); if it still has ``apex.amp``,
nothing is touched and a warning says so.  Modules apex has and ampinit does not emulate
(``apex.normalization``, ``apex.contrib``) stay missing, so code that falls back on an
``ImportError`` does.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import sys
import types
from typing import Any, Dict, Iterator, Optional

__all__ = ["install_apex_alias", "uninstall_apex_alias", "ALIASED"]

logger = logging.getLogger("ampinit")

# apex's module names -> the ampinit modules that stand in for them.
ALIASED: Dict[str, str] = {
    "apex": "ampinit.apex",
    "apex.amp": "ampinit",
    "apex.amp._amp_state": "ampinit._amp_state",
    # apex.amp's submodules are named explicitly: otherwise Python would find ampinit's files of
    # the same name (ampinit/handle.py, ...) and load second copies of them under apex's names.
    "apex.amp.frontend": "ampinit.frontend",
    "apex.amp.handle": "ampinit.apex.amp_submodules",
    "apex.amp.amp": "ampinit.apex.amp_submodules",
    "apex.amp._initialize": "ampinit.apex.amp_submodules",
    "apex.amp.scaler": "ampinit.apex.amp_submodules",
    "apex.optimizers": "ampinit.apex.optimizers",
    "apex.optimizers.fused_adam": "ampinit.apex.optimizers",
    "apex.optimizers.fused_sgd": "ampinit.apex.optimizers",
    "apex.optimizers.fused_lamb": "ampinit.apex.optimizers",
    "apex.optimizers.fused_novograd": "ampinit.apex.optimizers",
    "apex.optimizers.fused_adagrad": "ampinit.apex.optimizers",
    "apex.optimizers.fused_mixed_precision_lamb": "ampinit.apex.optimizers",
    "apex.optimizers.fused_adam_v1": "ampinit.apex.optimizers",
    "apex.optimizers.fp16_optimizer": "ampinit.apex.optimizers",
    "apex.parallel": "ampinit.apex.parallel",
    "apex.parallel.distributed": "ampinit.apex.parallel",
    "apex.parallel.LARC": "ampinit.apex.parallel",
    "apex.parallel.optimized_sync_batchnorm": "ampinit.apex.parallel",
    "apex.parallel.sync_batchnorm": "ampinit.apex.parallel",
    "apex.parallel.multiproc": "ampinit.apex.multiproc",
    "apex.fp16_utils": "ampinit.apex.fp16_utils",
    "apex.fp16_utils.fp16_optimizer": "ampinit.apex.fp16_utils",
    "apex.fp16_utils.fp16util": "ampinit.apex.fp16_utils",
    "apex.fp16_utils.loss_scaler": "ampinit.apex.loss_scaler",
    "apex.multi_tensor_apply": "ampinit.apex.multi_tensor_apply",
    "amp_C": "ampinit.apex.amp_C",
    "apex_C": "ampinit.apex.apex_C",
}
# Modules of a real apex that run a program when imported: probed with find_spec, not imported.
_RUN_ON_IMPORT = frozenset({"apex.parallel.multiproc"})
# Names a partly installed real apex may lack inside modules it does have.
_ATTRIBUTES = {"apex.parallel": ("DistributedDataParallel", "Reducer", "flat_dist_call", "convert_syncbn_model",
                                 "SyncBatchNorm", "LARC")}


class _ApexDistribution(importlib.metadata.Distribution):
    """The metadata of the stand-in ``apex`` distribution (no files behind it)."""

    def read_text(self, filename: str) -> Optional[str]:
        if filename == "METADATA":
            from .._version import __version__
            return (f"Metadata-Version: 2.1\nName: apex\nVersion: 0.1+ampinit{__version__.replace('.', '')}\n"
                    "Summary: NVIDIA apex's amp API, provided by ampinit\n")
        return None

    def locate_file(self, path: Any) -> Any:
        return None


class _ApexDistributionFinder:
    """A ``sys.meta_path`` entry that finds no modules, only the ``apex`` distribution."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> None:
        return None

    @staticmethod
    def find_distributions(context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("-", "_") == "apex":
            yield _ApexDistribution()


def _real_apex() -> Optional[types.ModuleType]:
    """A real apex, if one is installed (never ours)."""
    module = sys.modules.get("apex")
    if module is not None:
        return None if module.__name__ == "ampinit.apex" else module
    try:
        spec = importlib.util.find_spec("apex")
    except (ImportError, ValueError):
        return None
    return importlib.import_module("apex") if spec is not None else None


def _importable(name: str) -> bool:
    try:
        if name in _RUN_ON_IMPORT:
            return importlib.util.find_spec(name) is not None
        importlib.import_module(name)
    except (ImportError, ValueError):
        return False
    return True


def install_apex_alias() -> Dict[str, str]:
    """Put ampinit under apex's names (see the module docstring).  Idempotent.

    Returns what each apex name now refers to: ``"ampinit"`` for the ones this call (or an
    earlier one) aliased, ``"apex"`` for a real apex's own modules.
    """
    real = _real_apex()
    if real is not None and _importable("apex.amp"):
        logger.warning("ampinit: a real apex with apex.amp is installed (%s); the apex alias leaves it alone",
                       getattr(real, "__file__", real))
        return {name: "apex" for name in ALIASED}
    result: Dict[str, str] = {}
    for name, target in ALIASED.items():
        parent, _, child = name.rpartition(".")
        if real is not None and result.get(parent) != "ampinit":  # under ampinit's own modules: ours
            if name in sys.modules and sys.modules[name].__name__ != target:
                result[name] = "apex"
                continue
            if name != "apex" and _importable(name):
                result[name] = "apex"
                continue
        module = importlib.import_module(target)
        sys.modules[name] = module
        holder = sys.modules.get(parent) if parent else None
        # Nothing is set on the ampinit package itself (apex.amp): its attributes `handle`,
        # `scaler`, `_amp_state` are ampinit's own modules and objects.
        if holder is not None and getattr(holder, "__name__", None) != "ampinit" \
                and (result.get(parent) == "ampinit" or not hasattr(holder, child)):
            setattr(holder, child, _attribute_for(name, module))
        result[name] = "ampinit"
    if real is not None:
        _add_missing_attributes()
    if not any(isinstance(finder, _ApexDistributionFinder) for finder in sys.meta_path) and real is None:
        sys.meta_path.append(_ApexDistributionFinder())
    return result


def _attribute_for(name: str, module: types.ModuleType) -> Any:
    """What ``parent.child`` is in apex: mostly the module; ``apex.parallel.LARC`` is the class."""
    if name == "apex.parallel.LARC":
        return module.LARC
    return module


def _add_missing_attributes() -> None:
    from . import parallel
    for name, attributes in _ATTRIBUTES.items():
        module = sys.modules.get(name)
        if module is None or module is parallel:
            continue
        for attribute in attributes:
            if not hasattr(module, attribute):
                setattr(module, attribute, getattr(parallel, attribute))


def uninstall_apex_alias() -> None:
    """Undo :func:`install_apex_alias`: the apex names that refer to ampinit go, and so does the
    ``apex`` distribution.  A real apex's own modules stay."""
    for name, target in ALIASED.items():
        module = sys.modules.get(name)
        if module is not None and module.__name__ == target:
            del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _ApexDistributionFinder)]
