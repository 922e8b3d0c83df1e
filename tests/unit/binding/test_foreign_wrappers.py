"""Another library's wrapper on top of hmp's survives convert() again and
revert(): the site stays theirs, and hmp's layer inside it follows the
conversion in force (casting while converted, passing through after revert)."""

import functools

import torch
import torch.nn.functional as F

import hmp

ORIGINAL_LINEAR = F.linear
X, W = torch.randn(2, 3), torch.randn(4, 3)


def layered(fn):
    """A tracing wrapper made the usual way: functools.wraps copies the
    wrapped function's attributes, hmp's marks included."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        traced.calls += 1
        return fn(*args, **kwargs)

    traced.calls = 0
    return traced


def test_functools_wraps_layer_stays_outermost_after_convert_again_and_revert(pristine, tmp_path):
    hmp.convert()
    theirs = F.linear = layered(F.linear)
    assert theirs(X, W).dtype == torch.bfloat16
    hmp.convert()  # again: the site is theirs, and hmp's layer inside casts under the new conversion
    assert F.linear is theirs
    assert theirs(X, W).dtype == torch.bfloat16
    (tmp_path / "bf16.txt").write_text("matmul\n")
    hmp.convert(bf16_file_path=str(tmp_path / "bf16.txt"))  # linear no longer listed: hmp's layer passes through
    assert F.linear is theirs and theirs(X, W).dtype == torch.float32
    hmp.convert()
    assert theirs(X, W).dtype == torch.bfloat16
    hmp.revert()
    assert F.linear is theirs  # their layer is kept; hmp's inside passes through
    assert theirs(X, W).dtype == torch.float32
    assert theirs.calls == 5
    F.linear = ORIGINAL_LINEAR


def test_a_layer_made_with_wraps_is_not_mistaken_for_hmps(pristine):
    hmp.convert()
    theirs = layered(F.linear)
    F.linear = theirs
    hmp.revert()
    hmp.convert()  # hmp's previous wrapper, displaced, is re-armed; theirs is never unwrapped to torch's
    assert F.linear is theirs and theirs.__wrapped__ is not ORIGINAL_LINEAR
    hmp.revert()
    F.linear = ORIGINAL_LINEAR


class Zero3Linear:
    """How DeepSpeed ZeRO-3's ``zero.Init`` treats ``F.linear``: it saves the
    function in place, installs its own (which does not call the saved one),
    and puts the saved one back on exit."""

    def __enter__(self):
        self.saved = F.linear
        F.linear = self.linear
        return self

    @staticmethod
    def linear(input, weight, bias=None):
        out = input.matmul(weight.t())
        return out if bias is None else out + bias

    def __exit__(self, *exc):
        F.linear = self.saved


def test_zero3_style_save_replace_restore_across_a_reconvert(pristine):
    hmp.convert()
    with Zero3Linear() as zero3:
        hmp.convert(opt_level="O1")  # re-configured inside: the site is DeepSpeed's
        assert F.linear is zero3.linear
    # the wrapper DeepSpeed put back casts under the conversion in force
    assert F.linear(X, W).dtype == torch.bfloat16
    hmp.revert()
    assert F.linear is ORIGINAL_LINEAR  # hmp's again once put back, so revert restores torch's own


def test_zero3_style_exit_after_revert_then_convert_again(pristine):
    hmp.convert()
    with Zero3Linear() as zero3:
        hmp.revert()
        assert F.linear is zero3.linear  # theirs stays while their context is open
    assert F.linear(X, W).dtype == torch.float32  # hmp's wrapper, put back, passes through
    hmp.convert()
    assert F.linear(X, W).dtype == torch.bfloat16
    hmp.revert()
    assert F.linear is ORIGINAL_LINEAR


def test_zero3_style_reconvert_while_open_then_revert_while_open(pristine):
    hmp.convert()
    with Zero3Linear() as zero3:
        hmp.convert()
        hmp.revert()
        assert F.linear is zero3.linear
    assert F.linear(X, W).dtype == torch.float32
    hmp.convert()
    hmp.revert()
    assert F.linear is ORIGINAL_LINEAR
