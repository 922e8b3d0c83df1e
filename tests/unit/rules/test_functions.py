"""hmp/rules/functions.py: custom autograd Functions marked with
``torch.amp.custom_fwd`` / ``custom_bwd`` are honoured, whether defined
before or after convert(), by patching those classes alone: torch's
``Function.apply``, ``BackwardCFunction.apply`` and every Function without
the decorators stay the very objects they were, and revert() puts every
class's ``__dict__`` back exactly. (What the decorators do to a training
step: tests/unit/core/test_never_corrupt.py.)"""

import torch

import hmp
from hmp.binding.resolve import subclasses
from hmp.core import torch_private as tp

BF16, FP32 = torch.bfloat16, torch.float32
MISSING = object()
seen = []  # what each forward got (its inputs' dtypes) and each backward (whether hmp casts there)


def _mm(cast_inputs=None, decorated=True):
    """A matmul Function: custom_fwd(cast_inputs) and custom_bwd when
    ``decorated``; its forward records its inputs' dtypes, its backward
    whether hmp casts there."""
    fwd = torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs) if decorated else (lambda f: f)
    bwd = torch.amp.custom_bwd(device_type="cpu") if decorated else (lambda f: f)

    class MM(torch.autograd.Function):
        @staticmethod
        @fwd
        def forward(ctx, a, b):
            seen.append((a.dtype, b.dtype))
            ctx.save_for_backward(a, b)
            return a.mm(b)

        @staticmethod
        @bwd
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            seen.append(hmp.casts_enabled())
            return grad.mm(b.t()), a.t().mm(grad)

    return MM


def _inputs():
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    return a, b


def _bf16(a):
    """``a`` in bfloat16 through a listed op, as after a layer hmp cast."""
    return torch.mm(a, torch.eye(a.shape[1]))


def _state():
    """``cls.__dict__["apply"]`` (or MISSING) of every Function class and
    of its backward node class, and FunctionMeta's ``__init__``."""
    out = {(tp.FunctionMeta, "__init__"): tp.FunctionMeta.__dict__.get("__init__", MISSING)}
    for cls in subclasses(torch.autograd.Function):
        out[(cls, "apply")] = cls.__dict__.get("apply", MISSING)
        node = tp.backward_class(cls)
        if node is not None:
            out[(node, "apply")] = node.__dict__.get("apply", MISSING)
    out[(tp.BackwardCFunction, "apply")] = tp.BackwardCFunction.__dict__["apply"]
    return out


def _changed(before, after):
    return {key for key in before.keys() | after.keys() if before.get(key, MISSING) is not after.get(key, MISSING)}


Casting = _mm(torch.float32)
Following = _mm(None)
Plain = _mm(decorated=False)


class CastingChild(Casting):
    """Inherits the decorated forward and backward, and no apply of its own."""


class PlainChild(Casting):
    """Overrides the decorated forward without the decorators."""

    @staticmethod
    def forward(ctx, a, b):
        seen.append((a.dtype, b.dtype))
        return a.mm(b)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def _decorated(cls):
    return bool(tp.custom_fwd_cast(cls.forward)) or tp.custom_bwd_inner(cls.backward) is not None


def test_only_decorated_classes_and_their_backward_nodes_are_patched():
    function_apply = torch.autograd.Function.__dict__["apply"]
    node_apply = tp.BackwardCFunction.__dict__["apply"]
    before = _state()
    with hmp.converted():
        during = _state()
        assert torch.autograd.Function.__dict__["apply"] is function_apply
        assert tp.BackwardCFunction.__dict__["apply"] is node_apply
    changed = _changed(before, during)
    decorated = [c for c in subclasses(torch.autograd.Function) if _decorated(c)]
    allowed = {(tp.FunctionMeta, "__init__")}
    allowed |= {(c, "apply") for c in decorated} | {(tp.backward_class(c), "apply") for c in decorated}
    assert changed <= allowed  # nothing in torch or anywhere else without the decorators
    assert {(Casting, "apply"), (CastingChild, "apply"), (Following, "apply")} <= changed
    assert (tp.backward_class(Following), "apply") in changed  # custom_bwd: its backward runs as its forward did
    assert (tp.backward_class(Casting), "apply") not in changed  # cast_inputs: backward uncast like all backward
    assert not {c for c, _ in changed} & {Plain, PlainChild, tp.backward_class(Plain), tp.backward_class(PlainChild)}
    assert _changed(before, _state()) == set()


def test_a_class_defined_before_convert_follows_its_decorators():
    a, b = _inputs()
    seen.clear()
    with hmp.converted():
        out = Casting.apply(_bf16(a), b)  # a bf16 input goes to float32; the forward's mm runs uncast
        out.sum().backward()
        assert out.dtype == FP32 and seen == [(FP32, FP32), False]
        seen.clear()
        out = Following.apply(_bf16(a), b)  # the forward's mm is cast; its backward runs cast as well
        out.float().sum().backward()
        assert out.dtype == BF16 and seen == [(BF16, FP32), True]
    assert a.grad.dtype == b.grad.dtype == FP32


def test_a_class_defined_after_convert_follows_its_decorators():
    a, b = _inputs()
    seen.clear()
    with hmp.converted():
        Late, LateFollowing, LatePlain = _mm(torch.float32), _mm(None), _mm(decorated=False)
        assert "apply" in Late.__dict__ and "apply" in tp.backward_class(LateFollowing).__dict__
        assert "apply" not in LatePlain.__dict__ and "apply" not in tp.backward_class(LatePlain).__dict__
        out = Late.apply(_bf16(a), b)
        out.sum().backward()
        assert out.dtype == FP32 and seen == [(FP32, FP32), False]
        seen.clear()
        out = LateFollowing.apply(_bf16(a), b)
        out.float().sum().backward()  # uncast, grad (bf16) @ b (float32) would fail
        assert out.dtype == BF16 and seen == [(BF16, FP32), True]

        class LateChild(Casting):  # a decorated parent from before convert
            pass

        assert "apply" in LateChild.__dict__
        seen.clear()
        assert LateChild.apply(_bf16(a), b).dtype == FP32 and seen == [(FP32, FP32)]
    for cls in (Late, LateFollowing, LatePlain, LateChild):
        assert "apply" not in cls.__dict__ and "apply" not in tp.backward_class(cls).__dict__


def test_an_undecorated_function_runs_as_without_hmp():
    a, b = _inputs()
    seen.clear()
    with hmp.converted():
        assert PlainChild.apply(_bf16(a), b).dtype == BF16  # inherits hmp's apply from Casting: passes through
        assert Plain.apply(_bf16(a), b).dtype == BF16
        assert tp.backward_class(Plain).apply is tp.BackwardCFunction.apply
    assert seen == [(BF16, FP32), (BF16, FP32)]


def test_revert_restores_every_class_exactly_also_after_a_second_convert():
    before = _state()
    own = Casting.__dict__.get("apply", MISSING)
    hmp.convert()
    try:
        first = Casting.__dict__["apply"]
        hmp.convert()  # built while the first conversion is in place: wraps torch's apply, not hmp's
        second = Casting.__dict__["apply"]
        assert second is not first
        assert second.__func__.__hmp_original__ is torch.autograd.Function.__dict__["apply"]
        assert "apply" in CastingChild.__dict__ and "apply" not in PlainChild.__dict__
    finally:
        hmp.revert()
    assert Casting.__dict__.get("apply", MISSING) is own is MISSING
    assert "apply" not in CastingChild.__dict__ and "apply" not in PlainChild.__dict__
    assert _changed(before, _state()) == set()


def test_a_class_created_after_revert_is_left_alone():
    with hmp.converted():
        pass
    Late = _mm(torch.float32)
    assert "apply" not in Late.__dict__
    a, b = _inputs()
    with hmp.converted():
        seen.clear()
        # defined between conversions: the next convert() finds it among Function's subclasses
        assert Late.apply(_bf16(a), b).dtype == FP32 and seen == [(FP32, FP32)]
    assert "apply" not in Late.__dict__
