"""Every private torch name hmp reaches, in one module: one file to read when a release breaks
something (tests/unit/test_structure.py keeps other modules off them; tests/unit/core/test_torch_private.py
checks each on the running torch).

Each entry says why hmp needs it. A name a release lacks gets a fallback here, never an error at
``import hmp``; where none keeps hmp's promise, convert() says what is missing (``checkpoint_lacks()``,
``step_lacks()``). ``PRESENT`` says which the running torch has; hmp/core/torch_releases.py holds the
first release of each.
"""

import functools
import importlib
import inspect
import operator
import sys

import torch
import torch._functorch.config as _functorch_config
import torch._guards as _guards
import torch.utils.checkpoint as _checkpoint
from torch._subclasses import fake_tensor as _fake_tensor
from torch.autograd import forward_ad as _forward_ad
from torch.jit import _builtins as _jit_builtins
from torch.utils import _python_dispatch, _pytree
from torch.utils.data import dataloader as _dataloader
from torch.utils.data._utils import worker as _worker

VERSION = torch.__version__.split("+")[0]

# -- tensors ----------------------------------------------------------------------------------

TensorBase = torch._C.TensorBase  # its C methods: casts never call a name hmp may patch (no recursion)
version_of = operator.attrgetter("_version")  # the write counter the weight cache checks (a C attrgetter)
set_grad_enabled = torch._C._set_grad_enabled  # no context manager object (the CPU cast's checks)


def current_graph_task_id():  # -1 outside a backward pass; None: an autograd thread casts until a region says not
    return getattr(torch._C, "_current_graph_task_id", None)


def _none():
    return None


def _false():
    return False


# torch.jit.is_tracing() is the public name, but it is a Python function that
# also asks about scripting; the cache asks on every call.
tracing_state = getattr(torch._C, "_get_tracing_state", None) or _none

# After dynamo's capture, torch.compile's lowering runs torch's own Python code, which calls torch's public
# functions by name; hmp decided every cast at capture, so its wrappers must then act as torch's ops. Releases
# with _compile_session_context hold _is_compiling_flag for the whole session (flag set, dynamo not tracing, not
# exporting: lowering); older ones are in session while dynamo's CompileContext is open.
_compiler = torch.compiler
dynamo_compiling = torch.compiler.is_dynamo_compiling  # folded to True while dynamo traces: a wrapper asks it first
KNOWS_COMPILE_SESSION = hasattr(_compiler, "_compile_session_context")
# where CompileContext.try_get() reads it; its __dict__ is read directly, ten times cheaper than try_get per call
_guards_tls = _guards._TLS
# export's default traces through dynamo (before 2.8): its second trace, of what dynamo
# captured, runs with no flag and no compile context, on fake tensors
_EXPORT_STRICT_BY_DEFAULT = inspect.signature(torch.export.export).parameters["strict"].default is True


def _exporting():
    return getattr(_compiler, "_is_exporting_flag", False)


# What a wrapper call runs under, asked once per call (the casts then ask nothing): EAGER, the weight-cast cache and
# the CPU range check apply; JIT_TRACE (torch.jit.trace records the ops: a cached copy would become a constant);
# COMPILING (export, AOT tracing: fake tensors); DYNAMO (dynamo traces: folded, nothing else read or guarded on);
# LOWERING (torch.compile's session after dynamo's capture, see above).
EAGER, JIT_TRACE, COMPILING, DYNAMO, LOWERING = range(5)

if KNOWS_COMPILE_SESSION:

    def compiling():
        """Anything compiles: dynamo traces, export or AOT traces, or the compile session lowers.
        torch.compiler.is_compiling() without its torch.jit.is_scripting() call, for the per-tensor checks:
        dynamo folds is_dynamo_compiling() to True while it traces; export, AOT and the session set the flag."""
        return dynamo_compiling() or _compiler._is_compiling_flag

    def after_dynamo():
        if _compiler._is_compiling_flag:
            return COMPILING if _exporting() else LOWERING
        return EAGER if tracing_state() is None else JIT_TRACE

    # the flag alone says whether anything but dynamo compiles: read by a C call, no frame
    compile_flag = functools.partial(getattr, _compiler, "_is_compiling_flag")

else:

    def compiling():
        return dynamo_compiling() or _compiler._is_compiling_flag or _in_session()

    def after_dynamo():
        if _compiler._is_compiling_flag:  # export or AOT tracing outside torch.compile
            return COMPILING
        # _in_session(), inlined: this runs once per eager call
        if (
            _guards_tls.__dict__.get("compile_context") is not None
            or _EXPORT_STRICT_BY_DEFAULT
            and _fake_mode() is not None
        ):
            return LOWERING if _inlines_modules() else COMPILING
        return EAGER if tracing_state() is None else JIT_TRACE

    # a session shows only in after_dynamo() here (no flag for it): always ask it (a C call saying True)
    compile_flag = functools.partial(bool, 1)


def _in_session():
    """Dynamo's compile context is open, or strict export traces what dynamo captured."""
    return (
        _guards_tls.__dict__.get("compile_context") is not None
        or _EXPORT_STRICT_BY_DEFAULT
        and _fake_mode() is not None
    )


_FAKE = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)


# The FakeTensorMode in force, or None (a C call): the tensors of the call are fake, nothing of theirs can be read
_fake_mode = functools.partial(torch._C._get_dispatch_mode, _FAKE) if _FAKE is not None else _none


def _inlines_modules():
    """Whether dynamo traced torch.nn modules' forwards (hmp's wrappers in
    them): where it records them as modules instead (the floor's default),
    their forwards first run when the graph is lowered, and hmp decides
    there as in traced code (torch_releases.BOUNDARIES["inline_nn_modules"]). Read in a
    compile session only, when dynamo is imported."""
    return getattr(sys.modules.get("torch._dynamo.config"), "inline_inbuilt_nn_modules", True)


def import_dynamo():
    """Import torch.compile's tracer (its package is private; no public call
    imports it without other effects). Imported while hmp's wrappers stand
    in torch's namespaces, dynamo takes some of them for torch's own
    functions and compiled code breaks its graph at every listed op."""
    importlib.import_module("torch._dynamo")


# True under vmap/grad/jvp: their tensors have no storage to cache by.
functorch_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None) or _false


# The per-tensor casts' reads, each a C call (no Python frame): the forward-AD level (>= 0 inside dual_level());
# dispatch modes in force (none: the cast calls its op's device kernel directly); the current CUDA device without
# torch.cuda's lazy init (None in a build without CUDA).
forward_ad_level = functools.partial(getattr, _forward_ad, "_current_level")
dispatch_modes = torch._C._len_torch_dispatch_stack
cuda_device = getattr(torch._C, "_cuda_getDevice", None)
below_autograd = torch._C._AutoDispatchBelowAutograd  # an op's autograd kernel calls it below autograd


def function_apply(cls):  # Function.apply without its Python (a signature bound per call): for casts no transform sees
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, cls)


# Parameters made under FakeTensorMode: they have no real storage, and torch warns (later: raises) when asked for
# their data pointer. torch imports this module itself (2.4 to 2.14).
FakeTensor = _fake_tensor.FakeTensor

# -- custom autograd Functions ----------------------------------------------------------------

# torch.amp.custom_fwd / custom_bwd mark nothing on what they decorate: a decorated forward or backward is told by
# its code object (one per decorator), and custom_fwd's ``cast_inputs`` is read from its closure. 2.4 to 2.14:
# torch.cuda.amp's deprecated decorators call torch.amp's.


def _decorated_code(decorator, **kwargs):
    try:
        return decorator(lambda *args: None, **kwargs).__code__
    except Exception:  # a torch without it: nothing is ever recognised
        return None


_CUSTOM_FWD = _decorated_code(torch.amp.custom_fwd, device_type="cpu", cast_inputs=torch.float32)
_CUSTOM_BWD = _decorated_code(torch.amp.custom_bwd, device_type="cpu")


def _closure_value(fn, name):
    code = fn.__code__
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def custom_fwd_cast(fn):
    """For a forward decorated with ``torch.amp.custom_fwd``: its
    ``cast_inputs`` dtype, or None when it has none; False when ``fn`` is
    not such a forward."""
    if _CUSTOM_FWD is None or getattr(fn, "__code__", None) is not _CUSTOM_FWD:
        return False
    return _closure_value(fn, "cast_inputs")


def custom_bwd_inner(fn):
    """The backward ``torch.amp.custom_bwd`` decorated, or None when ``fn``
    is not a decorated backward."""
    if _CUSTOM_BWD is None or getattr(fn, "__code__", None) is not _CUSTOM_BWD:
        return None
    return _closure_value(fn, "bwd")


# What autograd calls to run a custom Function's backward: its ``apply``
# gets the Function's ctx (the outputs' grad_fn) as ``self``.
BackwardCFunction = torch.autograd.function.BackwardCFunction

# Every Function class is built by this metaclass: its ``__init__`` gives the class a BackwardCFunction subclass of
# its own (``_backward_cls``, the type of the grad_fn its ``apply`` records), so a class-creation hook placed on it
# sees that class too. 2.4 to 2.13 (read), checked on the running torch.
FunctionMeta = torch.autograd.function.FunctionMeta


def backward_class(cls):
    """The backward node class (its outputs' ``grad_fn`` type) a Function class's ``apply`` records, or None."""
    found = cls.__dict__.get("_backward_cls")
    return found if isinstance(found, type) and issubclass(found, BackwardCFunction) else None


# -- ops and their namespaces -----------------------------------------------------------------

# nn.RNN/LSTM/GRU call their kernels as torch._VF.X (a module serving
# torch._C._VariableFunctions through __getattr__).
VF = torch._VF
VF_LABEL = "torch._VF"

# Namespaces where builtins generated from aten ops live under a private name
# (F.cross_entropy calls torch._C._nn.cross_entropy_loss).
ATEN_PRIVATE_HOMES = ("torch._C._nn", "torch._C._linalg", "torch._C._special", "torch._C._fft")

# Fused kernels nn.TransformerEncoder's eval fast path and nn.MultiheadAttention
# call directly: they contain a linear and follow its list.
FUSED_LINEAR_KERNELS = ("_transformer_encoder_layer_fwd", "_native_multi_head_attention")

# torch.ops.aten.X is an OpOverloadPacket when the registry has operator X.
OpOverloadPacket = torch._ops.OpOverloadPacket


overload_schema = operator.attrgetter("_schema")  # an OpOverload's FunctionSchema: no public name (2.4 to 2.15)


def composite_implicit(overload):  # no kernel of its own: it runs other ops (hmp/binding/spellings.py)
    return overload.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)


_KEYS = torch._C.DispatchKey
_COMPOSITE_KEYS = (_KEYS.CompositeExplicitAutograd, _KEYS.CompositeExplicitAutogradNonFunctional)


def composite_kernel(overload):  # the key of a kernel that only calls other ops, or None (binding/autocast_reach.py)
    return next((k for k in _COMPOSITE_KEYS if overload.has_kernel_for_dispatch_key(k)), None)


def run_kernel(overload, key, args, kwargs):  # that kernel itself, its calls dispatched as any (2.4 to 2.15)
    return overload._op_dk(key, *args, **kwargs)


def schema_of(packet, overload):
    return overload_schema(getattr(packet, overload))  # what it returns as a view, which arguments it writes


def autocast_kernels(device):  # aten ops with an Autocast<device> kernel: no public list (engine.py; 2.4 to 2.15)
    key, has = "Autocast" + device.upper(), torch._C._dispatch_has_kernel_for_dispatch_key
    names = torch._C._dispatch_get_all_op_names()
    return frozenset(n[6:].split(".")[0] for n in names if n.startswith("aten::") and has(n, key))


def all_schemas():
    """Every registered operator schema, for "did you mean" suggestions only:
    [] when this torch has no such function."""
    get = getattr(torch._C, "_jit_get_all_schemas", None)
    try:
        return get() if get is not None else []
    except Exception:
        return []


# TorchScript compiles a registered builtin by its aten name: a wrapper
# registered as its original's builtin scripts as the original.
def jit_find_builtin(fn):
    return _jit_builtins._find_builtin(fn)


def jit_register_builtin(fn, name):
    _jit_builtins._register_builtin(fn, name)


def jit_forget_builtin(key):
    """Drop the builtin registered under ``id(fn)`` (its wrapper was collected)."""
    _jit_builtins._get_builtin_table().pop(key, None)


# -- pytrees: module outputs and recorded calls are nested containers ------------------------------

tree_map = _pytree.tree_map
tree_map_only = _pytree.tree_map_only
tree_flatten = _pytree.tree_flatten
tree_leaves = _pytree.tree_leaves
tree_unflatten = _pytree.tree_unflatten

# -- regions hmp leaves alone (regions.py) ----------------------------------------------------


def autocast_enabled(region):
    """Whether a torch.autocast instance enables autocast (its ``_enabled``;
    a region entered disabled changes nothing and is not warned about)."""
    return bool(getattr(region, "_enabled", False))


# nn.Module's methods by name (engine="autocast"'s weight cache: hmp/binding/engine.py): what model.to(),
# .float() and to_empty run on every parameter; the forward torch.jit.trace runs in place of _call_impl's (2.4 to 2.15)
MODULE_APPLY, MODULE_TRACED_FORWARD = "_apply", "_slow_forward"


# backward() and grad() both call this at call time (every release from the floor on)
ENGINE_RUN_BACKWARD = "_engine_run_backward"


def engine_run_backward_homes():
    """``[(namespace, "_engine_run_backward")]``: torch.autograd.graph's and
    torch.autograd's global (export tracing copies graph's back over autograd's)."""
    return [(torch.autograd.graph, ENGINE_RUN_BACKWARD), (torch.autograd, ENGINE_RUN_BACKWARD)]


# torch's one way to write a tensor and keep its version counter: it puts the counter back afterwards
# (torch.autograd._unsafe_preserve_version_counter, FSDP2's all-gather copy-out, DDP's buffer broadcast,
# AOTAutograd's input mutations all call it by this name at call time). 2.4 takes (tensor, version), later releases
# (tensors, versions).
VERSION_COUNTER_RESET = (torch._C._autograd, "_unsafe_set_version_counter")


def object_collectives_pickler_home():
    """``(distributed_c10d, "_pickler")``: the Pickler class torch.distributed's object collectives
    (``all_gather_object``, ``broadcast_object_list``, ...) read at each call (2.4 to 2.15), or None."""
    c10d = getattr(torch.distributed, "distributed_c10d", None) if torch.distributed.is_available() else None
    return (c10d, "_pickler") if hasattr(c10d, "_pickler") else None


# DataLoader worker processes start in this function (any start method).
WORKER_MODULE = _worker
WORKER_LOOP = "_worker_loop"


def worker_loop():
    return getattr(_worker, WORKER_LOOP)


def single_process_fetch():
    """``(class, "_next_data")``: where the in-process DataLoader loads a batch, or None (elsewhere)."""
    single = getattr(_dataloader, "_SingleProcessDataLoaderIter", None)
    if single is not None and "_next_data" in single.__dict__:
        return single, "_next_data"
    return None


# -- optimizer steps (steps.py) ---------------------------------------------------------------


def record_function_exit_call():
    """``(overload, name)``: the operator overload record_function's ``__exit__`` closes its block
    with, ``torch.ops.profiler._record_function_exit._RecordFunction`` (also when the block ends by
    an exception), and the name of its own attribute that holds the C++ operator its ``__call__``
    calls (2.4 to 2.13). Setting that attribute runs code at every block's close while the overload
    object stays torch's: torch.compile, fx and inductor know it by identity. The name: the attribute
    holding the public ``.op``; where two do (2.15's second is for the hash), the one ``.op`` reads."""
    packet = getattr(torch.ops.profiler, "_record_function_exit", None)
    overload = getattr(packet, "_RecordFunction", None)
    op = getattr(overload, "op", None)
    if op is None or not callable(op):
        return None
    names = [k for k, v in vars(overload).items() if v is op]
    if len(names) > 1:
        getter = getattr(getattr(type(overload), "op", None), "fget", None)
        read = getattr(getattr(getter, "__code__", None), "co_names", ())
        names = [k for k in names if k in read]
    return (overload, names[0]) if len(names) == 1 else None


def dynamo_example_code():  # dynamo's get_fake_value: it runs a graph node for its example value (2.4 to 2.15)
    return getattr(getattr(sys.modules.get("torch._dynamo.utils"), "get_fake_value", None), "__code__", None)


# set while torch.compile compiles, None while its graphs run (2.4 to 2.15): is_compiling() is False
# before 2.13 in what dynamo runs (not traces) while compiling
compile_in_progress = _guards.TracingContext.try_get

# -- gradient checkpointing (checkpoint.py) ---------------------------------------------------

CHECKPOINT_MODULE = _checkpoint
# what non-reentrant checkpoint() calls to build its recompute: 2.14 renamed it
# (the old name is a shim around _impl); a patch on the shim would be bypassed
_GENERATORS = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")


def checkpoint_generator():
    """The generator non-reentrant ``checkpoint()`` builds its recompute with (its first argument reruns), or
    None: decided from the names the public function and its implementation look up, not from which exist."""
    called = set()
    for fn_name in ("checkpoint", "_checkpoint_impl"):
        fn = getattr(_checkpoint.__dict__.get(fn_name), "__wrapped__", None) or _checkpoint.__dict__.get(fn_name)
        code = getattr(fn, "__code__", None)
        if code is not None:
            called.update(code.co_names)
    for name in _GENERATORS:
        if name in called and callable(_checkpoint.__dict__.get(name)):
            return name
    return None


def checkpoint_function():
    """``CheckpointFunction`` (reentrant checkpoint's autograd.Function: its
    ``forward`` stores the function backward reruns), or None."""
    function = getattr(_checkpoint, "CheckpointFunction", None)
    return function if isinstance(function, type) else None


# -- RNN modules (rnn.py) ---------------------------------------------------------------------

# nn.RNNBase checks input/weight dtypes in Python, in this method
RNN_CHECK_INPUT = "check_input"
# RNNBase.mode -> the kernel it runs (rules/rnn.py lists them; errors.py names them)
RNN_MODES = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}


def rnn_flat_weights(module):
    """The weights an RNN module hands its kernel, in order."""
    return module._flat_weights


# -- wordings of torch's error messages (errors.py, rescue.py) -------------------------------

# a kernel that has no lower-precision implementation; oneDNN's wording for
# one it cannot build on this CPU (2.4's bf16 LSTM without AVX-512 BF16)
NO_KERNEL_MESSAGE = r"not implemented for '(BFloat16|Half)'|could not create a primitive descriptor"
# ops that reject mixed input dtypes say so
MIXED_DTYPE_MESSAGE = r"mixed dtype"
# a backward hook returned a gradient of another dtype
HOOK_CHANGED_TYPE_MESSAGE = r"hook '([^']*)' has changed the type of value(?: \(was (\S+) got (\S+)\))?"


def checkpoint_lacks():
    """What this torch lacks that the checkpoint rule needs, as lines ([] on the tested releases)."""
    out = []
    if checkpoint_generator() is None:
        out.append(
            f"hmp: torch {VERSION} has no non-reentrant checkpoint generator hmp knows "
            f"({', '.join(_GENERATORS)}); non-reentrant gradient checkpointing cannot be kept cast; "
            f"please report"
        )
    if checkpoint_function() is None:
        out.append(
            f"hmp: torch {VERSION} has no torch.utils.checkpoint.CheckpointFunction; reentrant gradient "
            f"checkpointing cannot be kept cast; please report"
        )
    return out


def step_lacks():
    """What this torch lacks that the optimizer-step rule needs, as lines."""
    if record_function_exit_call() is None:
        return [
            f"hmp: torch {VERSION} closes record_function blocks through no operator hmp knows; an optimizer "
            f"step that raises leaves casts off in its thread until revert(); please report"
        ]
    return []


# the base of a mode that is told each op a call dispatches (binding/aten.py's ``dispatched``)
DispatchMode = _python_dispatch.TorchDispatchMode


# -- what the running torch has (hmp/core/torch_releases.py: the first release of each) ------------

PRESENT = {
    "compile_session": KNOWS_COMPILE_SESSION,
    "autograd_cache": hasattr(_functorch_config, "enable_autograd_cache"),
    "compiling_flag": hasattr(_compiler, "_is_compiling_flag"),
    "tracing_state": hasattr(torch._C, "_get_tracing_state"),
    "graph_task_id": hasattr(torch._C, "_current_graph_task_id"),
    "functorch_transforms": hasattr(torch._C, "_are_functorch_transforms_active"),
    "version_counter_reset": hasattr(*VERSION_COUNTER_RESET),
    "checkpoint_generator": checkpoint_generator() is not None,
    "record_function_exit": record_function_exit_call() is not None,
    "jit_builtins": hasattr(_jit_builtins, "_register_builtin"),
}


def autograd_cache_switch():
    """``(config module, name)``: torch's switch for AOTAutograd's cache, or None on a torch without it."""
    return (_functorch_config, "enable_autograd_cache") if PRESENT["autograd_cache"] else None
