"""engine="autocast" keeps torch.autocast's weight copies through transformers' decode loop
(issue 78 item 3; docs/engines.md, "Weight copies"): per token of a tiny Llama, counted, never
timed. The copies' other cases, on models of their own: tests/unit/core/test_engine_copies.py."""

import inspect

import pytest
import torch
from helpers import casts

import hmp

BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def llama_decode(model, tokens=4):
    """transformers' decode loop under no_grad: a prompt of 8, then ``tokens`` tokens fed back with the KV
    cache; each token's casts and weight casts."""
    prompt, token = torch.arange(8).view(1, 8), torch.zeros(1, 1, dtype=torch.long)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    weights = list(model.parameters())
    found = []
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        for _ in range(tokens):
            past = out.cache if hasattr(out, "cache") else out.past_key_values
            n, w, out = casts(lambda past=past: model(input_ids=token, use_cache=True, **{kw: past}), weights)
            found.append((n, w))
    return found


@pytest.mark.parametrize("trainable", [True, False], ids=["requires_grad", "frozen"])
def test_a_llama_decode_token_casts_no_more_than_under_torch_autocast(trainable):
    """The issue's target, on a tiny transformers Llama: per token the engine casts no more than
    torch.autocast over the same loop (before this it cast every weight again: 2 layers' 7 linears
    and the head), and the same weights (none where they require grad; every one where they are
    frozen, which autocast never caches)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**LLAMA)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval().requires_grad_(trainable)
    n_weights = 2 * 7 + 1  # q k v o gate up down per layer, the head (no biases)
    with torch.autocast("cpu", dtype=BF16):
        stock = llama_decode(model)
    with hmp.converted(engine="autocast"):
        found = llama_decode(model)
    for (n, w), (n_stock, w_stock) in zip(found, stock):
        assert n <= n_stock and w == w_stock == (0 if trainable else n_weights)
