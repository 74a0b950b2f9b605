"""What a path names, found with stat and never by opening it: the check every reader of a user-given path (the user
DB, shipped DBs, AUTOSEL_RECORD, export and merge inputs, shape files) makes first. Opening a FIFO waits for a
writer that never comes, and opening a device node can act on the device, so neither is ever opened."""

from __future__ import annotations

import errno
import os
import stat
from typing import IO, Any

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def special_kind(path: str | os.PathLike) -> str | None:
    """What `path` is when it exists and is not a regular file ("a FIFO (named pipe)", "a folder", ...), links
    followed; None for a regular file, or where nothing can be found (the open that follows says why)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # ValueError: a NUL in the name
        return None
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "a special file")


class NotRegularFile(OSError):
    """A path to read or append to names a FIFO, a device, a socket or a folder; it was not opened. An OSError, so
    that every reader's handling of an unreadable file applies."""

    def __init__(self, path: str | os.PathLike, kind: str):
        super().__init__(errno.EINVAL, f"{path} is {kind}, not a regular file, so it was not opened", str(path))
        self.kind = kind

    def __str__(self) -> str:
        return self.strerror


def check_regular(path: str | os.PathLike) -> None:
    """NotRegularFile if `path` exists and is not a regular file."""
    kind = special_kind(path)
    if kind is not None:
        raise NotRegularFile(path, kind)


def open_regular(path: str | os.PathLike, mode: str = "r", **kwargs: Any) -> IO:
    """open(), refusing (NotRegularFile) a path that exists and is not a regular file instead of opening it."""
    check_regular(path)
    return open(path, mode, **kwargs)
