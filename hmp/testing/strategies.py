"""Hypothesis strategies for testing cast rules: tensors holding the values
hmp's guarantees are about, and valid calls of the ops lists name.

    from hypothesis import given
    from hmp.testing import strategies as hst

    @given(hst.calls(torch.mm))
    def test_mm(call):
        args, kwargs = call
        ...

Needs hypothesis (``pip install hypothesis``, or the ``testing`` extra); nothing else of hmp
imports this module. Asking for a strategy never touches the program's random
streams: a builder is found, and an op without one probed, on values from a
private generator, the same answer for every seed.
"""

import warnings

import torch

from hmp.testing import NEEDS

try:
    from hypothesis import assume
    from hypothesis import strategies as st
except ModuleNotFoundError as e:  # an ImportError that says what to install
    if e.name != "hypothesis":
        raise
    raise ModuleNotFoundError(
        f"hmp.testing.strategies needs hypothesis: {NEEDS}",
        name="hypothesis",
    ) from e

from hmp.binding import aten, resolve
from hmp.core.identity import unwrap
from hmp.core.switches import disable_casts
from hmp.driver.queries import effective_lists
from hmp.testing import entries
from hmp.testing.samples import BUILDERS
from hmp.testing.samples_extra import SPELLED, spd

FP32, BF16 = torch.float32, torch.bfloat16
_BF16_MAX = torch.finfo(BF16).max
_FP32_MAX = torch.finfo(FP32).max
# the values hmp's guarantees are about (docs/never-changes.md): the ends of bfloat16's,
# float16's and float32's ranges and just beyond them, infinities, NaN, subnormals, -0.0
EDGES = (
    _BF16_MAX,
    -_BF16_MAX,
    3.4e38,  # beyond bfloat16's largest finite value, within float32's: a plain cast gives inf
    _FP32_MAX,
    -_FP32_MAX,
    65504.0,  # float16's largest
    65520.0,  # the first value float16 rounds to inf
    float("inf"),
    float("-inf"),
    float("nan"),
    1e-45,  # float32's smallest subnormal
    9.2e-41,  # bfloat16's smallest subnormal
    torch.finfo(FP32).tiny,
    -0.0,
)
_SHAPES = st.lists(st.integers(1, 4), max_size=3).map(tuple)


def _strategy(value, default):
    if value is None:
        return default
    if isinstance(value, st.SearchStrategy):
        return value
    return st.just(value)


def _dtypes(dtypes):
    if isinstance(dtypes, st.SearchStrategy):
        return dtypes
    if isinstance(dtypes, torch.dtype):
        return st.just(dtypes)
    return st.sampled_from(tuple(dtypes))


@st.composite
def _values(draw, shape, dtype, edges, positive=False, unit=False, nonzero=False, device="cpu"):
    """A float32 tensor of ``shape`` from a drawn seed and scale, with drawn
    edge values at drawn places; then in ``dtype`` on ``device``. Made with
    hmp's casts off: examples are drawn while the test runs converted."""
    with disable_casts():
        return _made(draw, shape, dtype, edges, positive, unit, nonzero, device)


def _shaped(gen, shape, scale, positive, unit, nonzero):
    """float32 values of ``shape`` from ``gen`` (a private generator)."""
    x = torch.randn(shape, generator=gen) * scale
    if unit:
        return torch.sigmoid(x / scale)  # strictly between 0 and 1
    if positive:
        return x.abs() + 0.1
    return torch.where(x < 0, x - 0.1, x + 0.1) if nonzero else x


def _made(draw, shape, dtype, edges, positive, unit, nonzero, device):
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from((1.0, 1e-3, 1e3)))
    x = _shaped(torch.Generator().manual_seed(seed), shape, scale, positive, unit, nonzero)
    if edges and not unit and x.numel():
        flat = x.reshape(-1)
        for _ in range(draw(st.integers(0, min(3, flat.numel())))):
            value = draw(st.sampled_from(EDGES))
            if positive:
                value = abs(value)
            if nonzero and value == 0:
                continue
            flat[draw(st.integers(0, flat.numel() - 1))] = value
    return x.to(device=device, dtype=dtype)


def tensors(dtypes=FP32, shapes=None, *, edges=False, device="cpu", requires_grad=False):
    """Floating tensors: ``dtypes`` (a dtype, a sequence, or a strategy),
    ``shapes`` (a shape, or a strategy of shapes; default: up to 3
    dimensions of 1 to 4). Values are finite; ``edges=True`` also puts some
    of EDGES in (bfloat16's largest finite value and just beyond it,
    float16's, float32's, infinities, NaN, subnormals), each rounded to the
    tensor's dtype as torch rounds."""

    @st.composite
    def draw_tensor(draw):
        shape = draw(_strategy(shapes, _SHAPES))
        t = draw(_values(tuple(shape), draw(_dtypes(dtypes)), edges, device=device))
        return t.requires_grad_() if requires_grad else t

    return draw_tensor()


class _Draw:
    """What a builder of hmp/testing/samples.py draws from: ``size(lo, hi)``,
    ``t(*shape, positive=, unit=, nonzero=)`` (a floating tensor),
    ``idx(high, *shape)`` and ``distinct(high, k)`` (long indices),
    ``mask(*shape)``, ``pick(options)``, ``flag()``."""

    def __init__(self, draw, dtypes, mixed, edges, device):
        self._draw, self._dtypes, self._edges, self._device = draw, tuple(dtypes), edges, device
        self._one = None if mixed else draw(st.sampled_from(self._dtypes))

    def size(self, lo=1, hi=4):
        return self._draw(st.integers(lo, hi))

    def flag(self):
        return self._draw(st.booleans())

    def pick(self, options):
        return self._draw(st.sampled_from(list(options)))

    def t(self, *shape, positive=False, unit=False, nonzero=False):
        dtype = self._one if self._one is not None else self._draw(st.sampled_from(self._dtypes))
        return self._draw(_values(shape, dtype, self._edges, positive, unit, nonzero, self._device))

    def _generator(self):
        return torch.Generator().manual_seed(self._draw(st.integers(0, 2**32 - 1)))

    def idx(self, high, *shape):
        return torch.randint(0, high, shape, generator=self._generator()).to(self._device)

    def distinct(self, high, k):
        return torch.randperm(high, generator=self._generator())[:k].to(self._device)

    def mask(self, *shape):
        return (torch.rand(shape, generator=self._generator()) < 0.5).to(self._device)


class _Fixed:
    """The draws of a builder made without hypothesis, the same every time:
    sizes just above their floor, the first option, no flags, values from a
    private generator. A builder is tried on these to see that it fits an op."""

    def __init__(self):
        self._gen = torch.Generator().manual_seed(0)

    def size(self, lo=1, hi=4):
        return min(lo + 1, hi)

    def flag(self):
        return False

    def pick(self, options):
        return list(options)[0]

    def t(self, *shape, positive=False, unit=False, nonzero=False):
        return _shaped(self._gen, shape, 1.0, positive, unit, nonzero)

    def idx(self, high, *shape):
        return torch.randint(0, high, shape, generator=self._gen)

    def distinct(self, high, k):
        return torch.randperm(high, generator=self._gen)[:k]

    def mask(self, *shape):
        return torch.rand(shape, generator=self._gen) < 0.5


def op_for(name):
    """The public function a user calls for list name ``name`` (hmp's wrapper
    while converted): ``torch.nn.functional.X`` where it exists, else
    ``torch.X``, ``operator.X`` (``truediv``), an aten name's submodule
    function (``linalg_multi_dot``: ``torch.linalg.multi_dot``), or the
    builtin torch generates for aten operator ``name`` (``reflection_pad1d``:
    ``torch._C._nn.reflection_pad1d``); None if none."""
    found = entries.public_function(name)
    if found is None:
        for _, module, attr in _aten_entry_points().get(name, ()):
            found = getattr(module, attr, None)
            if callable(found):
                break
    return found


def _copied(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return {k: _copied(v) for k, v in value.items()} if isinstance(value, dict) else value


def _aten_entry_points():
    # hmp.binding.aten's (older checkouts: hmp.binding.resolve's)
    return (getattr(aten, "aten_entry_points", None) or resolve.aten_entry_points)()


def _runs(fn, make):
    """Whether ``fn`` runs the call ``make`` builds from fixed draws (hmp's
    casts off; the random stream, which the op may draw from, put back)."""
    try:
        with torch.random.fork_rng(devices=[]), disable_casts(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args, kwargs = make(_Fixed())
            fn(*args, **kwargs)
    except Exception:
        return False
    return True


def _probes():
    """Builders for an op hmp has none for, in the order they are tried: one
    to three positive vectors, vectors in (0, 1), symmetric positive-definite matrices (what
    linear algebra needs: cholesky, solve, inv), then general matrices."""
    found = [(lambda g, a=a: (tuple(g.t(3, positive=True) for _ in range(a)), {})) for a in (1, 2, 3)]
    found += [(lambda g, a=a: (tuple(g.t(3, unit=True) for _ in range(a)), {})) for a in (1, 2)]  # probabilities
    found += [(lambda g, a=a: (tuple(spd(g, n=3) for _ in range(a)), {})) for a in (1, 2)]
    for shape in ((3, 3), (2, 3, 3)):
        found += [(lambda g, s=shape, a=a: (tuple(g.t(*s, positive=True) for _ in range(a)), {})) for a in (1, 2, 3)]
    return found


def _spellings(op):
    """The list names that may name ``op`` (a callable or a list name), and
    the callable: every name torch gives it (``torch.X``, ``F.X``,
    ``Tensor.X``, ``X_``, ``torch.linalg``/``torch.special`` aliases, the aten
    name a builtin carries)."""
    fn = op_for(op) if isinstance(op, str) else op
    names = [op] if isinstance(op, str) else []
    if callable(fn):
        own = getattr(unwrap(fn), "__name__", None)
        found = set(entries.call_of(fn, ()).names) | (_aliases(own) if isinstance(own, str) else set())
        names += sorted(found - set(names), key=lambda n: (n.startswith("_"), len(n), n))
    return fn, names


def _aliases(own):
    """The list names a function's own name gives: ``special_log_softmax``:
    ``log_softmax``; ``add_``: ``add``; ``__radd__``: ``add``."""
    found = {own, own.rstrip("_")}
    if own.startswith("__") and own.endswith("__"):
        x = own[2:-2]
        found |= {x, x[1:]} if x[:1] in ("r", "i") else {x}
    for prefix in ("special_", "linalg_", "fft_", "nn_"):
        if own.startswith(prefix):
            found.add(own[len(prefix) :])
    return {n for n in found if n}


# kept: the testing kit's builder found for an op, probed once
_FOUND = {}


def builder(op):
    """The builder of calls of ``op`` (a callable or a list name), or None:
    hmp's own for any name of the op whose builder fits it, else the first
    probe torch runs. Found on fixed values, never on the program's random
    streams, so the answer is the same for every seed."""
    try:
        key = op if isinstance(op, str) else unwrap(op)
        return _FOUND[key]
    except KeyError:
        pass
    except TypeError:  # unhashable
        key = None
    found = _builder(op)
    if key is not None:
        _FOUND[key] = found
    return found


def _at(path):
    """The attribute ``path`` (``"torch.linalg.lu_solve"``) names, or None."""
    found = torch
    for part in path.split(".")[1:]:
        found = getattr(found, part, None)
    return found


def _builder(op):
    fn, names = _spellings(op)
    if not callable(fn):
        return None
    for path, make in SPELLED.items():  # a spelling whose arguments differ from the list name's function
        at = _at(path)
        if at is not None and unwrap(at) is unwrap(fn):
            return make
    for name in names:
        make = BUILDERS.get(name)
        if make is None:
            continue
        public = op_for(name)
        if public is not None and unwrap(public) is unwrap(fn):
            return make
        if _runs(fn, make):  # another spelling (torch.softmax, Tensor.softmax): its builder must fit
            return make
    return next((make for make in _probes() if _runs(fn, make)), None)


def calls(op, *, dtypes=(FP32, BF16), mixed=True, edges=False, device="cpu", build=None):
    """Valid ``(args, kwargs)`` of ``op`` (a callable under any of its names:
    ``torch.X``, ``F.X``, ``Tensor.X``, ``torch.linalg``/``torch.special``
    aliases; or a list name, for the function ``op_for`` gives), for every op
    in hmp's shipped lists and, by trying calls with one to three tensors
    (vectors, positive-definite matrices, matrices), many others. Each floating
    tensor's dtype is drawn from ``dtypes`` (``mixed=False``: one dtype per
    call); ``edges=True`` puts edge values in (see ``tensors``). ``build``:
    your own builder for an op without one, ``build(g) -> (args, kwargs)``
    drawing from ``g`` (``g.size()``, ``g.t(*shape)``, ``g.idx(high,
    *shape)``, ``g.mask(*shape)``, ``g.pick(options)``, ``g.flag()``)."""
    make = build or builder(op)
    if make is None:
        raise LookupError(
            f"hmp.testing.strategies.calls: no sample calls for {getattr(op, '__name__', op)!r}: hmp has no builder "
            f"for it and no call with one to three float tensors (vectors, positive-definite matrices, matrices) runs; "
            f"pass build=lambda g: (args, kwargs)"
        )

    @st.composite
    def draw_call(draw):
        with disable_casts():  # a builder's own arithmetic (indices + 1) is no call under test
            return make(_Draw(draw, dtypes, mixed, edges, device))

    return draw_call()


def _in_force(kinds):
    in_force = effective_lists()
    return sorted({n for k in kinds or in_force for n in in_force.get(k, ()) if "." not in n and "*" not in n})


# kept: the testing kit's builder found for an op, probed once
_REMOVED = {}


def removed(op):
    """True where the running torch keeps a function's name but removed the function: it raises
    saying so for any input (torch 2.15's torch.cholesky and torch.qr). By its message, a last
    resort: torch marks such a name nowhere else. Such an op is not in this torch."""
    fn = op_for(op) if isinstance(op, str) else op
    if fn is None:
        return False
    key = getattr(fn, "__qualname__", None) or repr(fn)
    if key not in _REMOVED:
        try:
            with disable_casts(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn(torch.eye(2))
            _REMOVED[key] = False
        except Exception as e:
            _REMOVED[key] = "is now removed" in str(e)
    return _REMOVED[key]


def without_calls(kinds=None):
    """``{list name: why}`` of the entries of the lists in force (among
    ``kinds``; None: every list) that no drawn call exercises: no Python
    function reaches the op, or hmp has no builder for it and no probe runs.
    Module entries are left out. Assert it is empty beside a test that draws
    ``listed_calls``: such an entry is otherwise never checked."""
    missing = {}
    for name in _in_force(kinds):
        if removed(name):
            continue  # torch removed it: nothing calls it here
        if op_for(name) is None:
            missing[name] = "no Python function reaches it in this torch"
        elif builder(name) is None:
            missing[name] = (
                "no sample calls: register a builder (hmp.testing.samples) or test it with calls(op, build=)"
            )
    return missing


def listed_calls(kinds=None, *, skip_missing=False, **options):
    """``(op, args, kwargs)`` for an entry drawn from the lists in force when
    the example is drawn (convert first: the ``hmp`` marker or the
    ``hmp_converted`` fixture), among ``kinds`` (list names such as
    ``"bf16"``; None: every list); module entries are left out, and so are
    drawn calls plain torch rejects (edge values into a solver). An entry
    without sample calls (``without_calls``) fails the draw, naming it,
    unless ``skip_missing=True`` leaves it out. ``options`` go to ``calls``."""

    @st.composite
    def draw_listed(draw):
        missing = without_calls(kinds)
        if missing and not skip_missing:
            raise LookupError(
                "hmp.testing.strategies.listed_calls: entries no drawn call exercises: "
                + "; ".join(f"{n} ({why})" for n, why in missing.items())
                + " (skip_missing=True leaves them out)"
            )
        names = [n for n in _in_force(kinds) if n not in missing]
        if not names:
            raise ValueError("hmp.testing.strategies.listed_calls: no listed op with sample calls (is hmp converted?)")
        name = draw(st.sampled_from(names))
        op = op_for(name)
        args, kwargs = draw(calls(name, **options))
        assume(_runs(op, lambda _: _copied((args, kwargs))))  # torch rejects it either way (NaN into cholesky)
        return op, args, kwargs

    return draw_listed()
