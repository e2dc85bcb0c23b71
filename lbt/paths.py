"""Files and folders: where lbt's Hydra config tree lives, and writing a file atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def conf_dir() -> Path:
    package = Path(__file__).resolve().parent
    source_checkout = package.parent / "conf"  # repo layout: conf/ beside lbt/
    if (source_checkout / "config.yaml").is_file():
        return source_checkout
    return package / "conf"  # installed wheel: conf/ packaged as lbt/conf


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
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
