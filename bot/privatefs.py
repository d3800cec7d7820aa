"""Files that hold people's words (the database, terminal histories, exports, a Matrix login) are created
readable by their owner alone, whatever the umask: other accounts of a shared server must not read them.

Folders and files that exist already are left as they are (an operator may have chosen their modes), but for a
folder holding keys (a Matrix store: the login, and with encryption the account's and rooms' keys), which is made
the owner's alone whatever it was (:func:`own_folder`); ``cortexbot doctor`` says when the database or such a
folder can be read by others.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path) -> None:
    """Create ``path`` and its missing parents, each new one owner-only (``OSError`` when it cannot)."""
    missing: list[Path] = []
    current = path
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=DIR_MODE)
        except FileExistsError:  # made meanwhile by another process: theirs to keep
            if not folder.is_dir():
                raise


def private_file(path: Path) -> None:
    """Create ``path`` empty and owner-only unless it exists (SQLite then creates its WAL and shared
    memory files with the same mode as the database file)."""
    try:
        create_private(path).close()
    except FileExistsError:
        return


def create_private(path: Path) -> BinaryIO:
    """A new file at ``path``, owner-only from its first byte, open for writing (``FileExistsError`` when
    a file is there: nothing is ever overwritten)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE)
    return os.fdopen(fd, "wb")


def own_folder(path: Path) -> None:
    """``path`` made (see :func:`private_dir`) or, when others may enter it, made owner-only, and each file in it
    that others may read or write too (``OSError`` when it cannot be: the folder is not this account's)."""
    private_dir(path)
    if exposed_in(path):
        os.chmod(path, DIR_MODE)
        for file in path.iterdir():
            if file.is_file() and not file.is_symlink() and stat.S_IMODE(file.stat().st_mode) & 0o077:
                os.chmod(file, FILE_MODE)


def exposed_in(folder: Path) -> list[Path]:
    """``folder``, when other accounts may enter or list it, and the files in it they may read or write."""
    try:
        found = [folder] if stat.S_IMODE(folder.stat().st_mode) & 0o077 else []
        files = [f for f in folder.iterdir() if f.is_file() and not f.is_symlink()]
        return found + sorted(f for f in files if stat.S_IMODE(f.stat().st_mode) & 0o077)
    except OSError:  # (missing, or not this account's to list)
        return []


def readable_by_others(path: Path) -> bool:
    """Whether accounts other than the owner may read ``path`` (a missing file: no)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return bool(mode & (stat.S_IRGRP | stat.S_IROTH))
