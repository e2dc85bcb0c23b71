"""A small pre-LayerNorm transformer: MNIST-1D's signal as patch tokens, or characters for language modelling.

No BatchNorm: each sample's gradient is independent of the rest of its batch, so W simulated
workers equal one worker of the global batch (the AdamW world's models are LayerNorm models).

The attention is written out (not torch's nn.MultiheadAttention, whose packed q/k/v projection
puts all queries before all keys) so that tensor parallelism can split it by heads, Megatron-style:
`qkv` lays out its outputs head by head, so 1/T of its rows is whole heads with their queries, keys
and values, and `out` takes them back (lbt/parallel/tensor_parallel.py splits the pair colwise, rowwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    """Multi-head self-attention whose heads can be split across tensor-parallel ranks.

    `qkv` maps dim -> heads x (query, key, value) x head_dim, in that order; `forward` reads the
    number of heads from its input, so a rank holding H/T heads' rows computes those heads only.
    """

    # Tensor parallelism splits (qkv, out) as a colwise/rowwise pair of whole heads (lbt/parallel/tensor_parallel.py).
    split_by_heads = ("qkv", "out")

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads, self.head_dim, self.dropout = heads, dim // heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        nn.init.xavier_uniform_(self.qkv.weight)  # nn.MultiheadAttention's initialisation
        nn.init.zeros_(self.qkv.bias)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        # (N, L, heads here x 3 x head_dim) -> three (N, heads here, L, head_dim)
        q, k, v = self.qkv(x).unflatten(-1, (-1, 3, self.head_dim)).permute(3, 0, 2, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=causal)
        return self.out(h.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """Pre-LN encoder block: x + attention(norm(x)), then x + mlp(norm(x)); the MLP an nn.Sequential
    of Linear, GELU, Linear (the pair tensor parallelism splits)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(dim * mlp_ratio, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), causal))
        return x + self.drop(self.mlp(self.norm2(x)))


class Transformer1d(nn.Module):
    """`depth` pre-LN blocks of width `dim` with `heads` attention heads.

    Classification (causal=false): a (N, L) signal is cut into L/patch tokens of `patch` samples,
    embedded linearly with a learned position embedding; the blocks' mean token feeds the head:
    logits (N, num_classes).
    Language modelling (causal=true): (N, T) integer token ids (num_classes = the vocabulary),
    embedded, causal attention; logits (N, num_classes, T), the layout CrossEntropyLoss takes
    with (N, T) next-token labels.
    """

    shard_blocks = "blocks"  # dist.shard=fsdp gathers one block at a time (lbt/parallel/fsdp.py)

    def __init__(self, input_shape=(40,), num_classes: int = 10, patch: int = 4, dim: int = 64, depth: int = 2,
                 heads: int = 4, mlp_ratio: int = 2, dropout: float = 0.0, causal: bool = False):
        super().__init__()
        length = int(input_shape[-1])
        if causal:
            tokens = length
        else:
            if patch < 1 or length % patch:
                raise ValueError(f"model.patch={patch} does not divide the signal length {length}")
            tokens = length // patch
        if heads < 1 or dim % heads:
            raise ValueError(f"model.dim={dim} is not divisible by model.heads={heads}")
        self.causal, self.patch = causal, patch
        self.embed = nn.Embedding(num_classes, dim) if causal else nn.Linear(patch, dim)
        self.position = nn.Parameter(torch.zeros(1, tokens, dim))
        nn.init.normal_(self.position, std=0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.causal:
            h = self.embed(x) + self.position[:, :x.shape[1]]
        else:
            if x.dim() == 3:  # (N, 1, L)
                x = x.flatten(1)
            h = self.embed(x.unflatten(1, (-1, self.patch))) + self.position
        for block in self.blocks:  # position t attends to positions <= t only when causal
            h = block(h, self.causal)
        if self.causal:
            return self.head(self.norm(h)).transpose(1, 2)  # (N, vocab, T)
        return self.head(self.norm(h).mean(1))
