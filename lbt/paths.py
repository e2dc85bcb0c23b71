"""Writing a file atomically: results, checkpoints and data caches are published whole."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """write(file) into a temporary file beside `path`, then rename it into place.

    A reader never sees a half-written file, and several processes writing the
    same file (the ranks of a job generating one data cache) each publish a
    whole one. A failed write leaves `path` as it was.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename publishes it: a power cut leaves old or new
        os.chmod(tmp, 0o644)  # mkstemp makes it private (0600); results and caches are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
