"""A child process's stderr read by the bot line by line, instead of written into the bot's own stderr.

:func:`stderr_lines` gives a file to pass as a child's stderr (the write end of a pipe) and hands each line the
child writes to a callback, which logs it the way the bot wants (an MCP server's under its name, its secrets
redacted). A line is read up to :data:`LINE_BYTES`; the rest of a longer one is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import TextIO

log = logging.getLogger(__name__)

LINE_BYTES = 4_000  # the most of one line kept (a child writing megabytes without a line break is cut)
DRAIN_SECONDS = 1.0  # how long the lines still in the pipe are read after the block ends


@asynccontextmanager
async def stderr_lines(on_line: Callable[[str], None]) -> AsyncIterator[TextIO]:
    """A file for a child's stderr; ``on_line`` gets each line written to it (decoded, without its line break).

    On leaving the block the bot's copy of the pipe's write end is closed and the lines still in the pipe are
    read (for :data:`DRAIN_SECONDS` at most: a grandchild may hold the pipe open); then the reading task ends
    and the read end is closed, whatever happened, so a server restarted a thousand times leaves no descriptor.
    """
    read_fd, write_fd = os.pipe()  # (not inherited: a child gets the write end as its stderr, nothing else)
    writer = os.fdopen(write_fd, "w", encoding="utf-8")  # (opening a descriptor does not block)
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    reader = asyncio.StreamReader()
    try:
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe)
    except BaseException:
        writer.close()
        pipe.close()
        raise
    task = asyncio.create_task(_read_lines(reader, on_line), name="child-stderr")
    try:
        yield writer
    finally:
        writer.close()  # the child's copy closes when it exits: then the reader sees the pipe's end
        try:
            with suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), DRAIN_SECONDS)
        finally:
            task.cancel()
            transport.close()


async def _read_lines(reader: asyncio.StreamReader, on_line: Callable[[str], None]) -> None:
    pending, cut = b"", False  # cut: the start of the line being read was handed on already; its rest is dropped
    while chunk := await reader.read(1 << 16):
        *ended, pending = (pending + chunk).split(b"\n")
        for line in ended:
            if not cut:
                _hand_on(line, on_line)
            cut = False
        if len(pending) > LINE_BYTES:
            if not cut:
                _hand_on(pending[:LINE_BYTES], on_line)
            pending, cut = b"", True
    if pending and not cut:
        _hand_on(pending, on_line)


def _hand_on(line: bytes, on_line: Callable[[str], None]) -> None:
    try:
        on_line(line.rstrip(b"\r").decode("utf-8", errors="replace"))
    except Exception:  # a bug in the callback must not stop the reading (the child would block on a full pipe)
        log.exception("handling a line of a child process's stderr failed")
