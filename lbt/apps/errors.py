"""How a command ends on a mistake the user can fix: one `lbt: error:` line on stderr and exit code 2."""

from __future__ import annotations

import sys
from typing import NoReturn


def fail(message: str) -> NoReturn:
    print(f"lbt: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)
