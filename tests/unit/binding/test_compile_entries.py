"""A precision the user declared holds under torch.compile: module entries
(class and instance, FP32 and BF16, on torch.nn's own modules and the
user's), ``@hmp.fp32_function``, ``disable_casts()`` and a shipped module
pattern compute compiled (aot_eager and inductor) what they compute eagerly,
in one graph that a second call reuses.

Each case is built so that losing the declaration changes the result: its
eager output differs from what plain O1 gives without the declaration.
"""

import pytest
import torch
from helpers import COMPILE_BACKENDS as BACKENDS
from helpers import needs
from torch import nn

import hmp

pytestmark = [
    pytest.mark.usefixtures("fresh_dynamo", "each_engine"),
    pytest.mark.compiled,
    needs("traced_state_writes"),
    needs("dynamo_traces_wrappers_fully"),
]


class Embed(nn.Module):
    """Timesteps through a matrix product: 998 and 999 differ in float32, not in bfloat16."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(torch.eye(4) + 0.001)

    def forward(self, t):
        return torch.matmul(t[:, None].float() * torch.ones(4), self.proj)


class Scale(nn.Module):
    """Pointwise only: float32 under O1 (torch's promotion), bfloat16 under a BF16 entry."""

    def forward(self, x):
        return x * 1.001


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = Embed()
        self.body = nn.Linear(4, 64)
        self.head = nn.Linear(64, 50)

    def forward(self, t):
        return self.head(self.body(self.embed(t)))


@hmp.fp32_function
def embed_fn(t, proj):
    return torch.matmul(t[:, None].float() * torch.ones(4), proj)


def shielded(t, proj):
    with hmp.disable_casts():
        return torch.matmul(t[:, None].float() * torch.ones(4), proj)


T = torch.tensor([998.0, 999.0])


def cases():
    """name -> (convert() kwargs given the model, callable given the model, arguments)."""
    return {
        "fp32 class entry": (lambda m: dict(fp32_modules=[Embed]), lambda m: m.embed, (T,)),
        "fp32 instance entry": (lambda m: dict(fp32_modules=[m.embed]), lambda m: m.embed, (T,)),
        "fp32 instance entry on nn.Linear": (lambda m: dict(fp32_modules=[m.head]), lambda m: m, (T,)),
        "fp32 class entry on nn.Linear": (lambda m: dict(fp32_modules=[nn.Linear]), lambda m: m, (T,)),
        "bf16 class entry": (lambda m: dict(bf16_modules=[Scale]), lambda m: Scale(), (T,)),
        "@hmp.fp32_function": (lambda m: {}, lambda m: lambda t: embed_fn(t, m.embed.proj), (T,)),
        "disable_casts()": (lambda m: {}, lambda m: lambda t: shielded(t, m.embed.proj), (T,)),
    }


def _plain_o1(name):
    """What the case computes under O1 without its declaration."""
    model = Net()
    fn = cases()[name][1](model)
    with hmp.converted():
        if name in ("@hmp.fp32_function", "disable_casts()"):
            return torch.matmul(T[:, None] * torch.ones(4), model.embed.proj)
        return fn(T)


def _counts():
    """(graph breaks, graphs compiled) so far in this process."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(cases()))
def test_a_declared_precision_holds_compiled(name, backend):
    given, target, args = cases()[name]
    model = Net()
    with hmp.converted(**given(model)):
        fn = target(model)
        eager = fn(*args)
        compiled = torch.compile(fn, backend=backend)
        before = _counts()
        first = compiled(*args)
        after_first = _counts()
        again = compiled(*args)
        after_again = _counts()
    without = _plain_o1(name)
    # the declaration matters here: without it, O1 gives another dtype or other values
    assert without.dtype != eager.dtype or not torch.allclose(without.float(), eager.float(), rtol=1e-4)
    for out in (first, again):
        assert out.dtype == eager.dtype
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    assert after_first[0] == before[0]  # no graph break
    assert after_first[1] == before[1] + 1  # one graph ...
    assert after_again == after_first  # ... that the second call reuses


def test_a_shipped_module_pattern_holds_compiled():
    """The default FP32 list's rotary pattern: positions 4000 and 4001 keep
    their float32 angles compiled, as eagerly."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from helpers import tiny_llama_config

    rotary = llama.LlamaRotaryEmbedding(tiny_llama_config(hidden=64, heads=4, max_position_embeddings=8192))
    x = torch.randn(1, 2, 64)
    positions = torch.tensor([[4000, 4001]])
    with hmp.converted():
        eager = rotary(x, positions)
        compiled = torch.compile(rotary, backend="aot_eager")(x, positions)
    with torch.no_grad():
        ref = rotary(x, positions)
    for c, e, r in zip(compiled, eager, ref):
        assert c.dtype == e.dtype
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(e.float(), r.float(), rtol=1e-5, atol=1e-5)  # the entry kept float32 angles


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_operator_casts_compiled_as_eagerly(backend):
    """``a @ b``: dynamo records Python's operator, and the listed Tensor
    method it runs decides when the graph is lowered (the one place it can)."""
    torch.manual_seed(0)
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with hmp.converted():
        eager = a @ b
        compiled = torch.compile(lambda x, y: x @ y, backend=backend)(a, b)
    assert eager.dtype == compiled.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager)
