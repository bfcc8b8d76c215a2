"""A tiny minGPT-style language model and the digit-sorting task of Ravnest's sorter example.

The attention slices its causal-mask buffer by the input's length (``self.bias[:, :, :T, :T]``,
as minGPT does), which plain torch.fx cannot trace: the buffer is a real tensor and ``T`` a proxy
("slice indices must be integers"). With ``marked=True`` the attention module carries Ravnest's
leaf marker (``_is_leaf_module = True``), so a tracer that honours it keeps the module whole;
unmarked, the tracer has to find out by itself.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, marked: bool) -> None:
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))
        if marked:
            self._is_leaf_module = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, marked: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, marked)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, `n_layer` blocks, a final LayerNorm and the LM head;
    returns logits [B, T, vocab_size]."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 2, n_head: int = 2,
                 n_embd: int = 16, marked: bool = False) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, block_size, marked) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def sort_dataset(n: int, length: int = 6, num_digits: int = 3,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` digit-sorting examples as the sorter example makes them: the digits followed by
    their sorted order, shifted by one (X: inputs, Y: next tokens), with Y = -1 where the model
    is still reading the unsorted digits. Shapes [n, 2 * length - 1], dtype long."""
    g = torch.Generator().manual_seed(seed)
    inp = torch.randint(num_digits, (n, length), generator=g)
    cat = torch.cat([inp, inp.sort(dim=1).values], dim=1)
    x, y = cat[:, :-1].clone(), cat[:, 1:].clone()
    y[:, :length - 1] = -1
    return x, y


def sorter_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the scored positions (targets -1 are ignored)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=-1)
