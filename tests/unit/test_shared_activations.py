"""An activation given to several listed ops (q, k and v projections; gate and up) is cast once while
it is the same unchanged tensor, and no copy outlives its source (hmp/core/cache.py, ``tls.shared``).
Only a tensor with no graph is shared: in grad mode each consumer casts its own copy, so gradients
are summed in float32 as without the cache."""

import gc
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hmp
from hmp.core.state import tls


class Casts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.hmp.to_finite):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _frozen(*shape):
    return torch.nn.Parameter(torch.randn(*shape), requires_grad=False)


def _projections(x, ws):
    return [F.linear(x, w) for w in ws]


def test_one_cast_serves_every_projection_of_an_unchanged_activation():
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    ws = [_frozen(16, 16) for _ in range(3)]  # frozen weights: cast per call
    with hmp.converted():
        with Casts() as counted:
            shared = _projections(x, ws)
        assert counted.n == 1 + 3  # x once, each weight
        with hmp.converted(cache=False):
            with Casts() as counted:
                each = _projections(x, ws)
            assert counted.n == 3 + 3
    for a, b in zip(shared, each):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)  # the same bits as a cast per call


def test_a_written_activation_is_cast_again():
    x = torch.randn(4, 16)
    w = _frozen(16, 16)
    with hmp.converted():
        first = F.linear(x, w)
        x.mul_(2)  # an in-place write moves the version counter
        second = F.linear(x, w)
        fresh = F.linear(x.clone(), w)  # a new tensor: a cast of its own
    assert not torch.equal(first, second)
    assert torch.equal(second, fresh)


def test_a_tensor_in_a_graph_is_not_shared_and_gradients_are_unchanged():
    torch.manual_seed(0)
    leaf = torch.randn(4, 16, requires_grad=True)
    ws = [_frozen(16, 16) for _ in range(3)]

    def grad(**options):
        leaf.grad = None
        with hmp.converted(**options):
            with Casts() as counted:
                out = _projections(leaf * 1.0, ws)
            sum(o.float().sum() for o in out).backward()
        return counted.n, leaf.grad.clone()

    n, cached = grad()
    n_plain, plain = grad(cache=False)
    assert n == n_plain  # each consumer casts: the gradient sums in float32, as without the cache
    assert torch.equal(cached, plain)


def test_no_copy_outlives_its_source():
    w = _frozen(16, 16)
    with hmp.converted():
        x = torch.randn(4, 16)
        F.linear(x, w)
        copy = weakref.ref(tls.shared[4])
        del x
        gc.collect()
        assert tls.shared is None and copy() is None
        y = torch.randn(4, 16)
        F.linear(y, w)
        hmp.clear_cache()
        assert tls.shared is None
