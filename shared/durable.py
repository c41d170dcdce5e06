"""Durable file writes: a temp file renamed into place, and the fsyncs that make the rename survive
a crash. Shared by the checkpoint writers (tiny files, HF directories) and the trainer's store."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def fsync_path(path: Path) -> None:
    """fsync one file or directory (a directory's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``, then ``root`` itself."""
    for path in [*root.rglob("*"), root]:
        fsync_path(path)


def atomic_write(target: Path, write: Callable[[IO[bytes]], object]) -> None:
    """``write`` into a temp file next to ``target``, fsync it, rename it over ``target`` and fsync
    the directory: readers see the old file or the whole new one, also after a crash."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(target.parent)
