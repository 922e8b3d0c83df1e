"""A finite value stays finite (docs/never-changes.md): nothing hmp casts
turns a finite value into inf or NaN, whatever carries it: a tensor of any
shape, a 0-dim tensor, a value inside a list argument, a Python, numpy or
other real number.

The oracles come from the dtypes' definitions, not from hmp: a cast to the
lower dtype of a finite value is finite, and rounds to the nearest value of
that dtype when the dtype can hold it; plain torch computes every op here
in float32, and where its result is finite, hmp's is too.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp

FP32, LOWS = torch.float32, (torch.bfloat16, torch.float16)
F32_MAX = torch.finfo(FP32).max

# values around both ends of every range involved, and ordinary ones
_edges = st.sampled_from(
    [
        F32_MAX,
        -F32_MAX,
        3.3961e38,
        3.3895e38,
        1e38,
        65504.0,
        65520.0,
        7e4,
        1e5,
        -1e5,
        0.0,
        1.0,
        -2.5,
        float("inf"),
        float("-inf"),
    ]
)
_values = st.one_of(_edges, st.floats(width=32, allow_nan=False, allow_subnormal=False))
_shapes = st.sampled_from([(), (1,), (3,), (2, 3), (2, 1, 4)])


def _expected(value, low):
    """What the lower dtype holds for ``value``: its own rounding when that
    is finite, else (a finite value beyond its range) its largest finite
    value with the value's sign; an infinity stays infinite, as in plain torch."""
    t = torch.tensor(value, dtype=FP32).to(low)
    if torch.isinf(t) and abs(value) != float("inf"):
        top = torch.finfo(low).max
        return top if value > 0 else -top
    return t.item()


@hmp.bf16_function
def _seen(*args, **kwargs):
    """What a BF16-rule op is given, returned as it arrives."""
    return args, kwargs


@settings(deadline=None)
@given(
    values=st.lists(_values, min_size=1, max_size=6),
    shape=_shapes,
    low=st.sampled_from(LOWS),
    carrier=st.sampled_from(["tensor", "list", "keyword", "parameter"]),
)
def test_every_tensor_hmp_casts_to_the_lower_dtype_holds_finite_values(values, shape, low, carrier):
    n = max(1, int(torch.Size(shape).numel()))
    data = torch.tensor((values * n)[:n], dtype=FP32).reshape(shape)
    if carrier == "parameter":  # through the weight cache
        data = torch.nn.Parameter(data)
    with hmp.converted(low_precision_type=low):
        if carrier == "list":
            (got,), _ = _seen([data])
            got = got[0]
        elif carrier == "keyword":
            _, kw = _seen(x=data)
            got = kw["x"]
        else:
            (got,), _ = _seen(data)
    assert got.dtype == low and got.shape == data.shape
    flat = data.detach().reshape(-1).tolist()
    assert got.detach().float().reshape(-1).tolist() == [_expected(v, low) for v in flat]


_numbers = st.sampled_from([float, int, np.float32, np.float64, np.float16, np.int64])


@settings(deadline=None)
@given(value=_values.filter(lambda v: v == v and abs(v) != float("inf")), make=_numbers, low=st.sampled_from(LOWS))
def test_a_number_of_any_kind_the_lower_dtype_cannot_hold_runs_the_call_in_float32(value, make, low):
    if make in (int, np.int64) and abs(value) >= 2**63:  # torch takes integers as int64
        return
    number = make(value)
    if isinstance(number, np.floating) and not np.isfinite(number):
        return  # np.float16(1e5) is inf already: not a finite value to keep
    x = torch.tensor([1.0, -0.5, 0.0])
    plain = x * float(number)
    seed = {"fp16_file_path": hmp.list_path("bf16_strict")} if low == torch.float16 else {}  # mul in the lower list
    with hmp.converted(low_precision_type=low, strict=True, **seed):  # Habana's rule: mul casts
        out = torch.mul(x, number)
    fits = abs(float(number)) <= torch.finfo(low).max
    assert out.dtype == (low if fits else FP32)
    if not fits:
        assert torch.equal(out, plain)


def test_a_number_inside_a_list_argument_is_checked_too():
    calls = []

    @hmp.bf16_function
    def scale(x, factors):
        calls.append(x.dtype)
        return x * factors[0]

    x = torch.ones(2)
    with hmp.converted():
        assert scale(x, [2.0]).dtype == torch.bfloat16
        out = scale(x, [np.float32(torch.finfo(FP32).min)])
    assert calls == [torch.bfloat16, FP32] and torch.isfinite(out).all()


# -- whole programs: the masks and sentinels models use ------------------------------------------

MIN = torch.finfo(FP32).min


def _programs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g)
    w = torch.randn(6, 6, generator=g) * 0.1
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [0] * 6, [1] * 6, [1, 0, 1, 0, 1, 0]], dtype=torch.bool)
    return {
        # Categorical.entropy: clamp to finfo.min, times probabilities that are 0 where masked
        "clamped logits times probs": lambda: (
            x.masked_fill(~mask, float("-inf")).clamp(min=MIN) * x.masked_fill(~mask, float("-inf")).softmax(-1)
        ),
        # a mask tensor full of the sentinel, multiplied by a 0/1 tensor (transformers' unmasking)
        "sentinel mask times a bool": lambda: torch.full((4, 6), MIN).mul(mask),
        "sentinel mask times 0-dim": lambda: torch.full((4, 6), MIN) * torch.tensor(0.5),
        "0-dim sentinel times a tensor": lambda: torch.tensor(MIN) * (x.abs() < 5).float(),
        "additive sentinel mask through a GEMM": lambda: torch.baddbmm(
            torch.full((1, 4, 4), MIN).masked_fill(mask[None, :, :4], 0.0), x[None], x[None].transpose(1, 2)
        ),
        "linear of a sentinel row": lambda: F.linear(torch.cat([x[:3], torch.full((1, 6), MIN)]), w.abs() * 1e-3),
        "matmul of a masked score and zeros": lambda: (
            torch.full((4, 6), MIN).masked_fill(mask, 0.0) @ torch.zeros(6, 3)
        ),
        "numpy sentinel fill": lambda: (1.0 - mask.float()) * np.finfo(np.float32).min,
        "numpy float64 sentinel": lambda: (1.0 - mask.float()) * np.float64(MIN),
    }


@pytest.mark.parametrize("name", sorted(_programs()))
def test_models_sentinels_stay_finite_where_plain_torch_is_finite(name):
    plain = _programs()[name]().float()
    with hmp.converted():
        mixed = _programs()[name]().float()
    finite = torch.isfinite(plain)
    assert finite.any()
    assert torch.isfinite(mixed[finite]).all(), (name, plain, mixed)


def test_softmax_over_a_fully_masked_sentinel_row_is_finite_as_in_float32():
    scores = torch.randn(3, 5)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1] * 5, [0] * 5], dtype=torch.bool)

    def attend():
        bias = torch.zeros(3, 5).masked_fill(~mask, MIN)
        return torch.softmax((scores * 0.5 + bias).float(), -1)

    plain = attend()
    with hmp.converted():
        mixed = attend()
    assert torch.isfinite(plain).all() and torch.isfinite(mixed).all()
    torch.testing.assert_close(mixed, plain, atol=2e-2, rtol=0)


def test_nan_stays_nan_and_the_gradient_of_a_cast_is_the_cast_gradient():
    x = torch.tensor([float("nan"), 1.0, MIN], requires_grad=True)
    with hmp.converted(strict=True):  # Habana's rule: mul casts
        y = x * 0.5
    assert torch.isnan(y[0]) and y.dtype == torch.bfloat16 and torch.isfinite(y[1:]).all()
    y.float()[1:].sum().backward()
    assert x.grad.tolist()[1:] == [0.5, 0.5]  # the saturated value passes its gradient as a plain cast does
