"""A small character-level transformer language model, written plainly with
torch.nn modules so hmp's lists see the ops a user's model would run."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    """Causal multi-head self-attention. No dropout on the attention
    weights (the block drops its output instead), which keeps
    scaled_dot_product_attention on its fused kernel."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not a multiple of n_heads {n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm: x + attn(ln(x)), then x + mlp(ln(x)), dropout on each branch."""

    def __init__(self, d_model, n_heads, dropout, activation="gelu"):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU() if activation == "gelu" else nn.ReLU(),
            nn.Linear(4 * d_model, d_model),
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharTransformer(nn.Module):
    def __init__(self, vocab, seq_len, d_model=256, n_layers=4, n_heads=4, dropout=0.1, activation="gelu"):
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(d_model, n_heads, dropout, activation) for _ in range(n_layers)))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tok(ids) + self.pos(positions))
        return self.head(self.ln(self.blocks(x)))

    def loss(self, ids, targets):
        logits = self(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def n_params(model):
    return sum(p.numel() for p in model.parameters())
