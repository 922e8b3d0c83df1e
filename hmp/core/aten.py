"""aten operators by name, read from torch's operator registry: which
exist, and what their schemas say (a result that is a view of an input,
the arguments an op writes). resolve.py maps them to Python names."""

import functools

import torch

from hmp.core import torch_private


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
