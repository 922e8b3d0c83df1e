"""References captured while converted, and TorchScript, while converted and
after revert()."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hmp

# torch.jit warns that it is deprecated; scripting still has to work under hmp
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


class Captures(nn.Module):
    """Stores op references in __init__, as many models do."""

    def __init__(self):
        super().__init__()
        self.act, self.lin, self.mm = F.relu, F.linear, torch.mm
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.act(self.lin(self.mm(x, self.w), self.w))


def test_references_captured_while_converted_behave_as_original_after_revert():
    hmp.convert()
    m = Captures()
    x = torch.randn(2, 4)
    assert m(x).dtype == torch.bfloat16  # converted: they are hmp's wrappers
    hmp.revert()
    y = m(x)
    assert y.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(y, F.relu(F.linear(torch.mm(x, m.w), m.w)))
    assert m.act(x, inplace=True) is x  # keyword arguments as the original takes them


def test_reconvert_does_not_revive_old_references():
    hmp.convert()
    act = torch.relu
    hmp.convert(opt_level="O2")  # re-configures: the first conversion's wrappers are retired
    assert act(torch.randn(3)).dtype == torch.float32


class CapturesPython(nn.Module):
    """Holds Python functions of torch.nn.functional (nn.TransformerEncoderLayer's
    ``self.activation = F.relu``); TorchScript compiles them from source."""

    def __init__(self):
        super().__init__()
        self.act, self.norm = F.relu, F.softmax

    def forward(self, x):
        return self.norm(self.act(torch.mm(x, x)), -1)


def uses_listed_ops(x, w):
    return F.relu(torch.mm(x, w)) + F.linear(x, w).softmax(-1)


def make_module_class():
    class Block(nn.Module):  # a fresh class per test: TorchScript caches per class
        def __init__(self):
            super().__init__()
            self.lin, self.ln = nn.Linear(4, 4), nn.LayerNorm(4)

        def forward(self, x):
            return F.gelu(self.ln(F.relu(self.lin(x)))) + torch.matmul(x, x.t()).sum(-1, keepdim=True)

    return Block


def test_script_while_converted_and_after_revert():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    Block = make_module_class()
    hmp.convert()
    fn = torch.jit.script(uses_listed_ops)
    block = torch.jit.script(Block())
    # scripted code runs from C++: uncast, like any call hmp cannot see
    assert fn(x, w).dtype == torch.float32
    assert block(x).dtype == torch.float32
    captured = CapturesPython()  # holds wrappers
    assert torch.jit.script(captured)(x).dtype == torch.float32
    hmp.revert()
    assert torch.jit.script(Block())(x).dtype == torch.float32  # same class again: no "Can't redefine"
    assert torch.jit.script(captured)(x).dtype == torch.float32  # retired wrappers still script
    with torch.no_grad():
        assert torch.allclose(fn(x, w), uses_listed_ops(x, w))


def test_scripted_transformer_layer_while_converted():
    hmp.convert()
    layer = torch.jit.script(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))
    out = layer(torch.randn(2, 3, 8))
    out.sum().backward()
    assert out.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.torch_internals
def test_deberta_v2_imported_while_converted():
    """transformers' DeBERTa-v2 scripts helpers at import time: import it for
    the first time in a process that is already converted."""
    pytest.importorskip("transformers")  # imported in the child process; a leg without it (CI's between-releases) skips
    code = textwrap.dedent("""
        import torch, hmp
        torch.set_num_threads(1)
        hmp.convert()
        from transformers import DebertaV2Config, DebertaV2Model
        cfg = DebertaV2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=64, max_position_embeddings=32, relative_attention=True,
                              pos_att_type=["p2c", "c2p"])
        m = DebertaV2Model(cfg)
        seen = []
        m.encoder.layer[0].attention.self.query_proj.register_forward_hook(lambda mod, i, o: seen.append(o.dtype))
        out = m(torch.randint(0, 64, (2, 8))).last_hidden_state
        out.sum().backward()
        # the projections ran in bf16; the output is a LayerNorm's, which hmp leaves to torch
        assert seen == [torch.bfloat16] and out.dtype == torch.float32, (seen, out.dtype)
        hmp.revert()
        assert m(torch.randint(0, 64, (2, 8))).last_hidden_state.dtype == torch.float32
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    env["HF_HUB_OFFLINE"] = "1"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
