"""The stdio transport to an MCP server: the SDK's ``stdio_client``, reading the server's output with a cap on a line.

The SDK's reader takes a line of any size and copies all it holds again for every 64 KB that comes in: a tool
answering with 64 MB kept a core busy for minutes, and every other call to that server waited behind it (then "did
not answer"). Here each line is found by searching only the bytes that are new, and one longer than the cap is not
held: the session is handed :class:`AnswerTooLarge` as soon as it passes the cap (which fails the calls waiting on
that server, see ``McpServer._on_message``), and the rest of the line is skipped up to its end; the lines after it
are read as usual.

Everything else is the SDK's own (its ``mcp.client.stdio`` helpers, of the 2.x SDK the project pins): the server's
process in a session of its own with the SDK's small safe environment, its lines parsed (and logged when they are
no JSON-RPC) as the SDK does, and the stop that closes its stdin, waits, then kills its whole process tree.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TextIO

import anyio
import anyio.lowlevel
from mcp.client import stdio as sdk
from mcp.client._transport import TransportStreams
from mcp.client.stdio import StdioServerParameters
from mcp.os.win32.utilities import ServerProcess
from mcp.shared.message import SessionMessage

log = logging.getLogger(__name__)
MAX_LINE_BYTES = 8 << 20  # a message of a stdio server's read at most


class AnswerTooLarge(Exception):
    """A line of the server's output longer than the cap: not read (what it answered is lost)."""


class LineReader:
    """Lines out of chunks of bytes, found in linear time; a line longer than ``limit`` is dropped."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._buffer = bytearray()
        self._searched = 0  # the bytes of the buffer already searched for a line's end
        self._skipping = False  # in the rest of a line over the limit

    def feed(self, chunk: bytes) -> list[bytes | None]:
        """The lines ``chunk`` ends (without their ``\\n``), and None, once, for a line past the limit (as soon
        as it passes it: the rest of it is skipped)."""
        if self._skipping:
            end = chunk.find(b"\n")
            if end < 0:
                return []
            chunk, self._skipping = chunk[end + 1:], False
        self._buffer += chunk
        lines: list[bytes | None] = []
        while (end := self._buffer.find(b"\n", self._searched)) >= 0:
            lines.append(bytes(self._buffer[:end]) if end <= self._limit else None)
            del self._buffer[:end + 1]
            self._searched = 0
        self._searched = len(self._buffer)
        if self._searched > self._limit:
            lines.append(None)
            self._buffer.clear()
            self._searched, self._skipping = 0, True
        return lines


class _Pipes:
    """The memory streams between a server process's pipes and the session, and the tasks that move messages."""

    def __init__(self, process: ServerProcess, server: StdioServerParameters, limit: int) -> None:
        self.process = process
        self._server = server
        self._limit = limit
        self.read_writer, self.read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        self.write_stream, self.write_reader = anyio.create_memory_object_stream[SessionMessage](0)
        self.shutting_down = False
        self._writer_done = anyio.Event()

    async def read_stdout(self) -> None:
        try:
            async with self.read_writer:
                try:
                    await self._forward_lines()
                finally:
                    await sdk._drain_stdout(self.process)
        except anyio.ClosedResourceError:
            pass  # our own stop closed the stdout stream under the read
        except (anyio.BrokenResourceError, ConnectionError) as exc:  # (the session sees the stream end)
            if not self.shutting_down:
                log.warning("reading an MCP server's output failed: %s", type(exc).__name__)

    async def _forward_lines(self) -> None:
        assert self.process.stdout, "the server process has no stdout"
        lines = LineReader(self._limit)
        async for chunk in self.process.stdout:
            for line in lines.feed(chunk):
                try:
                    await self.read_writer.send(self._message(line))
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return  # the session is gone; only the drain remains

    def _message(self, line: bytes | None) -> SessionMessage | Exception:
        if line is None:
            return AnswerTooLarge(f"the answer was larger than {self._limit >> 20} MB")
        return sdk._parse_line(line.decode(self._server.encoding, self._server.encoding_error_handler))

    async def write_stdin(self) -> None:
        assert self.process.stdin, "the server process has no stdin"
        try:
            async with self.write_reader:
                async for session_message in self.write_reader:
                    json = session_message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await self.process.stdin.send(
                        (json + "\n").encode(self._server.encoding, self._server.encoding_error_handler))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await self.read_writer.aclose()  # the session sees the connection end, not a request hanging
        finally:
            self._writer_done.set()

    async def shutdown(self) -> None:
        """Stop the traffic, let the writer flush what it took, stop the server, release the streams."""
        self.read_stream.close()  # (a server stuck writing its output cannot read: the reader drains it)
        self.write_stream.close()
        with anyio.move_on_after(sdk._WRITER_FLUSH_TIMEOUT) as flush:
            await self._writer_done.wait()
        if flush.cancelled_caught:
            await anyio.lowlevel.cancel_shielded_checkpoint()
        await sdk._stop_server_process(self.process)
        await sdk._aclose_all(self.read_stream, self.write_stream, self.read_writer, self.write_reader)
        await anyio.lowlevel.checkpoint()


@asynccontextmanager
async def capped_stdio_client(server: StdioServerParameters, errlog: TextIO,
                              limit: int = MAX_LINE_BYTES) -> AsyncIterator[TransportStreams]:
    """Start the server and yield the session's read and write streams (as ``mcp.client.stdio.stdio_client``);
    stop it on the way out, even when cancelled."""
    command = await sdk._get_executable_command(server.command)
    process = await sdk._create_platform_compatible_process(
        command=command, args=server.args, env=sdk.get_default_environment() | (server.env or {}), errlog=errlog,
        cwd=server.cwd)
    pipes = _Pipes(process, server, limit)  # (no await until the task group is entered: the process would leak)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pipes.read_stdout)
        tg.start_soon(pipes.write_stdin)
        try:
            yield pipes.read_stream, pipes.write_stream
        finally:
            pipes.shutting_down = True
            with anyio.CancelScope(shield=True):  # every wait in it is bounded
                await pipes.shutdown()
            tg.cancel_scope.cancel()  # (a survivor of the kill may still hold a pipe open)
    await anyio.lowlevel.cancel_shielded_checkpoint()
