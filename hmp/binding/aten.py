"""aten operators by name, read from torch's operator registry: which
exist, and what their schemas say (a result that is a view of an input,
the arguments an op writes). resolve.py maps them to Python names."""

import functools
import importlib
import types

import torch

from hmp.core import torch_private
from hmp.core.identity import unwrap


def aten_op(name):
    """``torch.ops.aten.<name>`` (an OpOverloadPacket) when torch's operator
    registry has that operator, else None."""
    if not name.isidentifier() or name.startswith("__"):
        return None
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None
    return packet if isinstance(packet, torch_private.OpOverloadPacket) else None


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def returns_view(name):
    """True when ``aten::name`` returns a view of an input (by its schema:
    a result that aliases an argument without writing it, as ``t``,
    ``transpose``, ``view``, ``reshape``, ``split``, ``to``). Such an op is
    never cast: its result must be a view of the tensor it was given, so
    writes through it reach that tensor (docs/never-changes.md)."""
    packet = aten_op(name)
    if packet is None:
        return False
    for overload in packet.overloads():
        for ret in torch_private.schema_of(packet, overload).returns:
            alias = ret.alias_info
            if alias is not None and not alias.is_write:
                return True
    return False


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def schema_writes(name):
    """``((position, name), ...)`` of the tensor arguments ``aten::name``
    writes (``Tensor(a!)``), over all its overloads; keyword-only ones
    (``out``) are left to the ``out=`` rule."""
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None  # dunders too (__iand__)
    if not isinstance(packet, torch_private.OpOverloadPacket):
        return ()
    found = set()
    for overload in packet.overloads():
        for i, arg in enumerate(torch_private.schema_of(packet, overload).arguments):
            alias = arg.alias_info
            if alias is not None and alias.is_write and not arg.kwarg_only and "Tensor" in str(arg.type):
                found.add((i, arg.name))
    return tuple(sorted(found))


def aten_names():
    """Every aten operator name the registry reports, for suggestions only."""
    schemas = torch_private.all_schemas()  # [] when it fails: suggestions are a nicety
    return {s.name[6:] for s in schemas if s.name.startswith("aten::")}


# Where builtin functions generated from aten operators live. Each such
# builtin carries its operator's name (torch.linalg.multi_dot.__name__ ==
# "linalg_multi_dot", F.logsigmoid.__name__ == "log_sigmoid"), so scanning
# these namespaces maps an operator to every Python name that calls it,
# private ones included (F.cross_entropy looks up
# torch._C._nn.cross_entropy_loss at call time). torch._C._VariableFunctions
# is left out: torch.X is the public name of each of its builtins.
ATEN_HOMES = (
    "torch",
    "torch.nn.functional",
    *torch_private.ATEN_PRIVATE_HOMES,
    "torch.linalg",
    "torch.special",
    "torch.fft",
)


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def aten_entry_points():
    """``{aten op name: [(owner, module, attr), ...]}`` for every builtin in
    ATEN_HOMES whose name is an aten operator; built once (a namespace entry
    hmp has wrapped is looked at through its original)."""
    table = {}
    for owner in ATEN_HOMES:
        module = importlib.import_module(owner)
        for attr, value in list(vars(module).items()):
            fn = unwrap(value)
            if attr.startswith("__") or not isinstance(fn, types.BuiltinFunctionType):
                continue
            op = getattr(fn, "__name__", None)
            if isinstance(op, str) and aten_op(op) is not None:
                table.setdefault(op, []).append((owner, module, attr))
    return table


# kept: a memo of what torch or a shipped file says, the same for every call, never written by one
@functools.lru_cache(maxsize=None)
def python_builtins():
    """``((aten op name, builtin), ...)``: one builtin generated from each aten
    operator a Python name reaches: those of ATEN_HOMES, and for a Python
    function of ``torch`` named after an operator (``torch.einsum``,
    ``torch.tensordot``) the builtin it calls through torch._VF."""
    found = {op: getattr(module, attr) for op, places in aten_entry_points().items() for _, module, attr in places[:1]}
    for attr, value in list(vars(torch).items()):
        fn = unwrap(value)
        if isinstance(fn, types.FunctionType) and fn.__name__ == attr and attr not in found and aten_op(attr):
            builtin = getattr(torch_private.VF, attr, None)
            if isinstance(builtin, types.BuiltinFunctionType):
                found[attr] = builtin
    return tuple(sorted(found.items()))


def makes_view(overload):
    """True for an OpOverload whose every output aliases an input it does not write: it
    computes nothing (tools/launches.py counts no kernel for it; spellings.py no work)."""
    schema = torch_private.overload_schema(overload)
    if not schema.returns or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


class _Reached(torch_private.DispatchMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        args, kwargs = self.seen(func, args, kwargs) or (args, kwargs)  # told (seen may cast), not kept
        return func(*args, **kwargs)


def dispatched(fn, seen, *args, **kwargs):
    """``fn(*args, **kwargs)``'s result; ``seen(overload, args, kwargs)``, told each op it dispatches
    (pays.py classifies names by them, tools/launches.py counts kernels), may return its new args."""
    with _Reached(seen):
        return fn(*args, **kwargs)
