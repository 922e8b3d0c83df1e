"""hmp as a Lightning precision plugin.

::

    import lightning.pytorch as pl
    from hmp.integrations.lightning import HMPPrecision

    trainer = pl.Trainer(accelerator="cpu", plugins=[HMPPrecision(opt_level="O1")])
    trainer.fit(model, data)

The plugin converts hmp when the Trainer sets up a run (``fit``,
``validate``, ``test``, ``predict``) and reverts when the run ends, also
when it ends with an exception. A conversion that was active before the run
is restored afterwards, so Trainers in one process do not leak into each
other.

While a run is on, hmp casts only inside the steps (``training_step``,
``validation_step``, ...; Lightning enters the plugin's ``forward_context``
around each) and not inside ``self.log``/``self.log_dict`` called from a
step: Lightning's own bookkeeping (logging, metric reduction, callbacks,
the loops), the optimizer step and gradient clipping run in the run's
thread with casts off, so logged values are fp32 arithmetic on the logged
tensors.

Needs ``lightning`` (``pip install lightning``, or ``pip install ".[lightning]"`` in a
checkout of hmp); importing ``hmp`` or ``hmp.integrations`` does not import it.
"""

import contextlib
import logging
import warnings

import torch
from lightning.pytorch.plugins import Precision
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision

try:
    from torch.distributed.fsdp import MixedPrecision
except ImportError:  # a torch built without torch.distributed: FSDP cannot run either
    MixedPrecision = None

from hmp.binding.resolve import Resolver
from hmp.core.switches import casts_enabled, disable_casts, enable_casts
from hmp.driver import conversion, queries
from hmp.driver.plan import PARAMETERS, Requested, plan, requested

log = logging.getLogger("hmp")

__all__ = ["HMPPrecision", "HMPFSDPPrecision"]


class HMPPrecision(Precision):
    """Lightning precision plugin that trains with hmp's list-driven mixed precision.

    The arguments are :func:`hmp.convert`'s: ``None`` or ``""`` for a path
    means hmp's default list. The lists are checked here, so a bad file
    fails when the plugin is made, not in the middle of ``fit``.
    ``fp32_modules`` / ``bf16_modules`` take module classes, import paths,
    or names matched against the LightningModule's ``named_modules()``
    (``"model.lm_head"``, ``"*.post_attention_layernorm"``) when the run
    starts.
    """

    def __init__(self, *args, **options):
        super().__init__()
        self._setup(*args, **options)

    def _setup(self, *args, verbose=None, **options):
        """Take convert()'s options (all of them, as convert() spells them), checked now: a bad
        file fails here, not in ``fit``. ``verbose=``, the plugin's earlier name for ``isVerbose``,
        still works and says so once."""
        if verbose is not None:
            warnings.warn(
                "hmp: HMPPrecision(verbose=...) is isVerbose=..., as convert() names it", FutureWarning, stacklevel=3
            )
            options["isVerbose"] = verbose
        self.options = requested(*args, **options)
        if "model" in self.options:
            raise TypeError("hmp: the plugin matches fp32_modules/bf16_modules against the LightningModule itself")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convert() warns about O2 and files when the run starts
            plan(Requested(**{**self.options, "fp32_modules": None, "bf16_modules": None}))  # names need the model
        self.precision = "bf16-mixed" if self.low_precision_type is torch.bfloat16 else "16-mixed"
        self._active = False
        self._previous = None
        self._run_off = None  # the disable_casts() block a run's own code runs in
        self._steps_cast = False  # whether steps cast: casts were on where the run started

    def __getattr__(self, name):
        options = self.__dict__.get("options")
        if options is not None and name in PARAMETERS:  # plugin.opt_level, plugin.fp32_modules, ...
            return options.get(name, PARAMETERS[name].default)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self):
        given = ", ".join(f"{name}={value!r}" for name, value in self.options.items())
        return f"{type(self).__name__}({given})"

    # -- start and end of a run -------------------------------------------------

    def convert(self, model=None):
        """Convert hmp with this plugin's settings (the Trainer calls it with
        the model, which module names are matched against)."""
        resolver = Resolver()  # one for checking the lists and binding them: names resolve once
        wanted = plan(Requested(**{**self.options, "model": model}), resolver)
        if not self._active:
            self._previous = queries.in_force()  # None when hmp is not converted
        conversion.install(wanted, resolver)
        self._active = True

    def revert(self):
        """Undo :meth:`convert`, restoring a conversion that was active before it."""
        if not self._active:
            return
        self._active = False
        previous, self._previous = self._previous, None
        conversion.restore(previous)

    def connect(self, model, optimizers, lr_schedulers):
        # Strategy.setup() calls this once per run, after the model is on its device.
        self.convert(model)
        if self._run_off is None:  # casts off in the run's thread, on again inside steps
            self._steps_cast = casts_enabled()
            self._run_off = disable_casts()
            self._run_off.__enter__()
        return super().connect(model, optimizers, lr_schedulers)

    def teardown(self):
        # Strategy.teardown() calls this at the end of every run, also after an exception.
        try:
            if self._run_off is not None:
                run_off, self._run_off = self._run_off, None
                run_off.__exit__(None, None, None)
            self.revert()
        finally:
            super().teardown()

    @contextlib.contextmanager
    def forward_context(self):
        """Casts on inside a step (Lightning enters this around each
        ``*_step`` call and the model summary's forward), unless the run
        started where casts were off."""
        with enable_casts() if self._run_off is not None and self._steps_cast else contextlib.nullcontext():
            yield

    # -- optimizer math in fp32 -------------------------------------------------

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        """``optimizer.step`` under ``hmp.disable_casts()``; the closure it
        calls runs with the casts of the code that asked for the step: a
        ``training_step`` (automatic optimization) or the code inside one
        (manual optimization with a closure) runs with casts on."""
        if casts_enabled():
            closure = enable_casts()(closure)  # inside the step's disable_casts() block below

        with disable_casts():
            return super().optimizer_step(optimizer, model, closure, **kwargs)

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None, **kwargs):
        with disable_casts():
            if gradient_clip_algorithm is None:
                return super().clip_gradients(optimizer, clip_val, **kwargs)
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm, **kwargs)


class HMPFSDPPrecision(HMPPrecision, FSDPPrecision):
    """hmp's plugin for Lightning's ``FSDPStrategy`` (FSDP1), which takes
    only an ``FSDPPrecision``::

        trainer = pl.Trainer(strategy=FSDPStrategy(...), plugins=[HMPFSDPPrecision()])

    FSDP casts each unit's parameters to ``param_dtype`` before it gathers
    them and reduces gradients in ``reduce_dtype`` (torch's
    ``MixedPrecision``; by default the low dtype and float32), and hmp, as
    :class:`HMPPrecision` does, computes the float32 islands its lists name
    (losses, softmax, normalisations) in float32 from them: the recipe of
    docs/distributed.md. ``param_dtype=torch.float32`` gathers float32
    weights and lets hmp cast each instead, which keeps a lower-precision copy
    of every full weight from forward to backward. A ``mixed_precision``
    given to ``FSDPStrategy`` itself wins over both. Buffers keep their dtype.
    With ``low_precision_type=torch.float16`` Lightning's sharded gradient
    scaler scales the loss, as its own ``FSDPPrecision("16-mixed")`` does.
    """

    def __init__(self, *args, param_dtype=None, reduce_dtype=torch.float32, **options):
        self._setup(*args, **options)
        FSDPPrecision.__init__(self, self.precision)
        self.param_dtype = self.low_precision_type if param_dtype is None else param_dtype
        self.reduce_dtype = reduce_dtype

    @property
    def mixed_precision_config(self):
        return MixedPrecision(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
