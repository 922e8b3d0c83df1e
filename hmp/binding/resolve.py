"""Op names to the places they live, resolved from torch itself.

A list name ``X`` binds every entry point of the op: ``torch.X``, ``F.X``,
``torch.Tensor.X``, ``__X__``/``__rX__``/``__iX__``, ``X_``, and ``torchvision.ops.X``
when installed. An aten operator name, alone or ``op.overload``, binds every builtin
generated from it (``aten_entry_points``). A name torch does not have is an error.

Three tables are kept by hand where torch's names and schemas do not show a call's
path: FUSED (fused kernels that contain a listed op), RNN_KERNELS (reached through
torch._VF) and UNMARKED_WRITERS (batch_norm's schema omits its running statistics);
tests/unit/binding/test_fused.py, rules/test_rnn.py and binding/test_written_arguments.py check them."""

import difflib
import importlib
import importlib.util
import inspect
import logging
import types
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hmp.binding import spellings
from hmp.binding.aten import aten_entry_points, aten_names, aten_op, python_builtins, schema_writes
from hmp.core import state, torch_private
from hmp.core.identity import unwrap

log = logging.getLogger("hmp")

# Fused kernels that contain a listed op but are reached without passing
# through its name (nn.TransformerEncoder's eval fast path calls
# torch._transformer_encoder_layer_fwd directly). They follow the list of the
# op they contain unless they are listed themselves.
FUSED = {
    "linear": torch_private.FUSED_LINEAR_KERNELS,
    "matmul": ("scaled_dot_product_attention",),
}

# The kernels nn.RNN, nn.LSTM, nn.GRU and their cells call. They call them as
# torch._VF.X, and torch._VF serves torch._C._VariableFunctions through a
# module __getattr__, so binding torch.X alone would never reach them.
RNN_KERNELS = frozenset(
    ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")
)


def entry_forms(name, tensor_has):
    """The binding rule: ``(on namespaces, on torch.Tensor)``, each
    ``[(attribute name, in-place)]``, the attributes list name ``name`` binds.
    ``X`` binds ``X`` and ``X_``; on torch.Tensor also, where it has
    ``__X__`` (``tensor_has(attr)``), ``__X__``, ``__rX__`` and ``__iX__``;
    Habana's ``iX`` (``iadd``) binds the in-place operator ``__iX__`` itself.
    ``list_names`` is its inverse."""
    inplace_name = None if name.endswith("_") else name + "_"
    explicit = name.endswith("_") and not name.endswith("__")
    plain = [(attr, attr is inplace_name or explicit) for attr in (name, inplace_name) if attr is not None]
    on_tensor = list(plain)
    dunder = f"__{name}__"
    if not name.startswith("_") and tensor_has(dunder):
        if name.startswith("i") and tensor_has(f"__{name[1:]}__"):
            on_tensor.append((dunder, True))  # Habana's "iadd": the in-place operator `a += b` itself
        else:
            on_tensor += [(dunder, False), (f"__r{name}__", False), (f"__i{name}__", True)]
    return plain, on_tensor


def list_names(attr):
    """The list names that may bind attribute ``attr`` by ``entry_forms``, in
    the order the error note tries them: ``__rmul__`` -> rmul, mul; ``mul_`` -> mul, mul_."""
    if attr.startswith("__") and attr.endswith("__"):
        core = attr[2:-2]
        return (core, core[1:]) if core[:1] in ("r", "i") else (core,)
    if attr.endswith("_"):
        return attr[:-1], attr
    return (attr,)


@dataclass(frozen=True)
class Site:
    """One attribute that a list name binds."""

    namespace: object
    attr: str
    owner: str  # printable namespace name
    inplace: bool  # the op writes its first argument (``X_``, ``__iX__``, or by its schema)
    inplace_param: object = None  # position of an ``inplace=`` parameter, if the function has one
    written: tuple = ()  # (position, name) of other arguments it writes (``Tensor(a!)``)

    @property
    def label(self):
        return f"{self.owner}.{self.attr}"

    def original(self):
        """What this attribute holds without hmp (its wrapper's original while converted)."""
        ns = self.namespace
        if isinstance(ns, type):
            return unwrap(inspect.getattr_static(ns, self.attr))
        own = ns.__dict__
        # torch._VF serves its functions through __getattr__: none is its own attribute
        return unwrap(own[self.attr] if self.attr in own else getattr(ns, self.attr))


class Binding(NamedTuple):
    """A site and the list entry that binds it."""

    site: Site
    kind: object  # its list's kinds.Kind (None: an op whose call picks its kernel, ``picks``, with no fallback)
    name: str  # the list name
    fallback: bool = False  # an op in no list, bound so a lower-precision input cannot break it
    picks: tuple = ()  # an op in no list whose call picks its kernel: spellings.computations' answer (picked.py)
    # a Python function decided per call whose builtin (torch._VF.X) decides its eager calls: it decides only
    # while dynamo traces, which records the function and never runs the builtin's wrapper
    traced_only: bool = False


def make_site(namespace, attr, owner, inplace, fn, inplace_param=None):
    """The Site of ``namespace.attr`` (holding ``fn``), with the arguments
    the op writes (``writes``), so a written tensor is never replaced by a
    cast copy whatever the op's name says."""
    written = writes(fn, attr)
    if any(i == 0 for i, _ in written):
        inplace, written = True, tuple(w for w in written if w[0])
    return Site(namespace, attr, owner, inplace, None if inplace else inplace_param, written)


BUILTINS = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)
# batch_norm's schema does not mark what it writes (its running statistics,
# written in C++ without a version bump); the schema of its functional form,
# _native_batch_norm_legit, marks them. The one rule by function name in
# here, a last resort: these read those parameters' names from that schema.
UNMARKED_WRITERS = ("batch_norm", "native_batch_norm", "_batch_norm_impl_index", "instance_norm")
_MARKED_FORM = "_native_batch_norm_legit"


def writes(fn, attr):
    """``((position, name), ...)``: the tensor arguments ``fn`` writes, from its aten schema
    (``Tensor(a!)``) or UNMARKED_WRITERS; by position for a builtin, by parameter name
    for a Python function, whose undeclared writes the wrapper finds after the call."""
    builtin = isinstance(fn, BUILTINS)
    own = schema_writes(getattr(fn, "__name__", attr) if builtin else attr)
    names = {name for _, name in own}
    if attr in UNMARKED_WRITERS:
        names |= {name for _, name in schema_writes(_MARKED_FORM)}
    found = set(own) if builtin else set()
    if names - {name for _, name in found}:
        found |= {(i, name) for i, name in enumerate(_parameters(fn, attr)) if name in names}
    return tuple(sorted(found))


def _parameters(fn, attr):
    """The names of ``fn``'s positional parameters: its signature, else its aten schema's."""
    try:
        return [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        packet = aten_op(getattr(fn, "__name__", attr))
        if packet is None or not packet.overloads():
            return []
        schema = torch_private.schema_of(packet, packet.overloads()[0])
        return [a.name for a in schema.arguments if not a.kwarg_only]


def subclasses(cls):
    """``cls`` and every class derived from it, at any depth, as defined now."""
    found, todo = [], [cls]
    while todo:
        c = todo.pop()
        found.append(c)
        todo.extend(c.__subclasses__())
    return found


def owner_label(owner):
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__name__


def attribute_site(owner, name):
    """The Site of ``owner.name`` for ``hmp.register()``."""
    fn = unwrap(getattr(owner, name))
    return make_site(owner, name, owner_label(owner), False, fn, _inplace_param(fn))


def _is_op(raw):
    """A plain callable, not a class, module, property or static/class method."""
    if isinstance(raw, (type, types.ModuleType, staticmethod, classmethod, property)):
        return False
    return callable(raw)


def _inplace_param(fn):
    """The position of ``fn``'s ``inplace`` parameter, or None. Builtins
    have none (their writes are in their schemas); a Python function's
    code object names its parameters (cheaper than inspect.signature)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return None
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    return names.index("inplace") if "inplace" in names else None


def _torchvision_ops():
    try:
        if importlib.util.find_spec("torchvision") is None:
            return None
        return importlib.import_module("torchvision.ops")
    except Exception as e:  # a stub without __spec__ (find_spec raises), a broken install: never fatal
        _warn_optional("torchvision.ops", e)
        return None


def _warn_optional(module, error):
    """Warn once per process that an optional module is unusable."""
    if not state.first_time(("optional module", module)):
        return
    try:
        warnings.warn(
            f"hmp: {module} is present but cannot be imported ({type(error).__name__}: {error}); hmp binds "
            f"no ops there. (hmp warns about this once per process.)",
            RuntimeWarning,
            stacklevel=4,
        )
    except Warning:  # warnings turned into errors: still not a reason for convert() to fail
        pass


def _vf_sites(name):
    """torch._VF.X for an RNN kernel: set as an attribute of torch._VF (which
    revert deletes again), it shadows __getattr__ for nn.RNNBase's calls."""
    vf = torch_private.VF
    if name not in RNN_KERNELS or not _is_op(getattr(vf, name, None)):
        return []
    return [make_site(vf, name, torch_private.VF_LABEL, False, getattr(vf, name))]


def _vf_reached(found):
    """torch._VF.X for a Python function among ``found`` that calls its kernel as ``_VF.X``
    (``torch.einsum``): for an op decided call by call, the builtin's arguments are all that
    picks the kernel, the contraction path torch computes from the sizes (opt_einsum) too, where
    the Python function's are not."""
    vf, out = torch_private.VF, []
    for site in found:
        fn = site.original()
        if not isinstance(fn, types.FunctionType) or not _is_op(getattr(vf, site.attr, None)):
            continue
        names, scope = fn.__code__.co_names, fn.__globals__
        if site.attr in names and any(scope.get(g) is vf for g in names):
            out.append(make_site(vf, site.attr, torch_private.VF_LABEL, False, getattr(vf, site.attr)))
            break
    return out


def _reaches(fn, builtins):
    """Whether the Python function ``fn`` calls one of ``builtins`` by its name (``torch.kl_div`` in
    ``F.kl_div``): the builtin's wrapper then decides ``fn``'s calls, and a second wrapper on ``fn``
    would only cost a frame per call."""
    code, scope = fn.__code__, fn.__globals__
    return any(b.attr in code.co_names and any(scope.get(g) is b.namespace for g in code.co_names) for b in builtins)


class Resolver:
    def __init__(self):
        self.namespaces = [("torch", torch), ("torch.nn.functional", F)]
        tv = _torchvision_ops()
        if tv is not None:
            self.namespaces.append(("torchvision.ops", tv))
        self._cache = {}
        self._universe = None
        self._attrs = None  # every attribute name a lookup could find

    def _may_exist(self, name):
        """False when no attribute ``sites`` would look up exists at all: a
        set lookup instead of a dozen ``getattr_static`` calls, so a list of
        100k unknown names is checked in well under a second."""
        if self._attrs is None:
            attrs = set()
            for _, module in self.namespaces:
                attrs.update(module.__dict__)
            for klass in torch.Tensor.__mro__:
                attrs.update(vars(klass))
            self._attrs = attrs
        attrs = self._attrs
        return name in attrs or name + "_" in attrs or f"__{name}__" in attrs

    def _lookup(self, namespace, attr, in_class):
        if in_class:
            try:
                raw = inspect.getattr_static(namespace, attr)
            except AttributeError:
                return None
        else:
            raw = namespace.__dict__.get(attr)
        raw = unwrap(raw)
        return raw if raw is not None and _is_op(raw) else None

    def sites(self, name):
        """Every Site that ``name`` binds; empty when torch has no such op."""
        if name in self._cache:
            return self._cache[name]
        found, T = [], torch.Tensor
        if not self._may_exist(name) and aten_op(name) is None:
            self._cache[name] = found
            return found
        plain, on_tensor = entry_forms(name, lambda attr: self._lookup(T, attr, in_class=True) is not None)
        for owner, module in self.namespaces:
            for attr, inplace in plain:
                fn = self._lookup(module, attr, in_class=False)
                if fn is not None:
                    found.append(make_site(module, attr, owner, inplace, fn, _inplace_param(fn)))
        for attr, inplace in on_tensor:
            fn = self._lookup(T, attr, in_class=True)
            if fn is not None:
                found.append(make_site(T, attr, "torch.Tensor", inplace, fn))
        found += _vf_sites(name)
        found += self._aten_sites(name, found)
        self._cache[name] = found
        return found

    def exists(self, name):
        return bool(self.sites(name))

    def bind(self, effective, fallback=()):
        """``[Binding]`` for every entry point the effective lists bind (kind -> names, in
        binding order), each site once: listed names first (a fused kernel listed by name
        keeps its list), then FUSED kernels and spellings of listed ops, then ``fallback``
        ops, then ops whose call picks its kernel (no kind). Kinds are kinds.Kind records."""
        named = [(kind, name) for kind, names in effective.items() for name in sorted(names)]
        fused = [(kind, f) for kind, name in named for f in FUSED.get(name, ())]
        listed = {name for _, name in named}
        by_kind = tuple((k, tuple(sorted(v))) for k, v in effective.items())
        spelled = spellings.spellings(by_kind, python_builtins(), RNN_KERNELS)
        extra = [(kind, name) for kind, names in fallback for name in names if name not in listed]
        # an op whose call picks its kernel by a string (picked.py); one with a rule of its own keeps it
        computations = spellings.computations(by_kind, python_builtins(), RNN_KERNELS)
        picks = spellings.picked(by_kind, python_builtins(), RNN_KERNELS, frozenset(n for _, n in extra))
        # a spelling with a decomposition of its own is decided per call, by the kernels it reaches
        per_call = spellings.per_call(by_kind, python_builtins(), RNN_KERNELS)
        kernels = spellings.kernels(computations)
        out, seen = [], set()
        # (kind, list name, the name whose sites bind, computations a call picks from, fallback)
        todo = [(k, n, n, (), False) for k, n in named + fused]
        # a spelling binds its own name's sites under the entry it follows (spellings.py); one decided per
        # call keeps, for a call that reaches no kernel entry, the fallback rule of an op in no list it may
        # have (einsum, tensordot: one dtype); with no kernel entry to reach, it is that op or torch's
        fallen = {n: k for k, n in extra}
        for k, n, s in spelled:
            if s not in per_call:
                todo.append((k, n, s, (), False))
            elif kernels:
                todo.append((fallen.get(s), s, s, kernels, s in fallen))
        todo += [(k, n, n, (), True) for k, n in extra] + [(None, n, n, computations, False) for n in picks]
        for kind, name, spelling, chosen_from, fell_back in todo:
            found = self.sites(spelling)
            inner = _vf_reached(found) if chosen_from else []
            if inner:  # decided per call: in eager code where every argument that picks a kernel is seen
                found = found + inner
            builtins = [s for s in found if isinstance(s.original(), types.BuiltinFunctionType)]
            # a Python function (F.pad, F.kl_div) reaches the kernel through the builtin: one wrapper; not in a
            # kind whose rule may read the entry's name (the lower list's norms cast the input alone, then retry)
            by_name = kind is not None and kind.norms is not None
            for site in found:
                key = (id(site.namespace), site.attr)
                outer = bool(inner) and isinstance(site.original(), types.FunctionType)
                if (
                    not outer
                    and isinstance(site.original(), types.FunctionType)
                    and (chosen_from and builtins or not by_name and _reaches(site.original(), builtins))
                ):
                    continue
                if key not in seen:
                    seen.add(key)
                    out.append(Binding(site, kind, name, fell_back, chosen_from, outer))
        return out

    def _aten_sites(self, name, found):
        """Sites of the builtins generated from ``aten::name`` (and its
        in-place ``name_``) that the Python-name lookup above did not find."""
        seen = {(id(s.namespace), s.attr) for s in found}
        extra = []
        for op in (name,) if name.endswith("_") else (name, name + "_"):
            for owner, module, attr in aten_entry_points().get(op, ()):
                if (id(module), attr) not in seen:
                    seen.add((id(module), attr))
                    extra.append(make_site(module, attr, owner, op.endswith("_"), getattr(module, attr)))
        return extra

    def check(self, name, hint=True):
        """``(op name, status, message)`` for a list entry. ``op.overload`` must be a real aten
        overload and stands for the whole op. Status: BOUND, NO_PYTHON (no Python name
        reaches it) or UNKNOWN (``message`` says why, with close matches when ``hint``)."""
        base, dot, overload = name.partition(".")
        if dot:
            packet = aten_op(base)
            if packet is None:
                message = f"unknown op {name!r} (a dotted name is an aten operator and its overload)"
                close = [overload] if hint and self.sites(overload) else self.suggest(base) if hint else []
                return name, UNKNOWN, message + (f"; did you mean {', '.join(close)}?" if close else "")
            overloads = packet.overloads()
            if overload not in overloads:
                close = suggest(overload, overloads) if hint else []
                shown = close or overloads[:6]
                more = ", ..." if not close and len(overloads) > len(shown) else ""
                return (
                    name,
                    UNKNOWN,
                    (f"unknown overload {name!r}: aten::{base} has {', '.join(f'{base}.{o}' for o in shown)}{more}"),
                )
            name = base
        if self.sites(name):
            return name, BOUND, ""
        if aten_op(name) is not None:
            return name, NO_PYTHON, ""
        close = self.suggest(name) if hint else []
        return name, UNKNOWN, f"unknown op {name!r}" + (f"; did you mean {', '.join(close)}?" if close else "")

    def suggest(self, name):
        if self._universe is None:
            names = set()
            for _, module in self.namespaces:
                names.update(a for a in dir(module) if not a.startswith("__"))
            for a in dir(torch.Tensor):
                names.add(a[2:-2] if a.startswith("__") and a.endswith("__") else a)
            names.update(aten_names())
            self._universe = sorted(names)
        return suggest(name, self._universe)


def suggest(name, universe, n=3):
    """Close matches of ``name`` in ``universe``, for error messages."""
    return difflib.get_close_matches(name, universe, n=n, cutoff=0.6)


# -- aten operator names ----------------------------------------------------------------------

BOUND, NO_PYTHON, UNKNOWN = "bound", "no-python", "unknown"
