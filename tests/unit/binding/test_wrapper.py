"""An hmp wrapper of a C function (``torch.mm``, ``F.linear``, ``Tensor.mm``)
is a Python function that stands in for its original: it binds as a method,
reads and copies as the original does, and keeps no reference to what a
call was given."""

import copy
import gc
import inspect
import pickle
import tracemalloc
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import needs

import hmp
from hmp.binding import wrapper_life
from hmp.core.identity import unwrap


def test_a_wrapper_is_a_function_that_reads_as_its_original():
    hmp.convert()
    for site in (F.softmax, F.linear, torch.mm, torch.Tensor.mm, torch.softmax):  # Python and C originals
        assert inspect.isfunction(site) and wrapper_life.is_wrapper(site)
        assert site.__wrapped__ is not None and site.__name__ in ("softmax", "linear", "mm")
    assert inspect.unwrap(F.linear) is unwrap(F.linear)
    hmp.revert()
    assert type(F.linear) is type(torch.mm) and not wrapper_life.is_wrapper(F.linear)


def test_a_wrapper_of_a_tensor_method_binds_as_a_method():
    hmp.convert()
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    assert a.mm(b).dtype == torch.bfloat16 and torch.Tensor.mm(a, b).dtype == torch.bfloat16
    assert (a @ b).dtype == torch.bfloat16  # matmul is listed: __matmul__ calls it
    bound = a.mm
    assert bound.__self__ is a and bound(b).dtype == torch.bfloat16
    with hmp.disable_casts():
        assert a.mm(b).dtype == torch.float32


def test_a_wrapper_of_a_c_function_copies_as_a_function_does_and_says_why_it_cannot_pickle_once_retired():
    hmp.convert()
    assert copy.deepcopy(F.linear) is F.linear and copy.copy(F.linear) is F.linear
    kept = torch.mm
    hmp.revert()  # kept is retired: its name now finds torch's own mm
    with pytest.raises(pickle.PicklingError, match="retired by revert"):
        pickle.dumps(kept)
    assert kept(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32


def _repeat(path, n):
    for _ in range(n):
        try:
            path(torch.randn(4, 4))
        except RuntimeError:
            pass
    gc.collect()


def test_a_wrapper_keeps_no_reference_to_what_a_call_was_given():
    """Every path (cast, nothing to cast, keywords, a number that sends the
    call to the FP32 rule, the promote rule, an op that raises) drops its
    arguments and grows no memory over thousands of calls."""
    hmp.convert()
    w = torch.nn.Parameter(torch.randn(4, 4))
    paths = [
        lambda x: F.linear(x, w),
        lambda x: torch.softmax(x, -1),
        lambda x: torch.matmul(input=x, other=x),
        lambda x: torch.add(x, x, alpha=2),
        lambda x: torch.mul(x, 3.4e38),
        lambda x: torch.cat([x, x.double()]),
        lambda x: torch.mm(x, torch.randn(3, 3)),  # raises: shapes
    ]
    for path in paths:
        x = torch.randn(4, 4)
        ref = weakref.ref(x)
        try:
            path(x)
        except RuntimeError:
            pass
        del x
        gc.collect()
        assert ref() is None, "an argument outlived its call"
        tracemalloc.start()
        _repeat(path, 200)
        before = tracemalloc.get_traced_memory()[0]
        _repeat(path, 2000)
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert grown < 64 * 1024, f"{grown} bytes more after 2000 calls"


@needs("traced_state_writes")
@pytest.mark.usefixtures("fresh_dynamo")
def test_listed_calls_with_keywords_and_strided_inputs_compile_in_one_graph():
    """What decoding a transformers Llama calls (the decode benchmark broke its graph at every layer
    here): scaled_dot_product_attention with keyword arguments on transposed (non-contiguous) float32
    inputs, a linear with keywords, a list argument; fullgraph=True fails at any graph break."""
    hmp.convert()
    q, k, v = (torch.randn(1, 4, 2, 8).transpose(1, 2) for _ in range(3))  # (batch, heads, tokens, dim)
    w = torch.nn.Parameter(torch.randn(16, 8))

    def f(q, k, v):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        b = F.linear(input=a.transpose(1, 2).reshape(1, 4, 16), weight=w.t(), bias=None)
        return torch.cat([b.float().flatten(), F.linear(q.transpose(2, 3).reshape(4, 16), w.t()).float().flatten()])

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")  # every cast: the traced saturating form
    got, want = compiled(q, k, v), f(q, k, v)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
