"""Writing a file atomically (results, checkpoints and data caches are published whole), and a folder's lock."""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable

from lbt.errors import ConfigError, naming


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """write(file) into a temporary file beside `path`, then rename it into place.

    A reader never sees a half-written file, and several processes writing the
    same file (the ranks of a job generating one data cache) each publish a
    whole one. A failed write leaves `path` as it was.
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError as error:
        raise naming(error, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename publishes it: a power cut leaves old or new
        os.chmod(tmp, 0o644)  # mkstemp makes it private (0600); results and caches are meant to be shared
        os.replace(tmp, path)
    except OSError as error:
        os.unlink(tmp)
        raise naming(error, path) from error
    except BaseException:
        os.unlink(tmp)
        raise


@contextmanager
def waiting_lock(lock_file: str | Path, waiting: str | None = None) -> Iterator[None]:
    """Hold an OS file lock (flock) on `lock_file` while the block runs, waiting for it if another process
    holds it; `waiting` is printed to stderr first when it does. The kernel drops the lock however its holder
    ends, so a dead holder never blocks anyone."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class FolderInUse(ConfigError):
    """Another live process holds the folder's lock; the message names it."""


def check_free(folder: str | Path) -> None:
    """FolderInUse if a live process holds `folder`'s lock (the lock is not taken, nothing is written)."""
    path = Path(folder) / ".lock"
    if not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
        raise FolderInUse(f"{folder} is in use by {holder}: wait for it to end, or use another folder") from None
    finally:
        os.close(fd)


@contextmanager
def folder_lock(folder: str | Path) -> Iterator[None]:
    """Hold `folder`'s lock while the block runs: a second process asking for it fails at once.

    An OS file lock (flock) on `<folder>/.lock`, so the kernel releases it however the holder ends,
    a kill -9 included: a lock left by a dead process is never in the way. The file says who holds
    it (pid and command), for the message the second process gets.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:  # /dev/null, a path under /proc, a read-only folder: before anything is written
        raise ConfigError(f"cannot use {folder} as a folder: {error.strerror or error} "
                          f"({error.filename or folder}): give another path") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            raise FolderInUse(f"{folder} is in use by {holder}: wait for it to end, or use another folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({' '.join(sys.argv)[:300]})\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
