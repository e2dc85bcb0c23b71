"""The one exception type lbt raises for mistakes a user can fix, and the file-system errors no retry mends."""

from __future__ import annotations

import difflib
import errno
from collections.abc import Iterable

# Errors that a restart meets again: the disk, the permissions, the file system.
LASTING_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS)
# What each says of the place lbt writes to, and whether it is the user's to fix by another path (exit 2) or
# a real failure of the machine (exit 1: a full disk; the same command continues once there is room).
PLACE_ERRNOS = {
    errno.ENOSPC: ("its disk is full", 1),
    errno.EDQUOT: ("its disk quota is used up", 1),
    errno.EFBIG: ("a file there may not grow this large (the disk, or the shell's `ulimit -f`)", 1),
    errno.EROFS: ("it is on a read-only file system", 2),
    errno.EACCES: ("lbt may not write there", 2),
    errno.EPERM: ("lbt may not write there", 2),
    errno.ENOTDIR: ("a part of the path is a file, not a folder", 2),
    errno.EEXIST: ("it exists and is not a folder", 2),
    errno.EISDIR: ("it is a folder, not a file", 2),
}


def first_line(error: BaseException) -> str:
    """An error's first line, or its type's name when it says nothing: what a one-line report quotes."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def closest(name: str, options: Iterable[str]) -> str | None:
    """The option `name` most likely mistypes (difflib's ratio at least 0.6), for a "did you mean" hint."""
    close = difflib.get_close_matches(name, [str(option) for option in options], n=1, cutoff=0.6)
    return close[0] if close else None


class ConfigError(ValueError):
    """A bad config value, a missing dataset, a batch that does not divide.

    Entry points catch it and print its message as one line (exit code 2),
    so the message must name the offending key or path and what is expected.
    """


def os_error_of(error: BaseException) -> OSError | None:
    """The OSError under an exception: torch.save reports a full disk as a RuntimeError raised while
    handling the file's OSError (errno ENOSPC or EFBIG)."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None or isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def naming(error: OSError, path: object) -> OSError:
    """The error with the file or folder it was writing named: a full disk fails a write() that knows no name."""
    if error.filename is not None or error.errno is None:
        return error
    return type(error)(error.errno, error.strerror, str(path))


def place_problem(error: BaseException) -> tuple[str, int] | None:
    """One line and an exit code for a file-system error no rerun mends by itself (a full disk, a read-only
    folder, /dev/null as a folder), naming the path; None for any other error."""
    found = os_error_of(error)
    if found is None or found.errno not in PLACE_ERRNOS:
        return None
    why, code = PLACE_ERRNOS[found.errno]
    path = found.filename if found.filename is not None else "a file lbt writes"
    then = "free space there, then run the same command again to continue" if code == 1 else "give another path"
    return f"cannot write {path}: {why} ({found.strerror or found}); {then}", code
