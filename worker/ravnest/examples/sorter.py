"""A small causal transformer that learns to sort short sequences (the minGPT "sorter" task).

Inputs are token ids; the targets are the sorted sequence. Data is generated from a seed, so the
example needs no download.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class Sorter(nn.Module):
    """Reads ``length`` digits then emits them sorted; logits are shaped (batch, vocab, time)."""

    def __init__(self, vocab: int = 3, length: int = 6, dim: int = 48, layers: int = 2,
                 heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, 2 * length - 1, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos
        x = self.ln(self.blocks(x))
        return F.log_softmax(self.head(x), dim=-1).transpose(1, 2)


def build_model(vocab: int = 3, length: int = 6, dim: int = 48, layers: int = 2,
                heads: int = 4) -> nn.Module:
    return Sorter(vocab=vocab, length=length, dim=dim, layers=layers, heads=heads)


def datasets(n_train: int = 4000, n_val: int = 500, vocab: int = 3, length: int = 6,
             seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Input: the digits then the sorted prefix; target: -100 (ignored) on the prompt, then the
    sorted digits."""

    def make(n: int, gen: torch.Generator) -> TensorDataset:
        seq = torch.randint(vocab, (n, length), generator=gen)
        solved = seq.sort(dim=1).values
        cat = torch.cat([seq, solved], dim=1)
        x = cat[:, :-1].clone()
        y = cat[:, 1:].clone()
        y[:, : length - 1] = -100
        return TensorDataset(x, y)

    gen = torch.Generator().manual_seed(seed)
    return make(n_train, gen), make(n_val, gen)
