"""lbt: large-batch training recipes for PyTorch.

Measure how accuracy falls as the global batch grows with the number of
data-parallel workers, and recover it with plug-in techniques.
"""

__version__ = "0.1.0"
