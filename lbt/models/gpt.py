"""A small GPT in nanoGPT's shape (model=gpt): token and position embeddings, pre-LN causal blocks, a final
LayerNorm and a head tied to the token embedding.

The blocks are transformer1d's (lbt/models/transformer1d.py): attention through torch's
scaled_dot_product_attention with is_causal=True, its qkv laid out head by head so tensor parallelism
splits it by heads, and an MLP nn.Sequential(Linear, GELU, Dropout, Linear) split as a Megatron pair.
The tied head is an unpaired trailing Linear: tensor parallelism keeps it whole, with the embedding it
shares its weight with (lbt/parallel/tensor_parallel.py). No BatchNorm: simulated workers are exact.
Initialised as nanoGPT does: N(0, 0.02) weights, zero biases, and the projections back into the residual
stream (attention's `out`, the MLP's second Linear) at 0.02 / sqrt(2 n_layer) (GPT-2).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lbt.models.transformer1d import Block


class GPT(nn.Module):
    """`n_layer` pre-LN blocks of width `n_embd` with `n_head` heads, over contexts of up to input_shape[-1]
    tokens of a `num_classes`-token vocabulary: (N, T) ids -> (N, vocab, T) next-token logits, the layout
    CrossEntropyLoss takes with (N, T) labels."""

    shard_blocks = "blocks"  # dist.shard=fsdp gathers one block at a time (lbt/parallel/fsdp.py)

    def __init__(self, input_shape=(256,), num_classes: int = 256, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, mlp_ratio: int = 4, dropout: float = 0.0):
        super().__init__()
        if n_head < 1 or n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} is not divisible by model.n_head={n_head}")
        self.context = int(input_shape[-1])
        self.token = nn.Embedding(num_classes, n_embd)
        self.position = nn.Embedding(self.context, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, mlp_ratio, dropout) for _ in range(n_layer))
        self.norm = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, num_classes, bias=False)
        self.head.weight = self.token.weight  # tied (Press & Wolf 2017), as in GPT-2 and nanoGPT
        self.apply(_init)
        for name, param in self.named_parameters():  # the projections back into the residual stream
            if name.endswith(("attn.out.weight", "mlp.3.weight")):  # Block.mlp: Linear, GELU, Dropout, Linear
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        if length > self.context:
            raise ValueError(f"a sequence of {length} tokens is longer than the model's context {self.context}")
        positions = torch.arange(length, device=ids.device)
        h = self.drop(self.token(ids) + self.position(positions))
        for block in self.blocks:
            h = block(h, causal=True)
        return self.head(self.norm(h)).transpose(1, 2)  # (N, vocab, T)


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
