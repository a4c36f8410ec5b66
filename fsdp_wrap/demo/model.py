"""The demo's model and data: a small GPT with a tied head, and a synthetic task.

The task is arithmetic sequences (each counts from a random start with a random
stride, modulo the vocabulary), so the loss visibly falls within a few steps
and nothing is downloaded.  :func:`make_batch` is a pure function of the step
and rank, which is what lets a resumed run see the same data.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """One pre-LN transformer block: the unit the wrap policy makes."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, layers: int, width: int, heads: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: both live in the root unit
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# -------------------------------------------------------------------- data


def make_batch(
    step: int, rank: int, world_size: int, batch: int, seq_len: int, vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` at ``step``: a pure function, so a resumed run sees the same data.

    Each sequence is ``start, start + d, start + 2d, ... (mod vocab)`` with a
    random start and a stride ``d`` in 1..4: the first token is a guess, the
    second narrows ``d`` down, the rest are predictable, so the loss falls
    well below ``ln(vocab)`` as the model learns to read the stride.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * world_size + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 5, (batch, 1), generator=g)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    return seq[:, :-1], seq[:, 1:]
