"""A file a command came with: an attachment on a chat platform, or a path in the terminal only (the
person at the terminal runs the bot; a chat user never names a file on the bot's machine)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bot.commands import CommandContext, CommandError

TERMINAL = "console"


def attached_file(ctx: CommandContext, args: Sequence[str], what: str, max_bytes: int) -> tuple[str, bytes]:
    """(file name, bytes) of the command's file, or a CommandError saying how to send one."""
    if ctx.attachments:
        return ctx.attachments[0].filename, ctx.attachments[0].data
    if ctx.platform != TERMINAL:
        raise CommandError(f"attach {what} to the command's message")
    if not args:
        raise CommandError(f"give the path of {what}")
    path = Path(" ".join(args)).expanduser()
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise CommandError(f"{path.name} is {size / 1e6:.1f} MB; at most {max_bytes // 1024 // 1024} MB")
        return path.name, path.read_bytes()
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from None
