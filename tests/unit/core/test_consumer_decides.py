"""The consumer decides (docs/never-changes.md): hmp casts the inputs of the
listed ops that gain from the lower dtype; every op's output is what torch's
op gives for the inputs it ran on, so a value no listed op consumes stays as
torch made it. Eager, compiled and exported programs compute in the same
dtypes: each model below returns the tensor at every module boundary, and
the dtypes (and, where nothing random runs, the values) are compared.

The oracle for the dtypes is the rule itself, applied by hand to each
boundary: a residual stream (an embedding plus position, a sum of float32
and bf16) is float32; a listed matrix product's output is bf16; a
normalisation's output has its input's dtype.
"""

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import needs

import hmp

BF16, FP32 = torch.bfloat16, torch.float32
V, D, T, H = 32, 16, 8, 2

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class PreLN(nn.Module):
    """GPT-2 / nanoGPT / ViT's block: x + attn(ln_1(x)), x + mlp(ln_2(x))."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.proj, self.drop = nn.Linear(D, 4 * D), nn.Linear(4 * D, D), nn.Dropout(0.1)

    def forward(self, x):
        b = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).view(b, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, T, D)
        x = x + self.drop(self.o(a))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """x = drop(tok + pos): the residual stream starts at a dropout."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.drop = nn.Embedding(V, D), nn.Embedding(T, D), nn.Dropout(0.1)
        self.blocks = nn.ModuleList([PreLN(), PreLN()])
        self.lnf, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, idx):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(T)))
        seen = {"stream 0": x}
        for i, block in enumerate(self.blocks):
            x = block(x)
            seen[f"stream {i + 1}"] = x
        seen["final norm"] = self.lnf(x)
        seen["logits"] = self.head(seen["final norm"])
        return seen


class PostLN(nn.Module):
    """BERT's layer: ln(h + attn(h)), ln(h + ffn(h)); an embedding norm first (CLIP's ln_pre, BLOOM's)."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln_emb = nn.Embedding(V, D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, idx):
        h = self.ln_emb(self.emb(idx))
        seen = {"embedding norm": h}
        a = torch.matmul(self.q(h), self.k(h).transpose(-1, -2)) / D**0.5
        h = self.ln1(h + self.o(torch.matmul(a.softmax(-1), self.v(h))))
        seen["attention norm"] = h
        seen["last hidden state"] = self.ln2(h + self.fc2(F.gelu(self.fc1(h))))
        return seen


class MHABlock(nn.Module):
    """x + attn(ln(x)) through nn.MultiheadAttention, whose eval fast path is one fused kernel."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln = nn.Embedding(V, D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)

    def forward(self, idx):
        x = self.emb(idx)
        y = self.ln(x)
        out = x + self.attn(y, y, y, need_weights=False)[0]
        return {"norm": y, "stream": out}


class Head(nn.Module):
    """A scoring head its author wants in float32, written with an operator (an FP32 module entry)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / 4)

    def forward(self, x):
        return x @ self.w


class WithHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.body, self.head = nn.Embedding(V, D), nn.Linear(D, D), Head()

    def forward(self, idx):
        h = torch.relu(self.body(self.emb(idx)))
        return {"body": h, "head": self.head(h)}


W = torch.randn(D, D) / 4


@hmp.fp32_function
def scores(x):
    return x @ W


class Switched(nn.Module):
    """Operators inside disable_casts() and an @hmp.fp32_function: float32 there."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)

    def forward(self, idx):
        x = self.emb(idx)
        with hmp.disable_casts():
            off = x @ W
        return {"listed": x @ W, "disable_casts": off, "fp32_function": scores(x)}


# every boundary's dtype, by the rule (not by running hmp)
MODELS = {
    "gpt": (GPT, {}, {"stream 0": FP32, "stream 1": FP32, "stream 2": FP32, "final norm": FP32, "logits": BF16}),
    "post-ln": (PostLN, {}, {"embedding norm": FP32, "attention norm": FP32, "last hidden state": FP32}),
    "mha": (MHABlock, {}, {"norm": FP32, "stream": FP32}),
    "fp32 entry": (WithHead, {"fp32_modules": [Head]}, {"body": BF16, "head": FP32}),
    "switches": (Switched, {}, {"listed": BF16, "disable_casts": FP32, "fp32_function": FP32}),
}


def _run(name, train, how):
    cls, options, _ = MODELS[name]
    torch.manual_seed(0)
    model = cls().train(train)
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    grad = contextlib.nullcontext() if train else torch.no_grad()
    with hmp.converted(**options), grad:
        if how == "eager":
            return model(idx)
        if how == "exported":
            # without dynamo, as export's default is from 2.8 on (docs/torch-releases.md)
            return torch.export.export(model, (idx,), strict=False).module()(idx)
        torch._dynamo.reset()
        try:
            return torch.compile(model, backend=how)(idx)
        finally:
            torch._dynamo.reset()


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_boundary_has_the_rules_dtype_eagerly(name, train):
    expected = MODELS[name][2]
    seen = _run(name, train, "eager")
    assert {k: v.dtype for k, v in seen.items()} == expected


def _same(name, train, how):
    eager, other = _run(name, train, "eager"), _run(name, train, how)
    assert {k: v.dtype for k, v in other.items()} == {k: v.dtype for k, v in eager.items()} == MODELS[name][2]
    if not train:  # nothing random: the values too (compiled code may fuse, within the dtype's rounding)
        # eager MultiheadAttention takes torch's fused fast path, traced code its unfused one: the same
        # products rounded to bf16 at other points
        tol = dict(rtol=2**-5, atol=2**-6) if name == "mha" else dict(rtol=2**-7, atol=1e-5)
        for k in eager:
            torch.testing.assert_close(other[k], eager[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


@needs("traced_state_writes")
@needs("dynamo_traces_wrappers_fully")
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_computes_in_the_eager_dtypes(name, train):
    _same(name, train, "aot_eager")


@pytest.mark.slow
@needs("traced_state_writes")
@needs("dynamo_traces_wrappers_fully")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_inductor_computes_in_the_eager_dtypes(name):
    _same(name, False, "inductor")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_exported_computes_in_the_eager_dtypes(name):
    _same(name, False, "exported")


def test_eval_dropout_and_a_float32_norm_return_what_torch_returns():
    """An identity (eval or p=0 dropout) and a norm fed float32 are torch's own
    calls: the object or the values torch gives, never a rounded copy."""
    x = torch.randn(4, D)
    ln = nn.LayerNorm(D)
    with hmp.converted():
        assert nn.Dropout(0.1).eval()(x) is x and F.dropout(x, 0.0, training=True).dtype == FP32
        assert torch.equal(ln(x), ln.__class__.forward(ln, x))
        ep = torch.export.export(nn.Dropout(0.1).eval(), (x,))
        assert ep.module()(x).dtype == FP32
