"""What a library's own machinery checks of a class keeps holding under hmp,
and an author's autocast region counts however the library spells it
(docs/integrations.md)."""

import functools

import pytest
import torch
import torch.nn as nn
from helpers import tiny_gpt2_config, tiny_llama_config

import hmp

FP32, BF16 = torch.float32, torch.bfloat16


class Layer(nn.Module):
    """transformers >= 5.23's GradientCheckpointingLayer, in miniature: each
    subclass's forward is wrapped when the class is made, and the wrapper
    does its work only while ``type(self).forward`` is that wrapper."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            original = cls.__dict__["forward"]

            @functools.wraps(original)
            def forward_with_machinery(self, *args, **kwargs):
                self.machinery_ran = type(self).forward is forward_with_machinery
                return original(self, *args, **kwargs)

            cls.forward = forward_with_machinery


class Block(Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 2


@pytest.mark.parametrize("kind", ["bf16", "fp32"])
def test_a_class_entry_keeps_what_the_class_checks_of_its_forward(kind):
    block = Block()
    x = torch.randn(2, 4)
    with hmp.converted(**{f"{kind}_modules": [Block]}):
        out = block(x.bfloat16() if kind == "fp32" else x)
        assert block.machinery_ran
        assert vars(Block)["forward"].__name__ == "forward"  # the class's own forward, as the class made it
    assert out.dtype == (FP32 if kind == "fp32" else BF16)
    assert block(x).dtype == FP32 and block.machinery_ran


def test_transformers_checkpoints_a_layer_with_a_class_entry():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = tiny_llama_config()
    ids = torch.randint(0, 64, (2, 32))

    def saved_bytes(**entries):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        with hmp.converted(**entries):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()  # the recompute runs under the conversion the forward ran under
        return saved[0]

    plain = saved_bytes()
    for entries in ({"bf16_modules": [LlamaDecoderLayer]}, {"fp32_modules": [LlamaDecoderLayer]}):
        assert saved_bytes(**entries) <= 1.2 * plain, entries  # the layer's activations are not kept


def test_maybe_autocast_disabled_is_an_fp32_region_under_hmp():
    pytest.importorskip("transformers")
    generic = pytest.importorskip("transformers.utils.generic")
    if not hasattr(generic, "maybe_autocast"):
        pytest.skip("this transformers has no maybe_autocast (4.x writes torch.autocast(enabled=False))")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with hmp.converted():
        assert torch.mm(a, b).dtype == BF16
        with generic.maybe_autocast("cpu", enabled=False):
            inside = torch.mm(a, b)
        assert not torch.is_autocast_enabled("cpu")  # every other caller gets torch's answer
    assert inside.dtype == FP32


def test_gpt2_upcast_attention_keeps_its_fp32_scores(monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = tiny_gpt2_config(
        layers=1, heads=2, n_positions=64, reorder_and_upcast_attn=True, attn_implementation="eager"
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (1, 16))
    seen, baddbmm = [], torch.baddbmm

    def spy(*args, **kwargs):  # GPT-2 computes its upcast scores with baddbmm; hmp wraps the spy
        out = baddbmm(*args, **kwargs)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(torch, "baddbmm", spy)
    with torch.no_grad(), hmp.converted():
        model(input_ids=ids)
    assert seen == [FP32]  # the authors' fp32 region (baddbmm is in hmp's BF16 list)
