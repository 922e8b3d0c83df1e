"""Real Hugging Face models (tiny, built from config, no downloads) and a
word_language_model-shaped LSTM LM train under hmp as they do in fp32."""

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import skip_without_bf16_lstm, tiny_bert_config, tiny_gpt2_config, tiny_llama_config

import hmp

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB, SEQ, BATCH, HIDDEN, STEPS = 128, 32, 4, 64, 20


def gpt2():
    cfg = tiny_gpt2_config(VOCAB, HIDDEN, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def bert():
    cfg = tiny_bert_config(
        VOCAB, HIDDEN, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    return transformers.BertForMaskedLM(cfg)


def llama():
    cfg = tiny_llama_config(VOCAB, HIDDEN, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


class LSTMLM(nn.Module):
    """The shape of pytorch/examples word_language_model: dropout before nn.LSTM."""

    def __init__(self):
        super().__init__()
        self.encoder, self.drop = nn.Embedding(VOCAB, HIDDEN), nn.Dropout(0.2)
        self.rnn, self.decoder = nn.LSTM(HIDDEN, HIDDEN, 2, dropout=0.2), nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        out, _ = self.rnn(self.drop(self.encoder(input_ids.t())))
        logits = self.decoder(self.drop(out)).transpose(0, 1)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1))


MODELS = {"gpt2": gpt2, "bert": bert, "llama": llama, "lstm": LSTMLM}
# a layer whose output hmp's BF16 lists make bf16 under O1 and O2
PROBE = {
    "gpt2": lambda m: m.transformer.h[0].mlp.c_fc,
    "bert": lambda m: m.bert.encoder.layer[0].intermediate.dense,
    "llama": lambda m: m.model.layers[0].mlp.gate_proj,
    "lstm": lambda m: m.rnn,
}


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_of(model, ids):
    if isinstance(model, LSTMLM):
        return model(ids, ids)
    return model(input_ids=ids, labels=ids).loss


def train(name, opt_level):
    """Loss after STEPS AdamW steps on one batch; the optimizer steps as
    written in a training script (no disable_casts)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = batch()
    seen = set()
    PROBE[name](model).register_forward_hook(lambda mod, args, out: seen.add(first_tensor(out).dtype))
    if opt_level:
        hmp.convert(opt_level)
    try:
        for _ in range(STEPS):
            opt.zero_grad()
            loss = loss_of(model, ids)
            loss.backward()
            opt.step()
        loss = loss_of(model, ids).item()
    finally:
        hmp.revert()
    assert seen == {torch.bfloat16 if opt_level else torch.float32}  # hmp did cast
    return loss


def first_tensor(out):
    return out if isinstance(out, torch.Tensor) else first_tensor(out[0])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trains_within_two_percent_of_fp32(name):
    if name == "lstm":
        skip_without_bf16_lstm()
    fp32 = train(name, None)
    for opt_level in ("O1", "O2"):
        loss = train(name, opt_level)
        assert abs(loss - fp32) <= 0.02 * fp32, (opt_level, loss, fp32)
    assert fp32 < 0.9 * torch.log(torch.tensor(float(VOCAB))).item()  # it learned: the bound means something


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate(name, opt_level):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    seen = set()
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
    prompt = batch()[:2, :8]
    hmp.convert(opt_level)
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0
    )
    assert out.shape == (2, 14) and torch.equal(out[:, :8], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < VOCAB
    assert seen == {torch.bfloat16}  # every decoding step ran through hmp's casts


def gpt2_gradients(checkpointing, backward_casts):
    """Gradients of one GPT-2 step (dropout on: checkpointing replays the rng),
    and how often its first block's attention ran (twice when the block is recomputed)."""
    torch.manual_seed(0)
    cfg = gpt2().config
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.1
    model = transformers.GPT2LMHeadModel(cfg).train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    calls = []
    # a module inside the first block: its hooks run in the recompute too (transformers >= 5.23 runs the
    # block's own hooks outside the checkpoint)
    model.transformer.h[0].attn.register_forward_pre_hook(lambda mod, args: calls.append(hmp.casts_enabled()))
    ids = batch()
    torch.manual_seed(1)
    loss = model(input_ids=ids, labels=ids).loss
    with contextlib.nullcontext() if backward_casts else hmp.disable_casts():
        loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("backward_casts", [True, False])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gpt2_gradient_checkpointing_gives_the_same_gradients(use_reentrant, backward_casts):
    hmp.convert("O1")
    plain, calls = gpt2_gradients(None, backward_casts)
    assert calls == [True]
    ckpt, calls = gpt2_gradients(use_reentrant, backward_casts)
    assert calls == [True, True]  # recomputed, with the forward's casts on
    for name, grad in plain.items():
        assert grad is not None and torch.equal(ckpt[name], grad), name


def _encoders():
    """BERT, CLIP's vision tower (an embedding norm, ln_pre) and ViT, built from tiny configs."""
    bert_cfg = tiny_bert_config(VOCAB, HIDDEN, max_position_embeddings=64)
    vision = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=2)
    clip_cfg = transformers.CLIPVisionConfig(image_size=32, patch_size=8, **vision)
    vit_cfg = transformers.ViTConfig(image_size=32, patch_size=8, **vision)
    g = torch.Generator().manual_seed(0)
    ids, pixels = torch.randint(0, VOCAB, (2, 16), generator=g), torch.randn(2, 3, 32, 32, generator=g)
    return {
        "bert": (transformers.BertModel(bert_cfg), {"input_ids": ids}),
        "clip": (transformers.CLIPVisionModel(clip_cfg), {"pixel_values": pixels}),
        "vit": (transformers.ViTModel(vit_cfg), {"pixel_values": pixels}),
    }


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", ["bert", "clip", "vit"])
def test_encoder_features_stay_float32_and_reach_numpy(name, train, compiled):
    """The consumer decides: every block boundary of the residual stream (its
    hidden states) is float32 under hmp, as under torch.autocast, train and
    eval, eager and compiled; features reach numpy (sklearn, faiss)."""
    if compiled and tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 5):
        pytest.skip("hmp's compiled rules need torch >= 2.5 (docs/integrations.md)")
    torch.manual_seed(0)
    model, inputs = _encoders()[name]
    model.train(train)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    torch._dynamo.reset()
    with hmp.converted(), torch.no_grad():
        out = run(**inputs, output_hidden_states=True)
    torch._dynamo.reset()
    assert [h.dtype for h in out.hidden_states] == [torch.float32] * len(out.hidden_states)
    assert out.last_hidden_state.dtype == torch.float32
    assert out.last_hidden_state[:, 0].numpy().shape == (2, HIDDEN)
