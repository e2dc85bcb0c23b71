"""Layers shared by the core and by techniques (the core never imports a plug-in)."""

from lbt.nn.batchnorm import GhostBatchNorm, ghost_batch_norm, replace_batchnorms

__all__ = ["GhostBatchNorm", "ghost_batch_norm", "replace_batchnorms"]
