"""What audit, tune and profile put back after each run of the user's step.

``StateGuard`` saves, before the first run, every tensor the step can
change: the parameters and buffers (persistent or not) of the modules in
``state`` and among the arguments, the tensors the optimizers there update
(in a module or not), tensors in ``state`` and among the arguments, and
their gradients; the optimizers' ``param_groups`` and ``state``; the
learning-rate schedulers (those passed, and those driving a saved
optimizer); the RNG. ``restore()`` copies it all back into the same
objects: code holding a parameter, a state tensor or a param group still
holds the live one.

What it cannot put back is refused: an object in ``state`` of a kind it does
not know, before any run; during the first run (``checking()``), an
optimizer stepping or a module with parameters or buffers running that is
not among what was saved, before it changes anything of its own.
"""

import copy
import enum
import gc
import random
import sys
import types
from contextlib import contextmanager

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hmp.binding.module_entries import class_path
from hmp.core.torch_private import tree_leaves

# values put back as they are: immutable, or code
ATOMS = (
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    enum.Enum,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
)


def describe(obj):
    """``a torch.optim.sgd.SGD`` for error messages."""
    return f"a {class_path(type(obj))}"


def stateful(obj):
    """True for objects restored through their own state_dict()/load_state_dict()."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _changed(tensor, saved):
    if tensor.shape != saved.shape or tensor.dtype != saved.dtype or tensor.device != saved.device:
        return True
    if not torch.equal(tensor, saved):
        return True
    # equal values can differ in bits: -0.0 and 0.0
    return tensor.is_floating_point() and not torch.equal(torch.signbit(tensor), torch.signbit(saved))


def _put_tensor(tensor, saved):
    """``saved``'s values back into ``tensor``, the same object; untouched when unchanged."""
    if not _changed(tensor, saved):
        return
    with torch.no_grad():
        if tensor.shape == saved.shape and tensor.dtype == saved.dtype and tensor.device == saved.device:
            tensor.copy_(saved)
        else:  # resized or retyped in place
            tensor.data = saved.clone()


class StateGuard:
    """Saves what a step can change (see the module's docstring); ``restore()``
    puts it back. ``tool`` names the caller in error messages."""

    def __init__(self, tool, state=(), args=(), kwargs=None, fn=None):
        self.tool = tool
        self.modules, self.optimizers, self.others = [], [], []
        loose = []  # tensors given directly
        for i, obj in enumerate(state):
            if not self._add(obj, loose):
                raise TypeError(
                    f"{tool}: cannot save and restore state[{i}], {describe(obj)}: state= takes "
                    f"modules, optimizers, learning-rate schedulers, tensors and objects with "
                    f"state_dict() and load_state_dict()"
                )
        owner = getattr(fn, "__self__", fn)  # a model called as fn, or one of its bound methods
        for obj in [owner] + tree_leaves((tuple(args), dict(kwargs or {}))):
            if isinstance(obj, torch.Tensor):
                if not obj.is_inference():  # cannot be written outside inference mode: the step cannot change it
                    loose.append(obj)
            elif isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, LRScheduler)):
                self._add(obj, loose)
        self._add_schedulers_of_optimizers()
        self.tensors = self._collect_tensors(loose)
        self._ids = {id(t) for t in self.tensors}
        self.covered = {id(m) for root in self.modules for m in root.modules()}
        self.saved = self._save()
        self.checked = False

    def _add(self, obj, loose):
        if isinstance(obj, torch.nn.Module):
            bucket = self.modules
        elif isinstance(obj, torch.optim.Optimizer):
            bucket = self.optimizers
        elif isinstance(obj, torch.Tensor):
            bucket = loose
        elif stateful(obj):
            bucket = self.others
        else:
            return False
        if not any(o is obj for o in bucket):
            bucket.append(obj)
        for name in ("optimizer", "_optimizer"):  # a wrapper (accelerate, Lightning) steps the optimizer it wraps
            inner = getattr(obj, name, None) if bucket is self.optimizers else None
            if isinstance(inner, torch.optim.Optimizer) and inner is not obj:
                self._add(inner, loose)
        return True

    def _add_schedulers_of_optimizers(self):
        """A scheduler counts its steps: one driving a saved optimizer is saved
        too, passed or not (it refers to the optimizer, so gc finds it)."""
        for opt in self.optimizers:
            for obj in gc.get_referrers(opt):
                if isinstance(obj, LRScheduler) and getattr(obj, "optimizer", None) is opt:
                    self._add(obj, [])

    def _collect_tensors(self, loose):
        out, seen = [], set()
        params = [p for opt in self.optimizers for group in opt.param_groups for p in group["params"]]
        for t in (
            list(loose)
            + params
            + [t for m in self.modules for t in m.parameters()]
            + [t for m in self.modules for t in m.buffers()]
        ):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    # -- saving and restoring ----------------------------------------------------------------------

    def _save(self):
        values = [
            (t, t.detach().clone(), t.grad, None if t.grad is None else t.grad.detach().clone()) for t in self.tensors
        ]
        # which tensor each module attribute names: a forward may assign a new one (self.mean = ...)
        layout = [
            (sub, name, t)
            for m in self.modules
            for sub in m.modules()
            for name, t in list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False))
        ]
        training = [(sub, sub.training) for m in self.modules for sub in m.modules()]
        optimizers = [
            (
                opt,
                list(opt.param_groups),
                [self._keep(g, f"{describe(opt)}'s param_groups") for g in opt.param_groups],
                self._keep(opt.state, f"{describe(opt)}'s state"),
            )
            for opt in self.optimizers
        ]
        others = [(obj, self._copy(obj.state_dict(), describe(obj))) for obj in self.others]
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        if "numpy" in sys.modules:
            rng["numpy"] = sys.modules["numpy"].random.get_state()
        return values, layout, training, optimizers, others, rng

    def _copy(self, value, where):
        try:
            return copy.deepcopy(value)
        except Exception as e:
            raise TypeError(f"{self.tool}: cannot save {where}: {type(e).__name__}: {e}") from e

    def _keep(self, value, where):
        """A record of ``value``'s contents that _put() writes back into the same objects."""
        if isinstance(value, torch.Tensor):
            return value, (None if id(value) in self._ids else value.detach().clone())  # saved tensors: by _save
        if isinstance(value, dict):
            return value, [(k, self._keep(v, where)) for k, v in value.items()]
        if isinstance(value, (list, tuple)):
            return value, [self._keep(v, where) for v in value]
        if isinstance(value, ATOMS):
            return value, None
        return value, self._copy(value, f"{where} ({describe(value)})")

    def _put(self, record):
        obj, saved = record
        if isinstance(obj, torch.Tensor):
            if saved is not None:
                _put_tensor(obj, saved)
            return obj
        if isinstance(obj, dict):
            contents = [(k, self._put(r)) for k, r in saved]
            obj.clear()
            obj.update(contents)
            return obj
        if isinstance(obj, list):
            obj[:] = [self._put(r) for r in saved]
            return obj
        if isinstance(obj, tuple):
            for r in saved:
                self._put(r)
            return obj
        if isinstance(obj, ATOMS):
            return obj
        return copy.deepcopy(saved)  # a copy: the saved one must stay as it is for the next restore

    def restore(self):
        values, layout, training, optimizers, others, rng = self.saved
        for sub, name, t in layout:
            if getattr(sub, name, None) is not t:
                setattr(sub, name, t)
        for t, value, grad, grad_value in values:
            _put_tensor(t, value)
            if grad is None:
                t.grad = None
            else:
                if t.grad is not grad:
                    t.grad = grad
                _put_tensor(grad, grad_value)
        for sub, mode in training:
            sub.training = mode
        for opt, groups, group_records, state_record in optimizers:
            opt.param_groups[:] = groups
            for record in group_records:
                self._put(record)
            self._put(state_record)
        for obj, state in others:
            obj.load_state_dict(copy.deepcopy(state))
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])
        if "numpy" in rng:
            sys.modules["numpy"].random.set_state(rng["numpy"])

    # -- refusing what cannot be restored ---------------------------------------------------------

    @contextmanager
    def running(self):
        """One run of the step from the saved state; the first run is checked
        (checking()) until one completes."""
        self.restore()
        if self.checked:
            yield
            return
        with self.checking():
            yield
        self.checked = True

    @contextmanager
    def checking(self):
        """An optimizer that is not saved, or a module with parameters or
        buffers that are not, raises before it changes anything."""

        def optimizer_hook(opt, args, kwargs):
            if not any(o is opt for o in self.optimizers):
                raise RuntimeError(
                    f"{self.tool}: the step ran {describe(opt)}.step(), an optimizer not in state= (nor among the "
                    f"arguments), so the tensors it updates could not be put back; pass it in state= (this run's "
                    f"backward has already set its parameters' gradients)"
                )

        def module_hook(module, args):
            if id(module) in self.covered:
                return
            unsaved = [t for t in list(module.parameters()) + list(module.buffers()) if id(t) not in self._ids]
            if unsaved:
                raise RuntimeError(
                    f"{self.tool}: the step ran {describe(module)}, a module not in state= (nor among the "
                    f"arguments) with parameters or buffers that could not be put back; pass it, or the model "
                    f"holding it, in state="
                )

        handles = [register_optimizer_step_pre_hook(optimizer_hook), register_module_forward_pre_hook(module_hook)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
