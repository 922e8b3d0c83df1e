"""Weight averaging is a weight update: like ``optimizer.step()``, the
averaging helpers run uncast by themselves.

An EMA multiplies the average by a decay such as 0.999; under the BF16 rule
``0.999 * ema`` runs in bfloat16, where a 0.1% step is below rounding, and
the average stalls. These run with casts off (``casts.uncast``), through
the patch log:

- ``torch.optim.swa_utils.AveragedModel.update_parameters`` (any
  ``avg_fn``/``multi_avg_fn``; Lightning's ``WeightAveraging`` and
  ``EMAWeightAveraging`` callbacks call it);
- timm's ``ModelEma``, ``ModelEmaV2`` and ``ModelEmaV3`` (``update`` and
  ``set``), when timm is imported before ``convert()``;
- Lightning's ``StochasticWeightAveraging.update_parameters``, when
  Lightning is imported before ``convert()``.

Importing a library is never hmp's doing: one imported after ``convert()``
is reached by the next ``convert()``. An EMA written by hand is invisible:
update it in place (``ema.lerp_(p, 1 - decay)``, ``ema.mul_(d).add_(p,
alpha=1 - d)``: in-place ops keep the dtype of what they write) or inside
``hmp.disable_casts()`` (docs/never-changes.md).
"""

import importlib
import inspect
import sys

from torch.optim.swa_utils import AveragedModel

from .casts import uncast
from .resolve import unwrap

_TIMM = ("timm.utils.model_ema", ("ModelEma", "ModelEmaV2", "ModelEmaV3"), ("update", "set"))
_LIGHTNING = (("lightning", "lightning.pytorch.callbacks"), ("pytorch_lightning", "pytorch_lightning.callbacks"))


def _method_patch(cls, name):
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, staticmethod):
        return cls, name, staticmethod(uncast(unwrap(raw.__func__)))
    return cls, name, uncast(unwrap(raw))


def _imported(package, module):
    """``module`` when ``package`` was imported by the program; None otherwise
    (or when it fails to import: averaging is then not hmp's to reach)."""
    if package not in sys.modules:
        return None
    try:
        return importlib.import_module(module)
    except Exception:
        return None


def patches():
    """``[(namespace, attr, value)]`` for every weight-averaging method hmp knows that is loaded."""
    out = [_method_patch(AveragedModel, "update_parameters")]
    module, classes, methods = _TIMM
    timm = _imported("timm", module)
    for name in classes if timm is not None else ():
        cls = getattr(timm, name, None)
        out += [_method_patch(cls, m) for m in methods if cls is not None and m in cls.__dict__]
    for package, module in _LIGHTNING:
        callbacks = _imported(package, module)
        swa = getattr(callbacks, "StochasticWeightAveraging", None)
        if swa is not None and "update_parameters" in swa.__dict__:
            out.append(_method_patch(swa, "update_parameters"))
    return out
