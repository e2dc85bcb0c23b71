"""Plug-in techniques; see lbt/techniques/base.py for the hooks and where they fire."""

from lbt.techniques.base import Progress, Technique, sort_techniques

__all__ = ["Progress", "Technique", "sort_techniques"]
