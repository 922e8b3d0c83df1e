"""Unusual tensors through representative wrappers (a BF16-list op, an
FP32-list op, a promote op, in-place ops): no lost type, no new errors.

The reference for every call is the same call with casting off
(``disable_casts``), that is plain torch: where plain torch succeeds hmp
must succeed with a result of the same Python type and layout (an in-place
call returns the very tensor it wrote, dtype unchanged); where plain torch
raises, hmp raises the same exception type.
"""

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import release_said

import hmp

BF16, FP32 = torch.bfloat16, torch.float32


class Sub(torch.Tensor):
    pass


class Traced(torch.Tensor):
    """A subclass with its own __torch_function__ (it sees hmp's casts)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class ParamSub(torch.nn.Parameter):
    pass


def _base(shape=(4, 4)):
    g = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=g)


def _nested():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "prototype stage"
        return torch.nested.nested_tensor([_base((2, 4)), _base((3, 4))])


KINDS = {
    "fp32": lambda: _base(),
    "bf16": lambda: _base().bfloat16(),
    "fp64": lambda: _base().double(),
    "parameter": lambda: torch.nn.Parameter(_base()),
    "parameter subclass": lambda: ParamSub(_base()),
    "subclass": lambda: _base().as_subclass(Sub),
    "subclass with __torch_function__": lambda: _base().as_subclass(Traced),
    "sparse coo": lambda: (_base() * (_base() > 0)).to_sparse(),
    "sparse coo bf16": lambda: (_base() * (_base() > 0)).to_sparse().bfloat16(),
    "sparse csr": lambda: (_base() * (_base() > 0)).to_sparse_csr(),
    "complex": lambda: torch.complex(_base(), _base()),
    "bool": lambda: _base() > 0,
    "int64": lambda: (_base() * 10).long(),
    "meta": lambda: torch.empty(4, 4, device="meta"),
    "zero rows": lambda: torch.randn(0, 4),
    "zero columns": lambda: torch.randn(4, 0),
    "transposed view": lambda: _base().t(),
    "strided view": lambda: _base((4, 8))[:, ::2],
    "expanded (overlapping) view": lambda: _base((4, 1)).expand(4, 4),
    "as_strided (overlapping) view": lambda: _base((8,)).as_strided((4, 4), (1, 1)),
    "channels_last": lambda: _base((2, 3, 4, 4)).to(memory_format=torch.channels_last)[0, 0],
    "nested": lambda: _nested(),
}


def partner(x):
    """A second operand of another floating dtype, same kind (casting off)."""
    with hmp.disable_casts():
        if x.dtype == FP32:
            return x.bfloat16()
        if x.dtype == BF16:
            return x.float()
        return x


OPS = {  # BF16 list, FP32 list, promote list, in-place forms
    "mm (BF16)": lambda x: torch.mm(x, x.t()),
    "linear (BF16)": lambda x: F.linear(x, x),
    "@ (BF16)": lambda x: x @ x.t(),
    "softmax (FP32)": lambda x: torch.softmax(x, -1),
    "log (FP32)": lambda x: torch.log(x),
    "add (promote)": lambda x: torch.add(x, partner(x)),
    "* (BF16)": lambda x: x * partner(x),
    "mul_ (in-place)": lambda x: x.mul_(partner(x)),
    "+= (in-place)": lambda x: x.__iadd__(partner(x)),
    "relu inplace=True": lambda x: F.relu(x, inplace=True),
}
INPLACE = {"mul_ (in-place)", "+= (in-place)", "relu inplace=True"}


def run(op, x):
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sparse CSR is beta; the no-kernel warning is tested below
            return op(x), None
    except Exception as e:
        return None, e


def same_values(a, b):
    if a.is_meta or b.is_meta:
        return True
    if a.is_nested:
        return all(same_values(x, y) for x, y in zip(a.unbind(), b.unbind()))
    with hmp.disable_casts():
        a = a.to_dense() if a.layout != torch.strided else a
        b = b.to_dense() if b.layout != torch.strided else b
        return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a.double(), b.double(), equal_nan=True))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_no_lost_type_and_no_new_errors(kind):
    hmp.convert()
    problems = []
    for name, op in OPS.items():
        with hmp.disable_casts():  # inputs are made with casting off: `*` and `t` are listed
            plain, plain_err = run(op, KINDS[kind]())
            x = KINDS[kind]()
            dtype = x.dtype
            x_before = x.clone() if name not in INPLACE and not x.is_meta else None
        got, err = run(op, x)
        if plain_err is not None:
            if err is not None and type(err) is not type(plain_err):
                problems.append(f"{name}: {type(err).__name__} where torch raises {type(plain_err).__name__}")
            continue
        if err is not None:
            problems.append(f"{name}: new error {type(err).__name__}: {str(err).splitlines()[0]}")
            continue
        if type(got) is not type(plain):
            problems.append(f"{name}: {type(got).__name__}, torch gives {type(plain).__name__}")
        shapes = (None, None) if got.is_nested else (tuple(got.shape), tuple(plain.shape))
        if got.layout != plain.layout or got.device != plain.device or shapes[0] != shapes[1]:
            problems.append(
                f"{name}: {got.layout}/{got.device}/{shapes[0]} vs {plain.layout}/{plain.device}/{shapes[1]}"
            )
        if name in INPLACE:
            if got is not x or got.dtype != dtype:
                problems.append(f"{name}: in-place result is not the written tensor with its dtype")
        elif x_before is not None and not same_values(x, x_before):
            problems.append(f"{name}: the input was changed")
    assert not problems, "\n".join(problems)


# -- what the wrappers do with them, exactly ---------------------------------------------------


def test_parameter_and_subclasses_keep_their_type():
    hmp.convert()
    p = torch.nn.Parameter(torch.randn(4, 4))
    assert type(torch.mm(p, p)) is torch.Tensor and torch.mm(p, p).dtype == BF16  # as torch: ops return Tensor
    with torch.no_grad():
        assert p.mul_(torch.ones(4, 4).bfloat16()) is p and type(p) is torch.nn.Parameter and p.dtype == FP32
        assert F.relu(p, inplace=True) is p and type(p) is torch.nn.Parameter
    for cls in (Sub, Traced):
        x = torch.randn(4, 4).as_subclass(cls)
        for out, dtype in (
            (torch.mm(x, x), BF16),
            (torch.softmax(x.bfloat16(), -1), FP32),
            (torch.add(x, x.bfloat16()), FP32),
            (x @ x, BF16),
        ):
            assert type(out) is cls and out.dtype == dtype
        y = x.clone()
        assert y.mul_(x.bfloat16()) is y and type(y) is cls and y.dtype == FP32


def test_meta_and_zero_size_follow_the_rules():
    hmp.convert()
    m = torch.empty(4, 4, device="meta")
    assert torch.mm(m, m).dtype == BF16 and torch.mm(m, m).is_meta
    assert torch.softmax(m.bfloat16(), -1).dtype == FP32
    assert torch.add(m, m.bfloat16()).dtype == FP32
    z = torch.randn(0, 4)
    assert torch.mm(z, z.t()).shape == (0, 0) and torch.mm(z, z.t()).dtype == BF16
    assert F.linear(torch.randn(3, 0), torch.randn(2, 0)).dtype == BF16  # sums over nothing: zeros
    assert torch.equal(F.linear(torch.randn(3, 0), torch.randn(2, 0)).float(), torch.zeros(3, 2))


def test_views_compute_what_explicit_casts_compute():
    hmp.convert()
    base = torch.randn(6, 8)
    views = {
        "t": base.t(),
        "strided": base[:, ::2],
        "expand": base[:, :1].expand(6, 6),
        "as_strided": base.view(-1).as_strided((6, 6), (1, 1)),
    }
    for name, v in views.items():
        with hmp.disable_casts():
            expect_mm = torch.mm(v.bfloat16(), v.t().bfloat16())
            expect_soft = torch.softmax(v.bfloat16().float(), -1)
        assert torch.equal(torch.mm(v, v.t()), expect_mm), name
        assert torch.equal(torch.softmax(v.bfloat16(), -1), expect_soft), name


def test_inplace_on_a_view_writes_through_to_its_base():
    hmp.convert()
    base = torch.ones(4, 8)
    view = base[:, ::2]
    assert view.mul_(torch.full((4, 4), 3.0).bfloat16()) is view
    assert base.dtype == FP32 and torch.equal(base[:, ::2], torch.full((4, 4), 3.0))
    assert torch.equal(base[:, 1::2], torch.ones(4, 4))


def test_inplace_on_an_expanded_view_raises_like_torch():
    other = torch.randn(4, 4).bfloat16()
    with pytest.raises(RuntimeError) as plain:
        torch.randn(4, 1).expand(4, 4).mul_(other.float())  # not converted: torch itself
    hmp.convert()
    with pytest.raises(RuntimeError) as ours:
        torch.randn(4, 1).expand(4, 4).mul_(other)
    assert "more than one element" in str(plain.value)
    assert str(ours.value) == str(plain.value)


def test_inplace_on_an_as_strided_overlap_does_what_torch_does():
    """torch does not detect this overlap; hmp must not either, and must
    write the same values (the bf16 argument is cast to the target's fp32)."""
    base, other = torch.arange(8.0), torch.full((4, 4), 2.0).bfloat16()
    plain = base.clone()
    plain.as_strided((4, 4), (1, 1)).add_(other.float())
    hmp.convert()
    ours = base.clone()
    view = ours.as_strided((4, 4), (1, 1))
    assert view.add_(other) is view
    assert ours.dtype == FP32 and torch.equal(ours, plain)


def test_sparse_coo_runs_in_the_lower_dtype_like_dense():
    dense = torch.randn(4, 4)
    sp = (dense * (dense > 0)).to_sparse()
    hmp.convert(strict=True)  # mul casts under Habana's literal rule
    out = torch.mul(sp, sp)
    assert out.layout == torch.sparse_coo and out.dtype == BF16
    assert torch.add(sp, sp.bfloat16()).dtype == FP32  # promote
    assert torch.mm(sp, dense).dtype == BF16


@pytest.fixture
def fresh_no_kernel_warnings(monkeypatch):
    from hmp.core import state

    monkeypatch.setattr(state, "warned", release_said())


def test_op_without_a_kernel_for_the_cast_dtype_runs_uncast_and_warns_once(fresh_no_kernel_warnings):
    """Sparse CSR matmul has no bfloat16 kernel on CPU: plain torch runs it in
    fp32; hmp must not turn it into an error."""
    csr = (torch.eye(4) * 2).to_sparse_csr()
    dense = torch.randn(4, 4)
    expected = torch.mm(csr, dense)
    hmp.convert()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = torch.mm(csr, dense)
        again = torch.mm(csr, dense)
    ours = [w for w in record if "hmp:" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    message = str(ours[0].message)
    assert "torch.mm fails on the dtype hmp cast" in message and "BFloat16" in message and "as given" in message
    assert ours[0].filename == __file__  # points at the user's call
    assert out.dtype == FP32 and torch.equal(out, expected) and torch.equal(again, out)
    assert hmp.casts_enabled()


LISTED_WITHOUT_BF16 = {  # ops a user may list in BF16 that fail in bf16 on the CPU, each torch's way of saying so
    "cdist": lambda a, m: torch.cdist(a, a),  # a Python function: "cdist" not implemented for 'BFloat16'
    "linalg_inv": lambda a, m: torch.linalg.inv(m),  # Low precision dtypes not supported
    "logdet": lambda a, m: torch.logdet(m),
    "fft_rfft": lambda a, m: torch.fft.rfft(a),  # Unsupported dtype BFloat16
    "pdist": lambda a, m: torch.pdist(a),
}


@pytest.mark.parametrize("mode", [False, True], ids=["plain", "inside a TorchFunctionMode"])
@pytest.mark.parametrize("name", sorted(LISTED_WITHOUT_BF16))
def test_a_listed_op_that_fails_on_its_cast_runs_as_given(fresh_no_kernel_warnings, tmp_path, name, mode):
    """No op fails because of a cast hmp made (docs/never-changes.md), however torch words the failure:
    oracle, plain torch's result; also with a TorchFunctionMode active (torch.device's), whose frame is
    then the innermost of the traceback."""
    call = LISTED_WITHOUT_BF16[name]
    torch.manual_seed(0)
    a, m = torch.randn(4, 3), torch.randn(3, 3)
    m = m @ m.t() + torch.eye(3)
    expected = call(a, m)
    path = tmp_path / "bf16.txt"
    path.write_text(f"include default\n{name}\n")
    hmp.convert(bf16_file_path=path)
    with warnings.catch_warnings(record=True) as record, torch.device("cpu") if mode else contextlib.nullcontext():
        warnings.simplefilter("always")
        out = call(a, m)
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    assert [w for w in record if "fails on the dtype hmp cast" in str(w.message)]
    assert hmp.casts_enabled()


def test_a_users_function_is_run_again_only_where_a_kernel_is_missing(fresh_no_kernel_warnings):
    """A function of the user's may have done something before it raised: it runs again only when
    its error came straight out of a C op and names a missing kernel, never for any other error."""
    calls = []

    @hmp.bf16_function
    def scaled(x):
        calls.append(1)
        raise RuntimeError("some other failure")

    hmp.convert()
    with pytest.raises(RuntimeError, match="some other failure"):
        scaled(torch.randn(2))
    assert calls == [1]


def test_no_kernel_falls_back_to_fp32_when_an_input_was_already_lowered(fresh_no_kernel_warnings):
    """A bf16 sparse tensor (what an earlier listed op hands on): as given,
    mm(fp32, bf16) fails too; the call then runs in fp32."""
    dense = torch.randn(4, 4)
    sp = (dense * (dense > 0)).to_sparse()
    expected = torch.mm(sp, sp.t())
    hmp.convert()
    spt = sp.t().bfloat16()
    with pytest.warns(RuntimeWarning, match="ran in float32"):
        out = torch.mm(sp, spt)
    assert out.dtype == FP32 and torch.allclose(out.to_dense(), expected.to_dense(), atol=0.05, rtol=0.02)


def test_the_fp32_fallback_never_replaces_a_written_tensor():
    from hmp.core.rescue import About

    assert About("torch.Tensor.mul_", "mul", "bf16", inplace=True).writes((1, 2), {})
    assert About("torch.mm", "mm", "bf16").writes((1, 2), {"out": 3})
    relu = About("torch.nn.functional.relu", "relu", "bf16", inplace_param=1)
    assert relu.writes((1, True), {}) and relu.writes((1,), {"inplace": True}) and not relu.writes((1,), {})
    assert not About("torch.mm", "mm", "bf16").writes((1, 2), {})
    bn = About("torch.nn.functional.batch_norm", "batch_norm", "bf16", written=((1, "running_mean"),))
    assert bn.writes((1, 2), {}) and bn.writes((1,), {"running_mean": 2})  # as resolve.writes gives them
    assert not bn.writes((1, None), {}) and not bn.writes((1,), {"weight": 3})


def test_no_kernel_fallback_does_not_hide_errors_torch_also_raises():
    hmp.convert()
    csr = torch.eye(4).to_sparse_csr()
    with pytest.raises(RuntimeError):
        torch.mm(csr, torch.randn(3, 4))  # wrong shape: fails uncast too; hmp raises, no retry result


def test_complex_bool_and_integer_tensors_are_never_cast():
    hmp.convert(strict=True)  # mul casts under Habana's literal rule
    c = torch.complex(torch.randn(3, 3), torch.randn(3, 3))
    assert torch.mm(c, c).dtype == torch.complex64
    assert torch.mul(c, torch.randn(3, 3)).dtype == torch.complex64
    b, i = torch.rand(3, 3) > 0.5, torch.randint(0, 5, (3, 3))
    assert torch.mul(b, b).dtype == torch.bool and torch.mm(i, i).dtype == torch.int64
    assert torch.mul(i, torch.randn(3, 3)).dtype == BF16  # the float argument is cast, the integer one is not


def test_fake_tensors_stay_fake():
    fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
    hmp.convert()
    with fake_tensor.FakeTensorMode():
        x = torch.randn(4, 4)
        for out, dtype in (
            (torch.mm(x, x), BF16),
            (F.linear(x, x), BF16),
            (torch.softmax(x.bfloat16(), -1), FP32),
            (torch.add(x, x.bfloat16()), FP32),
            (x.mul_(x.bfloat16()), FP32),
        ):
            assert isinstance(out, fake_tensor.FakeTensor) and out.dtype == dtype


class RefusesLowerDtypes(torch.Tensor):
    """A subclass whose casts to a lower dtype raise (as MaskedTensor's can)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("bfloat16", "half", "to", "_to_copy"):
            raise TypeError("this subclass refuses lower dtypes")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_cast_that_raises_leaves_casting_on_in_the_thread():
    """A BF16 module entry casts its inputs before its forward, outside any
    op's wrapper: a refused cast there must not leave casts off afterwards."""
    from hmp.core.state import tls

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2

    hmp.convert(bf16_modules=[Scale])
    try:
        t = torch.randn(4).as_subclass(RefusesLowerDtypes)
        out = Scale()(t)  # the refused cast leaves the input as it is
        assert out.dtype == torch.float32 and tls.off == 0
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16  # still casting
    finally:
        hmp.revert()
