"""A file a command came with: an attachment on a chat platform, or a path in the terminal only (the
person at the terminal runs the bot; a chat user never names a file on the bot's machine)."""

from __future__ import annotations

import asyncio
import stat
from collections.abc import Sequence
from pathlib import Path

from bot.commands import TERMINAL, CommandContext, CommandError

# The largest file any command takes (a memory export's zip), which the adapters download at most; each
# command's reader holds its file to its own cap (a character card: 8 MB).
MAX_ATTACHMENT_BYTES = 50 * 1024 * 1024


async def attached_file(ctx: CommandContext, args: Sequence[str], what: str, max_bytes: int) -> tuple[str, bytes]:
    """(file name, bytes) of the command's file, or a CommandError saying how to send one."""
    if ctx.attachments:  # its size was checked by the adapter that downloaded it, and again by its reader
        return ctx.attachments[0].filename, ctx.attachments[0].data
    if ctx.platform != TERMINAL:
        raise CommandError(f"attach {what} to the command's message")
    if not args:
        raise CommandError(f"give the path of {what}")
    path = Path(" ".join(args))
    try:
        return path.name, await asyncio.to_thread(_read, path, max_bytes)  # a slow disk must not stall the bot
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from None


def _read(path: Path, max_bytes: int) -> bytes:
    """A regular file's bytes, at most ``max_bytes``: a device (/dev/zero) or a pipe has no end to read to
    and no size to check first, so only regular files are taken."""
    path = path.expanduser()
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):
        raise CommandError(f"{path} is not a regular file")
    if info.st_size > max_bytes:
        raise CommandError(f"{path.name} is {info.st_size / 1024 / 1024:.1f} MB; at most {max_bytes >> 20} MB")
    with path.open("rb") as file:
        data = file.read(max_bytes + 1)  # the file may have grown since
    if len(data) > max_bytes:
        raise CommandError(f"{path.name} is larger than {max_bytes >> 20} MB")
    return data

