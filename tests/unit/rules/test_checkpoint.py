"""torch.utils.checkpoint recomputes under the hmp state its forward ran
under: gradients equal those of the same model without checkpointing, bit
for bit, whichever of forward and backward ran inside disable_casts()."""

import contextlib
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from helpers import release_said
from helpers.models import CheckpointedBlocks

import hmp
from hmp.core import torch_private

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


SCENARIOS = {  # (forward with casts, backward with casts)
    "on-on": (True, True),
    "off-on": (False, True),  # forward inside disable_casts(), backward outside
    "on-off": (True, False),  # the reverse
}


def gradients(mode, scenario):
    forward_on, backward_on = SCENARIOS[scenario]
    torch.manual_seed(0)
    net = CheckpointedBlocks(mode)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with contextlib.nullcontext() if forward_on else hmp.disable_casts():
        loss = F.cross_entropy(net(x), y)
    with contextlib.nullcontext() if backward_on else hmp.disable_casts():
        loss.backward()
    return loss, {n: p.grad for n, p in net.named_parameters()}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_gradients_equal_plain_ones(use_reentrant, scenario):
    hmp.convert("O1")
    loss, plain = gradients(None, scenario)
    loss_ckpt, ckpt = gradients(use_reentrant, scenario)
    assert torch.equal(loss, loss_ckpt)
    for name, grad in plain.items():
        assert grad is not None and torch.equal(ckpt[name], grad), name


def test_the_scenarios_differ():
    """The forward's state matters: casts off gives other gradients than casts on
    (otherwise the tests above could pass with the state ignored)."""
    hmp.convert("O1")
    _, on = gradients(None, "on-on")
    _, off = gradients(None, "off-on")
    assert not torch.equal(on["blocks.0.fc1.weight"], off["blocks.0.fc1.weight"])


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_recompute_restores_the_callers_state(use_reentrant):
    hmp.convert("O1")
    seen = []

    def fn(x):
        seen.append(hmp.casts_enabled())
        return F.linear(x, torch.ones(3, 3))

    x = torch.randn(2, 3, requires_grad=True)
    with hmp.disable_casts():
        out = torch_checkpoint.checkpoint(fn, x, use_reentrant=use_reentrant)
    out.float().sum().backward()  # recompute runs with casts off, then casts are on again
    assert seen == [False, False] and hmp.casts_enabled()
    seen.clear()
    out = torch_checkpoint.checkpoint(fn, x, use_reentrant=use_reentrant)
    with hmp.disable_casts():
        out.float().sum().backward()
        assert not hmp.casts_enabled()  # the backward's own disabled state is back
    assert seen == [True, True]


def test_revert_restores_torch_checkpoint_exactly(pristine):
    name = torch_private.checkpoint_generator()  # the one checkpoint() calls on this torch (2.14: ..._impl)
    before = dict(vars(torch_checkpoint))
    generator = before[name]
    forward = torch_checkpoint.CheckpointFunction.__dict__["forward"]
    hmp.convert("O1")
    assert torch_checkpoint.__dict__[name] is not generator
    assert torch_checkpoint.CheckpointFunction.__dict__["forward"] is not forward
    hmp.convert("O2")  # re-configuring wraps the originals, never a wrapper
    hmp.revert()
    assert vars(torch_checkpoint) == before
    assert torch_checkpoint.CheckpointFunction.__dict__["forward"] is forward


def test_timm_grad_checkpointing_gives_the_same_gradients():
    # timm's set_grad_checkpointing runs its blocks through torch's checkpoint
    # (non-reentrant in the timm releases tested): the recompute is cast as the forward was
    timm = pytest.importorskip("timm", reason="timm is installed on CI's newest-torch leg (with torchvision)")
    hmp.convert("O1")
    grads, losses = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=4
        ).train()
        model.set_grad_checkpointing(checkpointing)
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        loss = F.cross_entropy(model(x), torch.tensor([0, 3]))
        loss.backward()
        losses.append(loss)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert losses[0].dtype == torch.float32 and torch.equal(losses[0], losses[1])
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert grads[1][n].dtype == torch.float32
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


def test_a_torch_without_the_generator_gets_one_warning_naming_it(monkeypatch):
    # as on a future torch that renames it again: convert() still works, and says what is not kept cast
    monkeypatch.setattr(torch_private, "_GENERATORS", ("_no_such_generator",))
    monkeypatch.setattr(hmp.core.state, "warned", release_said())
    with pytest.warns(RuntimeWarning, match=r"torch \S+ has no non-reentrant checkpoint generator.*please report"):
        hmp.convert()
    assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
    hmp.revert()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hmp.convert()  # once per process


def _grads_when(mode, backward_at):
    """Gradients of ``CheckpointedBlocks(mode)`` whose forward ran under hmp O1 and whose
    backward ran at ``backward_at``: after the converted block exited (as
    torch.autocast's docs do it), in another thread after that, after
    revert(), or after convert() reconfigured to O2."""
    torch.manual_seed(0)
    net = CheckpointedBlocks(mode)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    if backward_at in ("after the block", "in another thread"):
        with hmp.converted():
            loss = F.cross_entropy(net(x), y)
    else:
        hmp.convert()
        loss = F.cross_entropy(net(x), y)
        hmp.revert() if backward_at == "after revert" else hmp.convert(opt_level="O2")
    if backward_at == "in another thread":
        thread = threading.Thread(target=loss.backward)
        thread.start()
        thread.join()
    else:
        loss.backward()
    return loss, {n: p.grad for n, p in net.named_parameters()}


@pytest.mark.parametrize("backward_at", ["after the block", "in another thread", "after revert", "after reconfiguring"])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_recompute_after_the_conversion_changed_reruns_the_forwards_conversion(pristine, use_reentrant, backward_at):
    """Oracle: the same program without checkpointing (its backward casts
    nothing, whatever is in force by then). The recompute installs the
    forward's conversion for itself and puts back what was in force."""
    loss, plain = _grads_when(None, backward_at)
    after = hmp.effective_lists()
    loss_ckpt, ckpt = _grads_when(use_reentrant, backward_at)
    assert torch.equal(loss, loss_ckpt) and loss.dtype == torch.float32
    for name, grad in plain.items():
        assert grad is not None and torch.equal(ckpt[name], grad), name
    assert hmp.effective_lists() == after  # none, or O2's, as before the backward
    hmp.revert()
