"""Optimizers (LARS, LAMB, Muon with AdamW), the parameter filter they share with weight decay, and the factory."""

from lbt.optim.factory import create_optimizer
from lbt.optim.lamb import LAMB, lamb_trust_ratio
from lbt.optim.lars import LARS, lars_trust_ratio
from lbt.optim.muon import MuonAdamW, muon_split
from lbt.optim.param_groups import EXCLUDE_FROM_TRUST, is_excluded, param_groups

__all__ = [
    "EXCLUDE_FROM_TRUST",
    "LAMB",
    "LARS",
    "MuonAdamW",
    "create_optimizer",
    "is_excluded",
    "lamb_trust_ratio",
    "lars_trust_ratio",
    "muon_split",
    "param_groups",
]
