"""An activation (a tensor with no graph that is not a parameter) is cast at every listed call that takes
it, as torch.autocast casts it: no copy of it outlives the call (hmp/core/cache.py, ``caster``). hmp cannot
see every write to an activation (a numpy or DLPack view, ``.data``, a storage alias move no version
counter), so a copy kept between two calls could be served after a write: an environment's observation
buffer refilled through numpy would give every step the first step's action."""

import gc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hmp


class Casts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # (an inference tensor's cast reaches the mode as aten.to, an other's as aten._to_copy)
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to, torch.ops.hmp.to_finite):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _frozen(*shape):
    return torch.nn.Parameter(torch.randn(*shape), requires_grad=False)


def _bf16_bytes_alive():
    gc.collect()
    return sum(o.nbytes for o in gc.get_objects() if type(o) is torch.Tensor and o.dtype == torch.bfloat16)


def test_each_projection_of_one_activation_casts_it_as_autocast_does():
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    ws = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(3)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with Casts() as autocast:
            expected = [F.linear(x, w) for w in ws]
    with hmp.converted(), torch.no_grad():
        with Casts() as counted:
            got = [F.linear(x, w) for w in ws]
    assert counted.n == autocast.n == 3 + 3  # x at each call, each weight once in the region
    for a, b in zip(got, expected):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


# every way to write an activation between two listed calls; only the first moves its version counter
_WRITES = {
    "in place": lambda x: x.mul_(2),
    "through .data": lambda x: x.data.mul_(2),
    "through numpy": lambda x: x.numpy().__imul__(2),
    "through a storage alias": lambda x: x.untyped_storage().copy_((x * 2).untyped_storage()),
    "a layout through .data": lambda x: setattr(x, "data", x.data.t()),
}


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("write", list(_WRITES), ids=list(_WRITES))
def test_a_write_no_counter_shows_is_seen_by_the_next_call(write, grad):
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 8)

    def second_call(**options):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
        with hmp.converted(**options), torch.set_grad_enabled(grad):
            lin(x)
            _WRITES[write](x)
            return lin(x).detach()

    assert torch.equal(second_call(), second_call(cache=False))


def test_an_observation_buffer_refilled_through_numpy_gives_each_step_its_own_action():
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    buffer = np.zeros((1, 8), dtype=np.float32)
    obs = torch.from_numpy(buffer)  # wrapped once, refilled in place: no version counter moves
    frames = np.random.default_rng(0).standard_normal((5, 1, 8)).astype(np.float32)

    def rollout(block, **options):
        actions = []
        with hmp.converted(**options):
            for frame in frames:
                buffer[:] = frame
                with block():
                    actions.append(policy(obs).float())
        return torch.cat(actions)

    for block in (torch.no_grad, torch.inference_mode):
        got = rollout(block)
        assert torch.equal(got, rollout(block, cache=False))
        assert len({tuple(row) for row in got.tolist()}) == len(frames)


def test_an_inference_tensor_is_cast_per_call():
    w = _frozen(16, 16)
    with torch.inference_mode():
        x = torch.randn(4, 16)
    with hmp.converted():
        with Casts() as counted:
            F.linear(x, w), F.linear(x, w)
    assert counted.n == 4


def test_no_copy_of_an_activation_outlives_the_call():
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    X = torch.randn(2048, 64)  # held by the program: its bfloat16 copy (256 KiB) must not be
    before = _bf16_bytes_alive()
    with hmp.converted():
        with torch.no_grad():
            y = model(X).float()
        del y
        assert _bf16_bytes_alive() - before <= hmp.cache_bytes() < X.nbytes // 2


def test_a_tensor_in_a_graph_is_cast_per_consumer_and_gradients_are_unchanged():
    torch.manual_seed(0)
    leaf = torch.randn(4, 16, requires_grad=True)
    ws = [_frozen(16, 16) for _ in range(3)]

    def grad(**options):
        leaf.grad = None
        with hmp.converted(**options):
            with Casts() as counted:
                out = [F.linear(leaf * 1.0, w) for w in ws]
            sum(o.float().sum() for o in out).backward()
        return counted.n, leaf.grad.clone()

    n, cached = grad()
    n_plain, plain = grad(cache=False)
    assert n == n_plain  # each consumer casts: the gradient sums in float32, as without the cache
    assert torch.equal(cached, plain)
