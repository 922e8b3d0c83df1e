"""A tiny transformers Llama whose LlamaRMSNorm the module-entry tests list in FP32
(tests/unit/binding/test_modules.py; the training run, tests/integration/test_rmsnorm_entry_training.py):
the model, its input, the entry, and what each module of a kind computed."""

import pytest
import torch

from helpers import tiny_llama_config

RMSNORM = "transformers.models.llama.modeling_llama.LlamaRMSNorm"
VOCAB, SEQ, BATCH, HIDDEN = 128, 32, 4, 64


def llama():
    """A tiny Llama; the test skips where transformers is not installed (only the tests that use it)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tiny_llama_config(VOCAB, HIDDEN, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def llama_rmsnorm():
    """transformers' LlamaRMSNorm class; the test skips without transformers."""
    return pytest.importorskip("transformers.models.llama.modeling_llama").LlamaRMSNorm


IDS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def record(model, kind):
    """``(seen, hooks)``: each forward of a module of ``kind`` appends ``(module, input, output)`` to
    ``seen``; the caller removes the hooks."""
    seen = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0].detach(), out.detach())))
        for m in model.modules()
        if isinstance(m, kind)
    ]
    return seen, hooks
