"""bf16 where it pays (docs/never-changes.md), one test per principle, the
cases read from torch (its op tags, torch.nn's classes), the oracles from
plain torch and the dtypes' definitions:

- a pointwise op in the BF16 list is torch's own object (it follows torch's
  type promotion and never pulls float32 data down); strict=True wraps it;
- a promote-list op is wrapped only where torch's promotion does not reach
  (ops that need one dtype);
- a normalisation never rounds its input: on data with a large common offset
  it gives plain torch's output, rounded;
- a cast to the lower dtype keeps a finite value finite, an infinity infinite
  and NaN NaN;
- a module of torch.nn pickles while converted wherever it pickles without hmp.
"""

import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hmp
from hmp.binding import lists
from hmp.binding.resolve import Resolver
from hmp.core.cast_copies import FINITE_CASTS
from hmp.core.identity import ORIGINAL

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _tagged(name):
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def _pointwise_names():
    """Every aten operator torch tags pointwise that a list line may name and
    that binds a Python entry point."""
    resolver = Resolver()
    names = []
    for name in dir(torch.ops.aten):
        if name.startswith("_") or not _tagged(name) or lists.refusal(name) is not None:
            continue
        if resolver.sites(name):
            names.append(name)
    return names


def _wrapped_sites(names):
    resolver = Resolver()
    return {s.label for n in names for s in resolver.sites(n) if hasattr(getattr(s.namespace, s.attr), ORIGINAL)}


def test_every_pointwise_op_in_the_bf16_list_is_torchs_own_object(tmp_path):
    """A pointwise entry of the BF16 list changes nothing: its sites are what
    they are with no list naming it (torch's own, or, for an op that needs one
    dtype, the wrapper that promotes a mix its kernel rejects), and a warning
    says so, naming the file and the reason."""
    names = _pointwise_names()
    assert len(names) > 100 and {"mul", "add", "relu", "gelu", "where", "lerp"} <= set(names)
    empty = tmp_path / "empty.txt"
    empty.write_text("")  # no FP32 or promote list: what an op in no list gets
    hmp.convert(fp32_file_path=empty, promote_file_path=empty)
    unlisted = _wrapped_sites(names)
    assert unlisted  # the fallbacks' (no bf16 kernel, one dtype needed)
    path = tmp_path / "bf16.txt"
    path.write_text("include default\n" + "\n".join(names) + "\n")
    with pytest.warns(UserWarning, match=r"not cast outside strict mode.*relu.*pointwise") as said:
        hmp.convert(bf16_file_path=path, fp32_file_path=empty, promote_file_path=empty)
    assert str(path) in str(said[-1].message)
    assert set(names) <= set(hmp.effective_lists()["bf16"])
    assert _wrapped_sites(names) == unlisted
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    assert (x * w).dtype == FP32 and (x.bfloat16() * x.bfloat16()).dtype == BF16 and (x @ w).dtype == BF16
    hmp.convert(bf16_file_path=path, strict=True)  # Habana's literal rule: every listed op casts
    assert {f"torch.{n}" for n in ("mul", "add", "relu")} <= _wrapped_sites(names)
    assert (x * w).dtype == BF16


def test_only_promote_ops_that_need_one_dtype_are_wrapped():
    hmp.convert()
    promote = set(hmp.effective_lists()["promote"])
    one_dtype = {n for n in promote if n in lists.one_dtype_names()}
    assert one_dtype and promote - one_dtype
    assert _wrapped_sites(promote - one_dtype) == set()
    resolver = Resolver()
    for name in one_dtype:
        assert all(hasattr(getattr(s.namespace, s.attr), ORIGINAL) for s in resolver.sites(name)), name
    a, b = torch.randn(3), torch.randn(3).bfloat16()
    assert torch.cat([a, b]).dtype == FP32 and (a + b).dtype == FP32  # torch's promotion
    assert torch.zeros(3).index_add(0, torch.arange(3), b).dtype == FP32  # hmp's promote rule


# -- normalisations ----------------------------------------------------------------------------

_SHAPES = ((16, 64), (4, 64, 8), (2, 64, 4, 4), (2, 64, 2, 2, 2))
_ARGS = ((64,), (4, 64), (2,), ())


def _norm_classes():
    return sorted(
        (getattr(nn, n) for n in dir(nn) if "Norm" in n and isinstance(getattr(nn, n), type)),
        key=lambda c: c.__name__,
    )


def _built(cls):
    """The module and an input it runs on in plain torch, or None."""
    for args in _ARGS:
        for shape in _SHAPES:
            torch.manual_seed(0)
            try:
                module = cls(*args)
                x = 1000 + torch.randn(shape)
                with torch.no_grad():
                    module(x.clone())
            except (TypeError, ValueError, RuntimeError, AttributeError):
                continue
            return module, shape
    return None


@pytest.mark.parametrize("cls", _norm_classes(), ids=lambda c: c.__name__)
def test_every_normalisation_gives_plain_torchs_output_on_offset_data(cls):
    """Raw features with a large common offset (bf16's step at 1000 is 8, more
    than their spread): rounding the input first would leave noise. A
    normalisation is left to torch: the output is plain torch's, bit for bit,
    in float32 (no output is rounded: the consumer decides)."""
    built = _built(cls)
    if built is None:
        pytest.skip(f"{cls.__name__} does not run on a plain float32 CPU input here")
    module, shape = built
    torch.manual_seed(1)
    x = 1000 + torch.randn(shape)
    plain = module(x.clone()).detach()  # training mode: batch statistics
    with hmp.converted():
        out = module(x.clone()).detach()
    assert out.dtype == FP32 and torch.equal(out, plain)


def test_layer_norm_of_a_float32_residual_stays_float32_and_of_a_bf16_input_runs_as_torch_runs_it():
    ln = nn.LayerNorm(64)
    x = 1000 + torch.randn(16, 64)
    plain, plain_low = F.layer_norm(x, (64,)), ln(x.bfloat16()).detach()  # CPU's kernel takes the mix
    with hmp.converted():
        out, low = F.layer_norm(x, (64,)), ln(x.bfloat16()).detach()
    assert out.dtype == FP32 and torch.equal(out, plain)
    assert low.dtype == plain_low.dtype == BF16 and torch.equal(low, plain_low)
    with hmp.converted(strict=True):  # Habana's literal rule rounds the input first
        rounded_first = F.layer_norm(x, (64,))
    assert (rounded_first.float() - plain).abs().max() > 0.1


# -- infinities stay infinite ------------------------------------------------------------------


def _oracle(t, low):
    """The cast by the dtype's definition: torch's rounding, a finite value
    beyond the range saturated to the largest finite value."""
    top = torch.finfo(low).max
    rounded = t.to(low)
    overflow = torch.isfinite(t) & torch.isinf(rounded)
    return torch.where(overflow, torch.full_like(rounded, top).copysign(t.to(low)), rounded)


@settings(deadline=None, max_examples=60)
@given(
    # no subnormals: the floor's build flushes them to zero (FTZ), which hypothesis refuses to run under
    values=st.lists(
        st.floats(width=32, allow_subnormal=False) | st.sampled_from([3.4e38, -3.4e38, 65504.0, 7e4, -1e5]), max_size=16
    ),
    low=st.sampled_from([BF16, FP16]),
)
def test_a_cast_keeps_finite_values_finite_and_infinities_infinite(values, low):
    t = torch.tensor(values, dtype=FP32)
    got, want = FINITE_CASTS[low].any(t), _oracle(t, low)
    assert got.dtype == low
    assert torch.equal(torch.isnan(got), torch.isnan(t))
    assert torch.equal(got[~torch.isnan(t)], want[~torch.isnan(t)])


@pytest.mark.parametrize("strict", [False, True])
def test_attention_over_a_fully_padded_sample_is_nan_as_in_plain_torch(strict):
    """Programs clean such rows up with nan_to_num: hmp must not turn -inf into a
    large finite number, which makes a uniform average over the padding."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0] = True  # every position of sample 0 is padding
    plain, _ = mha(x, x, x, key_padding_mask=pad)
    with hmp.converted(strict=strict):
        out, _ = mha(x, x, x, key_padding_mask=pad)
    assert torch.isnan(plain[0]).all() and torch.isfinite(plain[1]).all()
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()


# -- pickle --------------------------------------------------------------------------------------

_CONSTRUCTORS = ((), (8,), (8, 8), (8, 2), (8, 2, 16))


def _modules():
    found = []
    for name in sorted(dir(nn)):
        cls = getattr(nn, name)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            found.append(cls)
    return found


def _pickles_plain(cls):
    for args in _CONSTRUCTORS:
        try:
            module = cls(*args)
            pickle.dumps(module)
        except Exception:
            continue
        return args
    return None


@pytest.mark.parametrize("strict", [False, True])
def test_every_torch_nn_module_that_pickles_plain_pickles_while_converted(strict):
    """Oracle: plain torch. Under strict=True a module holding a function hmp
    replaced (nn.TransformerEncoderLayer's F.relu) cannot be found by name:
    pickle's own error, which docs/leaves-alone.md explains."""
    cases = [(cls, args) for cls in _modules() if (args := _pickles_plain(cls)) is not None]
    assert len(cases) > 100
    failed = []
    with hmp.converted(strict=strict):
        for cls, args in cases:
            try:
                pickle.loads(pickle.dumps(cls(*args)))
            except pickle.PicklingError:
                failed.append(cls.__name__)
    if strict:
        assert set(failed) <= {"Transformer", "TransformerDecoderLayer", "TransformerEncoderLayer"}, failed
    else:
        assert failed == []


# -- what a cast costs, counted -------------------------------------------------------------------


def test_ops_dispatched_per_cast_and_per_pointwise_call():
    """Aten ops dispatched (a TorchDispatchMode count, a CPU proxy for kernel
    launches): a cast up is torch's one copy, as autocast's; a cast down is
    the copy and, on the CPU, one reduction that shows nothing needs
    saturating; only where something does (or off the CPU) three more ops
    saturate finite overflow and leave infinities (isinf, clamp, where into
    the copy). A pointwise op in the BF16 list costs what it costs in plain
    torch, and a listed matrix product its casts."""
    from hmp.binding.aten import dispatched

    def reached_ops(fn, *args):
        ops = []
        dispatched(fn, lambda op, a, k: ops.append(op), *args)
        return ops

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    # reading the reduction's two numbers (_local_scalar_dense) is no pass over the data
    names = lambda ops: [str(op) for op in ops if "local_scalar_dense" not in str(op)]  # noqa: E731
    assert names(reached_ops(FINITE_CASTS[FP32].any, x.bfloat16())) == ["aten._to_copy.default"]
    down = reached_ops(FINITE_CASTS[BF16].any, x)
    assert names(down) == ["aten._to_copy.default", "aten.aminmax.default"]
    masked = torch.tensor([1.0, torch.finfo(FP32).min, float("-inf")])
    assert names(reached_ops(FINITE_CASTS[BF16].any, masked)) == [
        "aten._to_copy.default",
        "aten.aminmax.default",
        "aten.isinf.default",
        "aten.clamp.default",
        "aten.where.self_out",
    ]
    plain_mul = reached_ops(torch.mul, x, w)
    with hmp.converted(cache=False):
        assert reached_ops(torch.mul, x, w) == plain_mul
        assert len(reached_ops(torch.mm, x, w)) == 2 * len(down) + 1  # two casts and the product
        assert len(reached_ops(torch.mm, x.bfloat16(), w.bfloat16())) == 1
