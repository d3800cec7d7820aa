"""Skills from MCP servers: the tools of every ``[[skills.mcp]]`` server, through the official ``mcp`` SDK.

One :class:`McpServer` per configured server. Its connection (the stdio child process or the streamable
HTTP client, and the :class:`~mcp.ClientSession` over it) lives in ONE long-lived asyncio task that
enters and leaves the SDK's context managers (anyio cancel scopes must be entered and exited in the
same task); calls reach that task through a queue and are answered through futures.

The task supervises the connection: when the stdio process exits, the HTTP connection fails or the
server stops answering pings (sent while no call waits on it: a call's own deadline covers that time), the
server is marked down and reconnected with a backoff (1 s doubling up to 60 s by default); after every
(re)connection, and whenever the server sends ``notifications/tools/list_changed``, its tools are listed
again. A call while the server is down answers an error result at once; a call running past
``timeout_seconds`` answers an error result and leaves the session usable.

:class:`McpTool` is one tool as a :class:`~cortex.skills.base.Skill`; :class:`McpSkills` runs all
configured servers and names their tools for the model (a tool keeps its own name unless two servers
offer the same one: then both are called ``<server>_<tool>``).

Secrets (``env_from`` variables for a stdio server, ``headers_env`` headers for an HTTP server) are read
from the bot's environment when the server is built (one unset stops the start, as for an HTTP skill) and are
never logged. A stdio server inherits only the SDK's small safe environment (PATH, HOME, ...) plus ``env`` and
``env_from``, never the bot's own secrets. What it writes on its stderr is logged line by line under its name,
those secrets redacted (see ``stderr.py``); the SDK's own log lines are cut to one line, their tracebacks (which
quote what a server sent) dropped and every server's secrets redacted (see ``sdk_logs.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self, TextIO

import anyio
import httpx2
import mcp.types as types
from jsonschema import exceptions as schema_errors
from jsonschema import validators
from mcp import ClientSession, StdioServerParameters
from mcp.client import IncomingMessage, Transport
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from bot.config import McpServerConfig
from bot.httpcap import PLAIN, CappedBody, compression
from bot.text import one_line
from cortex.skills.base import (
    SkillContext,
    SkillInfo,
    SkillResult,
    from_environment,
    model_name,
    redact,
    redact_cut,
    redaction_values,
)
from cortex.skills.sdk_logs import guard
from cortex.skills.stderr import stderr_lines
from cortex.skills.stdio import AnswerTooLarge, capped_stdio_client

log = logging.getLogger(__name__)
ERROR_CHARS = 300  # a server's error, described in one line, at most
STDERR_LINE_CHARS = 1_000  # a line of a stdio server's stderr, logged at most


@dataclass(frozen=True, slots=True)
class McpOptions:
    """How servers are supervised (tests shorten these)."""

    backoff_initial: float = 1.0  # first wait before reconnecting
    backoff_max: float = 60.0  # the wait doubles up to this
    stable_after: float = 60.0  # a connection up this long resets the wait to backoff_initial
    connect_timeout: float = 20.0  # longest initialize + tools/list (and the longest start() waits)
    health_interval: float = 30.0  # ping an established connection this often
    close_timeout: float = 10.0  # longest aclose() waits for a server's task before cancelling it


@dataclass(slots=True)
class _Call:
    name: str
    arguments: dict[str, Any]
    future: asyncio.Future[SkillResult]


class _Receiver(Protocol):
    async def receive(self) -> SessionMessage | Exception: ...

    async def aclose(self) -> None: ...


class _WatchedReadStream:
    """The transport's read stream, noticing its end (the stdio server exited, the connection closed)."""

    def __init__(self, inner: _Receiver) -> None:
        self._inner = inner
        self.ended = asyncio.Event()

    @property
    def last_context(self) -> Any:
        """The sender's context, for transports that carry one (read by the SDK's dispatcher)."""
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self.ended.set()
            raise

    async def aclose(self) -> None:
        self.ended.set()
        await self._inner.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def _describe_error(exc: BaseException) -> str:
    """A description of an exception (the leaves of an exception group), whole: secrets are redacted before it
    is cut (see ``McpServer.error_line``)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe_error(inner) for inner in exc.exceptions)
    if isinstance(exc, MCPError):
        return f"MCP error {exc.code}: {exc.message}"
    if isinstance(exc, ValidationError):  # a server's answer the SDK refused: what, where (pydantic's is a page)
        errors = exc.errors()
        where = ".".join(str(part) for part in errors[0]["loc"]) if errors else ""
        return (f"the server's answer does not follow the protocol ({exc.error_count()} problem(s); "
                f"{where}: {errors[0]['msg'] if errors else ''})")
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _unreadable_answer(exc: Exception) -> str | None:
    """Why the SDK could not read a line of the server's that is an answer to a call (one nested too deep for
    it, say). None for any other exception, and for lines that answer no call: text (a log line printed on the
    server's output), a JSON log record, a notification the SDK could not read."""
    if isinstance(exc, AnswerTooLarge):  # (a line not held: which call it answered is not known)
        return str(exc)
    if not isinstance(exc, ValidationError) or not exc.errors():
        return None
    error = exc.errors()[0]
    line = error.get("input")
    # JSON the SDK parsed but refused (its input is then the parsed object) is an answer when it has an id and a
    # result or an error, of a shape the SDK does not take ("error": "upstream failed"); else a log record. A
    # line it could not parse at all is looked at with Python's parser.
    if isinstance(line, dict):
        return _answer_problem(line) if _answers(line) else None
    return one_line(str(error["msg"]), ERROR_CHARS) if isinstance(line, str) and _is_answer(line) else None


_JSON_OBJECT = re.compile(r"\s*\{")
_ANSWER_KEYS = re.compile(r'"(?:result|error)"\s*:')


def _is_answer(line: str) -> bool:
    """Whether a line the SDK could not read is a JSON-RPC answer: an object with an id and a result or an error
    (read with Python's own parser, which takes the nesting the SDK's refused; past even that, by its keys)."""
    if not _JSON_OBJECT.match(line):
        return False
    try:
        message = json.loads(line)
    except RecursionError:
        return '"jsonrpc"' in line and '"id"' in line and _ANSWER_KEYS.search(line) is not None
    except ValueError:
        return False
    return isinstance(message, dict) and _answers(message)


def _answers(message: dict[Any, Any]) -> bool:
    """Whether a JSON object is a JSON-RPC answer: the version, an id, a result or an error (a structured log line
    may well have an id and an error of its own)."""
    return message.get("jsonrpc") == "2.0" and "id" in message and ("result" in message or "error" in message)


def _answer_problem(message: dict[Any, Any]) -> str:
    """What makes an answer the SDK refused no answer of the protocol's shape (pydantic's first complaint is about
    a request's missing method)."""
    if "error" in message and not isinstance(message["error"], dict):
        return f"its error is {_json_kind(message['error'])}, not an object with a code and a message"
    if "error" in message:
        return "its error lacks a whole-number code or a text message"
    return f"its result is {_json_kind(message['result'])}, not an object"


def _json_kind(value: Any) -> str:
    return {str: "a text", list: "a list", bool: "true or false", type(None): "null"}.get(type(value), "a number")


def _describe_part(part: types.ContentBlock) -> str:
    if isinstance(part, types.TextContent):
        return part.text
    if isinstance(part, types.EmbeddedResource):
        resource = part.resource
        if isinstance(resource, types.TextResourceContents):
            return resource.text
        return f"[resource {resource.uri}]"
    if isinstance(part, types.ResourceLink):
        return f"[resource link {part.uri}]"
    return f"[{part.type}]"  # image, audio


def result_text(result: types.CallToolResult) -> str:
    """The text of a tool result: its text parts joined, other parts described (``[image]``, ...)."""
    parts = [_describe_part(part) for part in result.content]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False, default=str))
    return "\n".join(parts)


MAX_DESCRIPTION_CHARS = 1_000  # a tool's description goes into every prompt it is offered in
MAX_SCHEMA_CHARS = 8_000  # a tool whose input schema is larger is not offered
MAX_SERVER_TOOLS = 256  # tools of one server taken (a reply offers 128 in all): a server listing thousands cost
MAX_LIST_PAGES = 50  # every reply time to weigh them; and pages of its list read, however many it promises
# An HTTP server's JSON answer read at most (the SDK reads it whole, where it caps each event of a stream at 1 MB),
# and a stdio server's message (a line): a server answering without end would otherwise fill the bot's memory. A
# result is cut far below this anyway.
MAX_JSON_RESPONSE_BYTES = 8 << 20


def _redacted_strings(value: Any, redacted: Callable[[str], str]) -> Any:
    """A JSON value (a tool's input schema) with ``redacted`` applied to every string in it, keys included."""
    if isinstance(value, str):
        return redacted(value)
    if isinstance(value, dict):
        return {redacted(key): _redacted_strings(item, redacted) for key, item in value.items()}
    if isinstance(value, list):
        return [_redacted_strings(item, redacted) for item in value]
    return value


def schema_problem(tool: types.Tool) -> str | None:
    """Why a server's tool may not be offered, or None: its input schema must describe an object, as the model
    APIs require (one of another type made every request it was offered in fail: no reply at all; one that names
    no type is offered as an object's, see ``McpTool``), be a valid JSON schema (a provider refuses the whole
    request over one that is not: ``"type": "text"``), and be small enough (it is sent with every request)."""
    schema = tool.input_schema
    if schema.get("type", "object") != "object":
        return "its input schema describes no object"
    if len(json.dumps(schema, default=str)) > MAX_SCHEMA_CHARS:
        return f"its input schema is over {MAX_SCHEMA_CHARS} characters"
    offered = {"type": "object", **schema}
    try:
        validators.validator_for(offered).check_schema(offered)
    except schema_errors.SchemaError as exc:
        return f"its input schema is no valid JSON schema ({one_line(exc.message, 120)})"
    return None


class McpTool:
    """One tool of an MCP server, as a skill; ``run`` calls it on its server by its original name. The
    server writes its description: it is cut at :data:`MAX_DESCRIPTION_CHARS` (every token of it is paid
    for in every request, and it is text from outside the bot)."""

    def __init__(self, server: McpServer, tool: types.Tool, name: str | None = None) -> None:
        self._server = server
        self._tool = tool
        config = server.config
        described = tool.description or tool.title or f"The {tool.name} tool of the {config.name} MCP server."
        self._info = SkillInfo(
            name=name or model_name(tool.name),
            description=described if len(described) <= MAX_DESCRIPTION_CHARS
            else described[:MAX_DESCRIPTION_CHARS] + "…",
            input_schema={"type": "object", **tool.input_schema},  # ("properties" alone: the APIs want the type)
            origin="mcp",
            admin_only=config.admin_only,
            triggers=tuple(config.triggers),
            server=config.name,
            secrets=server.secrets,
            tool=tool.name,
        )

    @property
    def info(self) -> SkillInfo:
        return self._info

    @property
    def original_name(self) -> str:
        """The tool's name on its server."""
        return self._tool.name

    @property
    def server(self) -> McpServer:
        return self._server

    def renamed(self, name: str) -> McpTool:
        """The same tool offered to the model under another name."""
        return McpTool(self._server, self._tool, name)

    async def run(self, arguments: dict[str, Any], context: SkillContext) -> SkillResult:
        return await self._server.call(self._tool.name, arguments)


class McpServer:
    """One configured MCP server: its supervised connection, its tools, and calls to them."""

    def __init__(self, config: McpServerConfig, options: McpOptions | None = None) -> None:
        self.config = config
        self._options = options or McpOptions()
        self._queue: asyncio.Queue[_Call] = asyncio.Queue()
        self._tools: list[McpTool] = []
        self._up = False
        self._task: asyncio.Task[None] | None = None
        self._attempted = asyncio.Event()  # the first connection attempt is over (either way)
        self._stop = asyncio.Event()
        self._relist = asyncio.Event()
        self._interruptible: anyio.CancelScope | None = None  # a connect or a backoff wait aclose() may cut
        self._connected_at: float | None = None
        self.last_error = ""  # why the last connection failed or ended ("" while none did)
        where = f"[[skills.mcp]] {config.name!r}"
        self._env_from = from_environment(config.env_from, where, "env_from")
        self._headers = from_environment(config.headers_env, where, "header")
        # (their values: never shown anywhere)
        self._secrets = tuple(value for value in (*self._env_from.values(), *self._headers.values()) if value.strip())
        self._in_flight: set[anyio.CancelScope] = set()  # the calls waiting for the server's answer
        self._stalled = False  # a call's deadline passed, and the server has answered nothing since
        self._answered_at = 0.0  # (monotonic) the server's last answer to a call in time, or its connection
        self._unread = ""  # why the server's last answer could not be read

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def secrets(self) -> tuple[str, ...]:
        """The values of the server's ``env_from`` variables and ``headers_env`` headers."""
        return self._secrets

    def redacted(self, text: str) -> str:
        """``text`` with every secret of the server replaced: a server may echo its token in a result or
        an error, and both reach the model, the audit and the log."""
        return redact(text, redaction_values(self._secrets))

    def error_line(self, exc: BaseException) -> str:
        """An exception of this server's, in one line of at most ``ERROR_CHARS``, its secrets redacted (then cut)."""
        return redact_cut(_describe_error(exc), redaction_values(self._secrets), ERROR_CHARS)

    @property
    def up(self) -> bool:
        """Whether the server is connected and its tools listed."""
        return self._up

    @property
    def tools(self) -> list[McpTool]:
        """The server's tools allowed by the config (as last listed; kept while the server is down)."""
        return list(self._tools)

    async def start(self) -> None:
        """Start the supervising task and wait (at most ``connect_timeout``) for its first attempt.

        Never raises: a server that cannot start is logged and retried in the background."""
        guard(self)  # (the SDK's own log lines: the server's secrets redacted, no traceback quoting what it sent)
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name=f"mcp-server:{self.name}")
        with suppress(TimeoutError):
            async with asyncio.timeout(self._options.connect_timeout):
                await self._attempted.wait()

    async def aclose(self) -> None:
        """Stop the server: close the session, end a stdio child process; answer pending calls."""
        self._stop.set()
        if self._interruptible is not None:
            self._interruptible.cancel()
        task, self._task = self._task, None
        if task is not None:
            done, _ = await asyncio.wait({task}, timeout=self._options.close_timeout)
            if not done:
                log.warning("mcp server %s: did not stop in time; cancelling it", self.name)
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
        self._up = False
        self._fail_queued()

    async def call(self, name: str, arguments: dict[str, Any]) -> SkillResult:
        """Call the tool ``name`` (its name on the server); never raises for the server's failures."""
        if self.config.tools and name not in self.config.tools:
            return SkillResult(f"the {self.name} server does not offer the tool {name!r}", is_error=True)
        if not self._up or self._stop.is_set():
            return self._unreachable()
        future: asyncio.Future[SkillResult] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Call(name, arguments, future))
        try:
            async with asyncio.timeout(self.config.timeout_seconds + self._options.connect_timeout):
                return await future
        except TimeoutError:
            return self._timed_out(name)

    def _unreachable(self) -> SkillResult:
        return SkillResult(f"the {self.name} server is not reachable right now", is_error=True)

    def _timed_out(self, name: str) -> SkillResult:
        seconds = self.config.timeout_seconds
        return SkillResult(f"the {name} tool of the {self.name} server did not answer within {seconds:g} s",
                           is_error=True)

    def _fail_queued(self) -> None:
        while not self._queue.empty():
            call = self._queue.get_nowait()
            if not call.future.done():
                call.future.set_result(self._unreachable())

    # --- the supervising task -------------------------------------------------------------------

    async def _supervise(self) -> None:
        delay = self._options.backoff_initial
        last_reason = ""
        while not self._stop.is_set():
            reason = "the connection ended"
            try:
                await self._connect_and_serve()
            except Exception as exc:  # any failure of the server or its transport
                reason = self.error_line(exc)
            finally:
                self._up = False
                self._fail_queued()
                self.last_error = reason
                self._attempted.set()
            if self._stop.is_set():
                break
            loop_time = asyncio.get_running_loop().time()
            if self._connected_at is not None and loop_time - self._connected_at >= self._options.stable_after:
                delay = self._options.backoff_initial
            level = logging.DEBUG if reason == last_reason else logging.WARNING  # no flood from a dead server
            log.log(level, "mcp server %s is down (%s); retrying in %g s", self.name, reason, delay)
            last_reason = reason
            with anyio.CancelScope() as self._interruptible:
                await anyio.sleep(delay)
            self._interruptible = None
            delay = min(delay * 2, self._options.backoff_max)

    async def _connect_and_serve(self) -> None:
        """Connect, initialize, list the tools, then serve calls until the connection ends or stop."""
        self._connected_at = None
        self._relist.clear()
        async with AsyncExitStack() as stack:
            errlog = await stack.enter_async_context(stderr_lines(self._log_stderr)) if self.config.command else None
            read_stream, write_stream = await stack.enter_async_context(self._transport(errlog))
            watched = _WatchedReadStream(read_stream)
            session = await stack.enter_async_context(
                ClientSession(watched, write_stream, message_handler=self._on_message)
            )
            with anyio.CancelScope() as self._interruptible:  # aclose() may cut the handshake short
                if not self._stop.is_set():
                    with anyio.fail_after(self._options.connect_timeout):
                        await session.initialize()
                        await self._list_tools(session)
            self._interruptible = None
            if self._stop.is_set():
                return
            self._connected_at = asyncio.get_running_loop().time()
            self._up = True
            self._attempted.set()
            log.info("mcp server %s connected: %d tools", self.name, len(self._tools))
            try:
                await self._serve(session, watched)
            finally:
                self._up = False

    def _log_stderr(self, line: str) -> None:
        """A line a stdio server wrote on its stderr (its complaints, a traceback), logged under its name with its
        secrets redacted: it went into the bot's stderr as written, a token it printed included."""
        if line.strip():
            log.warning("mcp server %s says: %s", self.name,
                        redact_cut(line, redaction_values(self._secrets), STDERR_LINE_CHARS))

    def _transport(self, errlog: TextIO | None) -> Transport:
        if errlog is not None:
            command, *args = self.config.command
            # A byte that is no UTF-8 (a file passed on in Latin-1) becomes U+FFFD: strict decoding ended the
            # reading of the server's output, and every later call waited out its timeout while it seemed up.
            params = StdioServerParameters(command=command, args=args, env=self._stdio_env(),
                                           encoding_error_handler="replace")
            return capped_stdio_client(params, errlog, MAX_JSON_RESPONSE_BYTES)
        return self._http_transport()

    @asynccontextmanager
    async def _http_transport(self) -> AsyncIterator[Any]:
        timeout = httpx2.Timeout(30.0, read=300.0)  # the SDK's defaults (a response stream may stay open)
        # (A hook, not a transport of its own: a client given one no longer takes the proxy from the environment.)
        async with httpx2.AsyncClient(headers={**self._http_headers(), **PLAIN},
                                      timeout=timeout, event_hooks={"response": [cap_json_answers]}) as client:
            async with streamable_http_client(self.config.url, http_client=client) as streams:
                yield streams

    def _stdio_env(self) -> dict[str, str]:
        return {**self.config.env, **self._env_from}

    def _http_headers(self) -> dict[str, str]:
        return dict(self._headers)

    async def _serve(self, session: ClientSession, watched: _WatchedReadStream) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._cancel_when, watched.ended, tg.cancel_scope)
            tg.start_soon(self._cancel_when, self._stop, tg.cancel_scope)
            tg.start_soon(self._keep_listing, session)
            tg.start_soon(self._keep_pinging, session, tg.cancel_scope)
            while True:
                call = await self._queue.get()
                if not call.future.done():  # its caller may have given up while it waited
                    tg.start_soon(self._answer, session, call)

    @staticmethod
    async def _cancel_when(event: asyncio.Event, scope: anyio.CancelScope) -> None:
        await event.wait()
        scope.cancel()

    async def _keep_listing(self, session: ClientSession) -> None:
        while True:
            await self._relist.wait()
            self._relist.clear()
            try:
                with anyio.fail_after(self._options.connect_timeout):
                    await self._list_tools(session)
                log.info("mcp server %s: tool list changed: %d tools", self.name, len(self._tools))
            except Exception as exc:
                log.warning("mcp server %s: listing its tools failed: %s", self.name,
                            self.error_line(exc))

    async def _keep_pinging(self, session: ClientSession, scope: anyio.CancelScope) -> None:
        """Ping the server every ``health_interval`` while no call waits on it, and end the connection (``scope``)
        when it does not answer. While calls wait, their own deadlines cover the time: a server doing one thing at
        a time answers no ping while it works, and its long call was cut. Once a call's deadline passed with no
        answer since and none for a whole call's time (:meth:`_hung`), the ping is judged with calls waiting too: a
        hung server that a busy bot kept calling was never restarted."""
        self._answered()  # (connected)
        while True:
            await anyio.sleep(self._options.health_interval)
            if self._in_flight and not self._hung():
                continue
            failure = await self._ping(session)
            judged = self._hung() or not (isinstance(failure, TimeoutError) and self._in_flight)
            if failure is not None and judged:
                log.warning("mcp server %s did not answer a ping: %s", self.name, self.error_line(failure))
                scope.cancel()
                return
            self._stalled = self._stalled and failure is not None

    def _answered(self) -> None:
        """The server answered a call in time: it is not hung."""
        self._stalled, self._answered_at = False, time.monotonic()

    def _hung(self) -> bool:
        """Whether a call's deadline passed unanswered and the server has answered no call for as long as a call may
        take. A server doing one thing at a time may answer a call that waited behind another late (and the late
        answer is dropped), then go on answering: it is slow, not hung."""
        return self._stalled and time.monotonic() - self._answered_at >= self.config.timeout_seconds

    async def _ping(self, session: ClientSession) -> Exception | None:
        """Why a ping found the server dead, or None. An error answer (a server that knows no ``ping``: "Method
        not found") is an answer: the server is alive."""
        try:
            with anyio.fail_after(self._options.connect_timeout):
                await session.send_ping()
        except MCPError as exc:
            return exc if exc.code == types.CONNECTION_CLOSED else None
        except Exception as exc:
            return exc
        return None

    async def _on_message(self, message: IncomingMessage) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self._relist.set()
        elif isinstance(message, Exception):
            unread = _unreadable_answer(message)
            if unread is None or not self._in_flight:
                level = logging.WARNING if isinstance(message, AnswerTooLarge) else logging.DEBUG
                log.log(level, "mcp server %s: transport error: %s", self.name, self.error_line(message))
                return
            # The SDK says which line it could not read, not which call it answered: every call waiting then
            # fails now rather than waiting out its timeout ("did not answer") for an answer already dropped.
            self._unread = self.redacted(unread)
            log.warning("mcp server %s: an answer could not be read (%s); failing the %d call(s) waiting",
                        self.name, self._unread, len(self._in_flight))
            for scope in self._in_flight:
                scope.cancel()

    async def _list_tools(self, session: ClientSession) -> None:
        listed: list[types.Tool] = []
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await session.list_tools(params=params)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        else:
            log.warning("mcp server %s: its tool list has more than %d pages; the rest is not read", self.name,
                        MAX_LIST_PAGES)
        allowed = set(self.config.tools)
        first: dict[str, types.Tool] = {}
        for tool in listed:  # a name once, its first listing (a server repeating its cursor repeats its tools)
            first.setdefault(tool.name, self._without_secrets(tool))
        listed = list(first.values())
        wanted = [tool for tool in listed if not allowed or tool.name in allowed]
        fitting = []
        for tool in wanted:
            if (problem := schema_problem(tool)) is None:
                fitting.append(tool)
            else:
                log.warning("mcp server %s: its tool %s is not offered: %s", self.name, one_line(tool.name, 80),
                            problem)
        if len(fitting) > MAX_SERVER_TOOLS:
            log.warning("mcp server %s offers %d tools; the first %d are taken (list the ones wanted in its "
                        "tools = [...])", self.name, len(fitting), MAX_SERVER_TOOLS)
        self._tools = [McpTool(self, tool) for tool in fitting[:MAX_SERVER_TOOLS]]
        missing = allowed - {tool.name for tool in listed}
        if missing:
            log.warning("mcp server %s does not offer the configured tools %s", self.name, sorted(missing))

    def _without_secrets(self, tool: types.Tool) -> types.Tool:
        """``tool`` with its secrets redacted from what the server says about it (its description, title and
        input schema): that text goes to the model with every request and to ``!skills list``, and a server may
        describe the database it reaches by its DSN, password and all."""
        described = {"description": tool.description and self.redacted(tool.description),
                     "title": tool.title and self.redacted(tool.title),
                     "input_schema": _redacted_strings(tool.input_schema, self.redacted)}
        if described == {"description": tool.description, "title": tool.title, "input_schema": tool.input_schema}:
            return tool
        log.warning("mcp server %s: the description of its tool %s holds one of the server's env_from / "
                    "headers_env values; it is offered with that value redacted", self.name, tool.name)
        return tool.model_copy(update=described)

    async def _answer(self, session: ClientSession, call: _Call) -> None:
        result: SkillResult | None = None
        try:
            with anyio.CancelScope() as waiting:  # cancelled when the server's answer cannot be read
                self._in_flight.add(waiting)
                try:
                    result = await self._call_tool(session, call.name, call.arguments)
                finally:
                    self._in_flight.discard(waiting)
            if waiting.cancelled_caught:
                result = SkillResult(f"the {self.name} server's answer could not be read ({self._unread})",
                                     is_error=True)
        finally:
            if result is None:  # cut short: the connection is being lost
                self._up = False
            if not call.future.done():
                call.future.set_result(result or self._unreachable())

    async def _call_tool(self, session: ClientSession, name: str, arguments: dict[str, Any]) -> SkillResult:
        result = await self._call_tool_unredacted(session, name, arguments)
        return SkillResult(self.redacted(result.content), result.is_error, result.changed)

    async def _call_tool_unredacted(self, session: ClientSession, name: str, arguments: dict[str, Any]
                                    ) -> SkillResult:
        try:
            with anyio.fail_after(self.config.timeout_seconds):
                result = await session.call_tool(name, arguments)
            self._answered()
        except TimeoutError:
            self._stalled = True
            return self._timed_out(name)
        except MCPError as exc:
            if exc.code == types.CONNECTION_CLOSED:
                self._up = False
                return self._unreachable()
            self._answered()  # (a refusal is an answer too)
            return SkillResult(f"the {self.name} server refused the call: {exc.message}", is_error=True)
        except Exception as exc:  # e.g. a result that fails the tool's output schema
            # (The log names the kind alone: the SDK's text quotes the result, and the result, like the arguments,
            # may hold the person's words, while the log outlives a forget-me and an incognito pause.)
            log.warning("mcp server %s: calling %s failed (%s)", self.name, name, type(exc).__name__)
            return SkillResult(f"calling {name} on the {self.name} server failed: {self.error_line(exc)}",
                               is_error=True)
        text = result_text(result)
        if result.is_error:
            return SkillResult(text or f"the {name} tool failed", is_error=True)
        return SkillResult(text)


class ResponseTooLarge(httpx2.StreamError):
    """A JSON answer over :data:`MAX_JSON_RESPONSE_BYTES`, or compressed though the client asked for it plain
    (its unpacked size is known only once it is held): a stream error, so the SDK answers the call with it."""


async def cap_json_answers(response: httpx2.Response) -> None:
    """(A response hook of the HTTP client, which asks for plain bodies.) A JSON answer's body read up to
    :data:`MAX_JSON_RESPONSE_BYTES`; an event stream has the SDK's own cap per event."""
    if "json" not in response.headers.get("content-type", "").lower():
        return
    assert isinstance(response.stream, httpx2.AsyncByteStream)
    refused = ResponseTooLarge("the server's answer came compressed, though it was asked for it plain")
    response.stream = CappedBody(
        response.stream, MAX_JSON_RESPONSE_BYTES,
        lambda: ResponseTooLarge(f"the server's answer is larger than {MAX_JSON_RESPONSE_BYTES >> 20} MB"),
        refused if compression(response) else None)


class McpSkills:
    """All configured MCP servers, and their tools named for the model."""

    def __init__(self, configs: Sequence[McpServerConfig], options: McpOptions | None = None) -> None:
        self._servers = [McpServer(config, options) for config in configs]

    @property
    def servers(self) -> list[McpServer]:
        return list(self._servers)

    async def start(self) -> None:
        """Start every server concurrently; one that fails is retried in the background."""
        await asyncio.gather(*(server.start() for server in self._servers))

    async def aclose(self) -> None:
        """Stop every server (stdio children end)."""
        await asyncio.gather(*(server.aclose() for server in self._servers))

    def down(self) -> list[tuple[str, str]]:
        """The servers not connected now, each with why (its last failure, or "not connected yet")."""
        return [(server.name, server.last_error or "not connected yet") for server in self._servers if not server.up]

    def skills(self) -> list[McpTool]:
        """The tools of all servers as now known: a name two servers share becomes ``<server>_<tool>``."""
        offered = [tool for server in self._servers for tool in server.tools]
        owners: dict[str, set[str]] = {}
        for tool in offered:
            owners.setdefault(tool.info.name, set()).add(tool.server.name)
        skills: list[McpTool] = []
        taken: set[str] = set()
        for tool in offered:
            name = tool.info.name
            if len(owners[name]) > 1:
                name = model_name(f"{tool.server.name}_{tool.original_name}")
            if name in taken:
                log.warning("mcp server %s: skipping the tool %s: the name %s is taken",
                            tool.server.name, tool.original_name, name)
                continue
            taken.add(name)
            skills.append(tool if name == tool.info.name else tool.renamed(name))
        return skills
