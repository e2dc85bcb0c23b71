"""`python -m lbt train ...` and `torchrun ... -m lbt train ...`: the same as the `lbt` command."""

from lbt.apps.cli import main

main()
