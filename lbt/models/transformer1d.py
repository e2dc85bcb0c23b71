"""A small pre-LayerNorm transformer: MNIST-1D's signal as patch tokens, or characters for language modelling.

No BatchNorm: each sample's gradient is independent of the rest of its batch, so W simulated
workers equal one worker of the global batch (the AdamW world's models are LayerNorm models).
"""

from __future__ import annotations

import torch
from torch import nn


class Transformer1d(nn.Module):
    """`depth` pre-LN encoder blocks (torch's `nn.TransformerEncoderLayer`, norm_first) of width `dim`.

    Classification (causal=false): a (N, L) signal is cut into L/patch tokens of `patch` samples,
    embedded linearly with a learned position embedding; the blocks' mean token feeds the head:
    logits (N, num_classes).
    Language modelling (causal=true): (N, T) integer token ids (num_classes = the vocabulary),
    embedded, causal attention; logits (N, num_classes, T), the layout CrossEntropyLoss takes
    with (N, T) next-token labels.
    """

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
        if dim % heads:
            raise ValueError(f"model.dim={dim} is not divisible by model.heads={heads}")
        self.causal, self.patch = causal, patch
        self.embed = nn.Embedding(num_classes, dim) if causal else nn.Linear(patch, dim)
        self.position = nn.Parameter(torch.zeros(1, tokens, dim))
        nn.init.normal_(self.position, std=0.02)
        block = nn.TransformerEncoderLayer(dim, heads, dim * mlp_ratio, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        if causal:  # -inf above the diagonal: position t attends to positions <= t only
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(tokens), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.causal:
            length = x.shape[1]
            h = self.embed(x) + self.position[:, :length]
            h = self.blocks(h, mask=self.mask[:length, :length], is_causal=True)
            return self.head(self.norm(h)).transpose(1, 2)  # (N, vocab, T)
        if x.dim() == 3:  # (N, 1, L)
            x = x.flatten(1)
        h = self.embed(x.unflatten(1, (-1, self.patch))) + self.position
        return self.head(self.norm(self.blocks(h)).mean(1))
