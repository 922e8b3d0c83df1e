"""Hypothesis strategies for testing cast rules: tensors holding the values
hmp's guarantees are about, and valid calls of the ops lists name.

    from hypothesis import given
    from hmp.testing import strategies as hst

    @given(hst.calls(torch.mm))
    def test_mm(call):
        args, kwargs = call
        ...

Needs hypothesis (``pip install hypothesis``); nothing else of hmp imports
this module.
"""

import inspect

import torch
from hypothesis import strategies as st

from hmp.core.identity import unwrap
from hmp.core.switches import disable_casts
from hmp.driver.conversion import effective_lists
from hmp.testing import entries
from hmp.testing.samples import BUILDERS

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


def _made(draw, shape, dtype, edges, positive, unit, nonzero, device):
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from((1.0, 1e-3, 1e3)))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * scale
    if unit:
        x = torch.sigmoid(x / scale)  # strictly between 0 and 1
    elif positive:
        x = x.abs() + 0.1
    elif nonzero:
        x = torch.where(x < 0, x - 0.1, x + 0.1)
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


def op_for(name):
    """The public function a user calls for list name ``name`` (hmp's wrapper
    while converted): ``torch.nn.functional.X`` where it exists, else
    ``torch.X``, ``operator.X`` (``truediv``), or an aten name's submodule
    function (``linalg_multi_dot``: ``torch.linalg.multi_dot``); None if none."""
    return entries.public_function(name)


def _name_of(op):
    """The BUILDERS name whose arguments fit ``op``, or None."""
    if isinstance(op, str):
        return op if op in BUILDERS else None
    fn = unwrap(op)
    for name in BUILDERS:
        public = op_for(name)
        if public is None:
            continue
        if unwrap(public) is fn:
            return name
        # torch.X and the method torch.Tensor.X take the same arguments (the tensor first)
        method = inspect.getattr_static(torch.Tensor, name, None)
        if method is not None and unwrap(method) is fn and getattr(torch, name, None) is public:
            return name
    return None


_PROBE_SHAPES = ((3,), (3, 3), (2, 3, 3))


def _probe(op):
    """A builder for an op hmp has none for: the first call with one to three
    float32 tensors of one shape that torch runs (with hmp's casts off)."""
    for shape in _PROBE_SHAPES:
        for arity in (1, 2, 3):
            try:
                with disable_casts():
                    op(*(torch.rand(shape) + 0.5 for _ in range(arity)))
            except Exception:
                continue
            return lambda g, shape=shape, arity=arity: (tuple(g.t(*shape, positive=True) for _ in range(arity)), {})
    return None


def builder(op):
    """The builder of calls of ``op`` (a callable or a list name), or None."""
    name = _name_of(op)
    if name is not None:
        return BUILDERS[name]
    fn = op_for(op) if isinstance(op, str) else op
    return _probe(fn) if callable(fn) else None


def calls(op, *, dtypes=(FP32, BF16), mixed=True, edges=False, device="cpu", build=None):
    """Valid ``(args, kwargs)`` of ``op`` (a callable, or a list name for the
    function ``op_for`` gives), for every op in hmp's shipped lists and, by
    trying a call with one to three tensors, many others. Each floating
    tensor's dtype is drawn from ``dtypes`` (``mixed=False``: one dtype per
    call); ``edges=True`` puts edge values in (see ``tensors``). ``build``:
    your own builder for an op without one, ``build(g) -> (args, kwargs)``
    drawing from ``g`` (``g.size()``, ``g.t(*shape)``, ``g.idx(high,
    *shape)``, ``g.mask(*shape)``, ``g.pick(options)``, ``g.flag()``)."""
    make = build or builder(op)
    if make is None:
        raise LookupError(
            f"hmp.testing.strategies.calls: no sample calls for {getattr(op, '__name__', op)!r}: hmp has no builder "
            f"for it and no call with one to three float tensors runs; pass build=lambda g: (args, kwargs)"
        )

    @st.composite
    def draw_call(draw):
        with disable_casts():  # a builder's own arithmetic (indices + 1) is no call under test
            return make(_Draw(draw, dtypes, mixed, edges, device))

    return draw_call()


def listed_calls(kinds=None, **options):
    """``(op, args, kwargs)`` for an entry drawn from the lists in force when
    the example is drawn (convert first: the ``hmp`` marker or the
    ``hmp_converted`` fixture), among ``kinds`` (list names such as
    ``"bf16"``; None: every list); entries without sample
    calls and module entries are left out. ``options`` go to ``calls``."""

    @st.composite
    def draw_listed(draw):
        in_force = effective_lists()
        names = sorted({n for k in kinds or in_force for n in in_force.get(k, ()) if builder(n) is not None})
        if not names:
            raise ValueError("hmp.testing.strategies.listed_calls: no listed op with sample calls (is hmp converted?)")
        name = draw(st.sampled_from(names))
        op = op_for(name)
        args, kwargs = draw(calls(name, **options))
        return op, args, kwargs

    return draw_listed()
