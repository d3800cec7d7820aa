"""A fake LLM HTTP server speaking the Anthropic Messages API and the OpenAI chat-completions API.

It is a real aiohttp server on ``127.0.0.1`` (a free port) running in a background thread with its own
event loop, so the real SDKs (and a bot started as a subprocess) talk to it over HTTP::

    with FakeLLMServer() as srv:
        srv.enqueue(FakeResponse.text("hello"), FakeResponse.error(429))
        client = anthropic.AsyncAnthropic(api_key="k", base_url=srv.anthropic_url)
        ...
        assert srv.requests[0].body["model"] == "claude-test"

Routes: ``POST /v1/messages`` (Anthropic, JSON or SSE), ``POST /v1/messages/count_tokens``,
``POST /v1/chat/completions`` (OpenAI, JSON or SSE), ``POST /v1/embeddings`` (OpenAI shape) and
``GET /v1/models`` (Anthropic shape when the request carries an ``anthropic-version`` header, OpenAI
shape otherwise).

Embeddings are deterministic: each input's vector is derived from a SHA-256 of the model name and the
input (``srv.embedding_dim`` values, default 8, deliberately not unit length; see
:func:`fake_embedding`). Queue an error or malformed answer for the next embeddings POST with
``srv.enqueue_embedding(FakeResponse.error(500))``; that queue is separate from the completions queue.

Every request is recorded. Each POST to messages / chat completions takes the next queued
:class:`FakeResponse`; when the queue is empty ``srv.responder`` decides (default: echo the last user
text). Run it standalone with ``python -m tests.fakes.llm_server --port 8765``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import hashlib
import itertools
import json
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from aiohttp import web

Api = Literal["anthropic", "openai"]
StreamFailure = Literal["disconnect", "eof", "error_event"]
ToolInput = dict[str, Any] | list[Any] | str | int | float | bool | None

DEFAULT_MODELS = ("fake-model-large", "fake-model-small")
_RETRY_STATUSES = frozenset({408, 409, 429})

_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    402: "insufficient_quota",
    403: "permission_denied",
    404: "invalid_request_error",
    429: "rate_limit_exceeded",
}
_OPENAI_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
}


# --------------------------------------------------------------------------- recorded requests


class Headers(dict[str, str]):
    """A plain dict of request headers with lower-cased names and case-insensitive look-ups."""

    def __init__(self, items: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__((name.lower(), value) for name, value in items)

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return super().__contains__(name.lower() if isinstance(name, str) else name)

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


@dataclass(frozen=True)
class RecordedRequest:
    """One HTTP request the server received.

    ``headers`` is a dict with lower-cased names whose look-ups ignore case; ``body`` is the parsed
    JSON object (``{}`` for GETs and non-JSON bodies).
    """

    api: Api
    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def is_completion(self) -> bool:
        """True for a messages / chat-completions POST (the requests that consume responses)."""
        return self.path in ("/v1/messages", "/v1/chat/completions")

    def last_user_text(self) -> str:
        """The text of the last ``user`` message in the body (text blocks and tool results joined)."""
        for message in reversed(self.body.get("messages") or []):
            if isinstance(message, dict) and message.get("role") == "user":
                return _content_text(message.get("content"))
        return ""


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts: list[str] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif block.get("type") == "tool_result":
            parts.append(_content_text(block.get("content")))
    return "\n".join(p for p in parts if p)


# --------------------------------------------------------------------------- scripted responses


@dataclass(frozen=True)
class FakeResponse:
    """What the server answers to one completion request. Build it with the class methods."""

    kind: Literal["text", "tool_calls", "error", "malformed", "stream_error", "huge"]
    reply_text: str = ""
    chunks: tuple[str, ...] | None = None
    calls: tuple[tuple[str, str, ToolInput], ...] = ()
    input_tokens: int = 10
    output_tokens: int = 5
    stop_reason: str = "end_turn"
    send_usage: bool = True
    status: int = 200
    message: str = ""
    error_type: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    content_type: str = "application/json"
    delay: float = 0.0
    fail_after: int = 0
    failure: StreamFailure = "disconnect"
    repeat: int = 1  # the streamed pieces, this many times over (a server that goes on and on)

    @classmethod
    def text(
        cls,
        text: str,
        *,
        chunks: Iterable[str] | None = None,
        input_tokens: int = 10,
        output_tokens: int = 5,
        stop_reason: str = "end_turn",
        send_usage: bool = True,
        delay: float = 0.0,
    ) -> FakeResponse:
        """A text answer; ``chunks`` are the streamed pieces (default: about three pieces)."""
        return cls(
            kind="text",
            reply_text=text,
            chunks=tuple(chunks) if chunks is not None else None,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            stop_reason=stop_reason,
            send_usage=send_usage,
            delay=delay,
        )

    @classmethod
    def flood(cls, piece: str, times: int) -> FakeResponse:
        """A streamed text of ``piece`` sent ``times`` times, one event each (made as it is sent: megabytes
        cost the server nothing to hold); a non-streamed answer is ``piece`` once."""
        return cls(kind="text", reply_text=piece, chunks=(piece,), repeat=times)

    @classmethod
    def tool_calls(
        cls,
        calls: Iterable[tuple[str, str, ToolInput]],
        text: str = "",
        *,
        input_tokens: int = 10,
        output_tokens: int = 5,
        stop_reason: str = "tool_use",
        send_usage: bool = True,
        delay: float = 0.0,
    ) -> FakeResponse:
        """Tool calls ``(id, name, input)``; a ``str`` input is sent verbatim as (malformed) JSON."""
        return cls(
            kind="tool_calls",
            reply_text=text,
            calls=tuple(calls),
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            stop_reason=stop_reason,
            send_usage=send_usage,
            delay=delay,
        )

    @classmethod
    def error(
        cls,
        status: int,
        message: str = "fake error",
        *,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
        delay: float = 0.0,
    ) -> FakeResponse:
        """An HTTP error in the API's error shape. 408/409/429/5xx get ``retry-after-ms: 1`` by default."""
        all_headers = {"retry-after-ms": "1"} if status in _RETRY_STATUSES or status >= 500 else {}
        all_headers.update(headers or {})
        return cls(
            kind="error",
            status=status,
            message=message,
            error_type=error_type,
            headers=all_headers,
            delay=delay,
        )

    @classmethod
    def malformed(
        cls,
        body: bytes,
        status: int = 200,
        content_type: str = "application/json",
        *,
        delay: float = 0.0,
        headers: dict[str, str] | None = None,
    ) -> FakeResponse:
        """Answer with exactly these bytes (for streaming requests too), with ``headers`` besides the type."""
        return cls(kind="malformed", body=body, status=status, content_type=content_type, delay=delay,
                   headers=dict(headers or {}))

    @classmethod
    def huge(cls, mebibytes: int, content_type: str = "application/json") -> FakeResponse:
        """A non-streamed answer whose JSON body goes on for ``mebibytes`` MiB (made as it is sent, without a
        Content-Length), sent as ``content_type``; the server notes in ``huge_bytes_sent`` how much of it the
        client took."""
        return cls(kind="huge", repeat=mebibytes, content_type=content_type)

    @classmethod
    def stream_error_after(
        cls,
        n_events: int,
        text: str = "this answer is cut off midway",
        *,
        failure: StreamFailure = "disconnect",
        error_type: str | None = None,
        message: str = "stream failed",
        chunks: Iterable[str] | None = None,
        delay: float = 0.0,
    ) -> FakeResponse:
        """A stream of ``text`` that fails after ``n_events`` SSE events.

        ``failure``: ``"disconnect"`` drops the connection mid-body, ``"eof"`` ends the body cleanly
        without the final events, ``"error_event"`` sends the API's in-stream error event
        (``error_type`` defaults to ``overloaded_error`` / ``server_error``). A non-streaming request
        gets its connection dropped before any answer.
        """
        return cls(
            kind="stream_error",
            reply_text=text,
            chunks=tuple(chunks) if chunks is not None else None,
            fail_after=n_events,
            failure=failure,
            error_type=error_type,
            message=message,
            delay=delay,
        )

    def pieces(self) -> list[str]:
        """The streamed text pieces (once: see :meth:`streamed_pieces`)."""
        if self.chunks is not None:
            return list(self.chunks)
        return split_text(self.reply_text)

    def streamed_pieces(self) -> Iterator[str]:
        """The streamed text pieces, ``repeat`` times over."""
        pieces = self.pieces()
        for _ in range(self.repeat):
            yield from pieces


def split_text(text: str, parts: int = 3) -> list[str]:
    """Split ``text`` into about ``parts`` non-empty pieces (none for an empty text)."""
    if not text:
        return []
    size = max(1, -(-len(text) // parts))
    return [text[i : i + size] for i in range(0, len(text), size)]


def _raw_input(value: ToolInput) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def echo_responder(request: RecordedRequest) -> FakeResponse:
    """The default responder: ``echo: <last user message text>``."""
    return FakeResponse.text(f"echo: {request.last_user_text()}")


Responder = Callable[[RecordedRequest], FakeResponse]


# --------------------------------------------------------------------------- wire formats


def _anthropic_refusal(body: dict[str, Any]) -> str | None:
    """The request checks of the real Messages API that a client can trip over (see its error messages)."""
    for n, message in enumerate(body.get("messages") or ()):
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict) and block.get("type") == "text" and not str(block.get("text", "")).strip():
                return f"messages.{n}: text content blocks must contain non-whitespace text"
    return None


def _anthropic_error_body(resp: FakeResponse) -> dict[str, Any]:
    err_type = resp.error_type or _ANTHROPIC_ERROR_TYPES.get(resp.status, "api_error")
    return {"type": "error", "error": {"type": err_type, "message": resp.message}}


def _openai_error_body(resp: FakeResponse) -> dict[str, Any]:
    err_type = resp.error_type or _OPENAI_ERROR_TYPES.get(resp.status, "server_error")
    return {"error": {"message": resp.message, "type": err_type, "param": None, "code": err_type}}


def _anthropic_blocks(resp: FakeResponse) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if resp.reply_text:
        blocks.append({"type": "text", "text": resp.reply_text})
    for call_id, name, value in resp.calls:
        blocks.append({"type": "tool_use", "id": call_id, "name": name, "input": value})
    return blocks


def anthropic_message(resp: FakeResponse, model: str) -> dict[str, Any]:
    return {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _anthropic_blocks(resp),
        "stop_reason": resp.stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": resp.input_tokens, "output_tokens": resp.output_tokens},
    }


def anthropic_events(resp: FakeResponse, model: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The SSE events of a streamed Anthropic message, as ``(event name, data)``."""
    start = anthropic_message(resp, model)
    start.update(content=[], stop_reason=None)
    start["usage"] = {"input_tokens": resp.input_tokens, "output_tokens": 1}
    yield "message_start", {"type": "message_start", "message": start}
    yield "ping", {"type": "ping"}
    index = 0
    if resp.pieces():
        yield (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": index,
                "content_block": {"type": "text", "text": ""},
            },
        )
        for piece in resp.streamed_pieces():
            delta = {"type": "text_delta", "text": piece}
            yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
        index += 1
    for call_id, name, value in resp.calls:
        block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}
        for piece in [""] + split_text(_raw_input(value), 2):
            delta = {"type": "input_json_delta", "partial_json": piece}
            yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
        index += 1
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": resp.stop_reason, "stop_sequence": None},
            "usage": {"output_tokens": resp.output_tokens},
        },
    )
    yield "message_stop", {"type": "message_stop"}


def _openai_usage(resp: FakeResponse) -> dict[str, int]:
    total = resp.input_tokens + resp.output_tokens
    return {
        "prompt_tokens": resp.input_tokens,
        "completion_tokens": resp.output_tokens,
        "total_tokens": total,
    }


def openai_completion(resp: FakeResponse, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": resp.reply_text or None}
    if resp.calls:
        message["tool_calls"] = [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": _raw_input(value)}}
            for call_id, name, value in resp.calls
        ]
    body: dict[str, Any] = {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": _OPENAI_FINISH.get(resp.stop_reason, resp.stop_reason),
                "logprobs": None,
            }
        ],
    }
    if resp.send_usage:
        body["usage"] = _openai_usage(resp)
    return body


def openai_chunks(resp: FakeResponse, model: str, include_usage: bool) -> Iterator[dict[str, Any]]:
    """The ``data:`` payloads of a streamed OpenAI chat completion (without ``[DONE]``)."""
    include_usage = include_usage and resp.send_usage
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        if include_usage:
            data["usage"] = None
        return data

    yield chunk({"role": "assistant", "content": ""})
    for piece in resp.streamed_pieces():
        yield chunk({"content": piece})
    for i, (call_id, name, value) in enumerate(resp.calls):
        head = {"index": i, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        yield chunk({"tool_calls": [head]})
        for piece in split_text(_raw_input(value), 2):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    yield chunk({}, _OPENAI_FINISH.get(resp.stop_reason, resp.stop_reason))
    if include_usage:
        yield {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": _openai_usage(resp),
        }


def fake_embedding(text: object, dim: int, model: str = "") -> list[float]:
    """The fake server's deterministic embedding of one input (a string, or a token list as JSON)."""
    data = text if isinstance(text, str) else json.dumps(text)
    values: list[float] = []
    counter = 0
    while len(values) < dim:
        digest = hashlib.sha256(f"{model}\0{counter}\0{data}".encode()).digest()
        values.extend((byte - 127.5) / 64.0 for byte in digest)
        counter += 1
    return values[:dim]


def openai_embeddings(body: dict[str, Any], dim: int) -> dict[str, Any]:
    """An OpenAI ``/v1/embeddings`` answer for a request body (``encoding_format`` float or base64)."""
    model = str(body.get("model", "fake-embedding"))
    raw = body.get("input", "")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw)):
        inputs: list[Any] = [raw]
    else:
        inputs = list(raw) if isinstance(raw, list) else [raw]
    use_base64 = body.get("encoding_format") == "base64"
    data: list[dict[str, Any]] = []
    for index, item in enumerate(inputs):
        vector = fake_embedding(item, dim, model)
        embedding: Any = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() if use_base64 else vector
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(len(str(item).split()) for item in inputs)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


# --------------------------------------------------------------------------- the server


@dataclass
class SentStream:
    """One streamed answer as the server sent it: how many SSE frames went out, and how it ended ("whole",
    "dropped" by a scripted failure, "client left" before the end; "" while it goes on)."""

    frames: int = 0
    ended: str = ""


class FakeLLMServer:
    """The fake server. Use as a context manager, or call :meth:`start` / :meth:`stop`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.responder: Responder = echo_responder
        self.models: list[str] = list(DEFAULT_MODELS)
        self.models_missing = False  # GET /v1/models answers 404 with an HTML page
        self.huge_bytes_sent = 0  # of the last FakeResponse.huge answer: what the client took of it
        self.embedding_dim = 8
        self._requests: list[RecordedRequest] = []
        self._queue: collections.deque[FakeResponse] = collections.deque()
        self._embedding_queue: collections.deque[FakeResponse] = collections.deque()
        self._streams: list[SentStream] = []
        self._streams_seen = 0
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # ----- lifecycle

    def start(self) -> FakeLLMServer:
        if self._thread is not None:
            return self
        started = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start_site())
            except BaseException as exc:  # reported to the starting thread
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="FakeLLMServer", daemon=True)
        self._thread.start()
        started.wait(10)
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def stop(self) -> None:
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(15)
        self._thread = None
        self._loop = None
        self._runner = None

    def __enter__(self) -> FakeLLMServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def _start_site(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/messages", self._handle_anthropic)
        app.router.add_post("/v1/messages/count_tokens", self._handle_count_tokens)
        app.router.add_post("/v1/chat/completions", self._handle_openai)
        app.router.add_post("/v1/embeddings", self._handle_embeddings)
        app.router.add_get("/v1/models", self._handle_models)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        self.port = server.sockets[0].getsockname()[1]
        self._runner = runner

    # ----- public API

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def anthropic_url(self) -> str:
        return self.url

    @property
    def openai_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def requests(self) -> list[RecordedRequest]:
        """A copy of every request received so far, oldest first."""
        with self._cond:
            return list(self._requests)

    @property
    def completion_requests(self) -> list[RecordedRequest]:
        """Only the messages / chat-completions POSTs."""
        return [r for r in self.requests if r.is_completion]

    @property
    def embedding_requests(self) -> list[RecordedRequest]:
        """Only the ``/v1/embeddings`` POSTs."""
        return [r for r in self.requests if r.path == "/v1/embeddings"]

    def enqueue_embedding(self, *responses: FakeResponse) -> None:
        """Queue answers for embeddings POSTs (``error`` / ``malformed``; anything else means "answer
        normally"). When this queue is empty, embeddings get deterministic vectors."""
        with self._cond:
            self._embedding_queue.extend(responses)

    def enqueue(self, *responses: FakeResponse) -> None:
        """Queue responses; each completion POST consumes one, in order."""
        with self._cond:
            self._queue.extend(responses)

    @property
    def pending(self) -> int:
        """How many queued responses are still unused."""
        with self._cond:
            return len(self._queue)

    def reset(self) -> None:
        """Forget recorded requests and queued responses; restore the default responder."""
        with self._cond:
            self._requests.clear()
            self._queue.clear()
            self._embedding_queue.clear()
            self._streams.clear()
            self._streams_seen = 0
            self.responder = echo_responder
            self.models = list(DEFAULT_MODELS)
            self.models_missing = False
            self.embedding_dim = 8

    def wait_for(
        self, predicate: Callable[[RecordedRequest], bool] = lambda r: True, timeout: float = 5.0
    ) -> RecordedRequest:
        """Block until a recorded request satisfies ``predicate`` and return it (``TimeoutError`` if not)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for request in self._requests:
                    if predicate(request):
                        return request
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no matching request within {timeout} s")
                self._cond.wait(remaining)

    async def wait_for_async(
        self,
        predicate: Callable[[RecordedRequest], bool] = lambda r: True,
        timeout: float = 5.0,
    ) -> RecordedRequest:
        """:meth:`wait_for` for async tests (does not block the event loop)."""
        return await asyncio.to_thread(self.wait_for, predicate, timeout)

    # ----- request handling

    async def _record(self, request: web.Request, api: Api) -> RecordedRequest:
        body: dict[str, Any] = {}
        if request.can_read_body:
            try:
                parsed = json.loads(await request.read() or b"{}")
            except ValueError:
                parsed = {}
            body = parsed if isinstance(parsed, dict) else {"_": parsed}
        recorded = RecordedRequest(api=api, path=request.path, headers=Headers(request.headers.items()), body=body)
        with self._cond:
            self._requests.append(recorded)
            self._cond.notify_all()
        return recorded

    def _next_response(self, recorded: RecordedRequest) -> FakeResponse:
        with self._cond:
            if self._queue:
                return self._queue.popleft()
        return self.responder(recorded)

    async def _answer(self, request: web.Request, api: Api) -> web.StreamResponse:
        recorded = await self._record(request, api)
        refused = _anthropic_refusal(recorded.body) if api == "anthropic" else None
        if refused:  # what the real API refuses, it refuses here too (the queued answer stays queued)
            return web.json_response({"type": "error", "error": {"type": "invalid_request_error", "message": refused}},
                                     status=400)
        resp = self._next_response(recorded)
        if resp.delay:
            await asyncio.sleep(resp.delay)
        model = str(recorded.body.get("model", "fake-model"))
        if resp.kind == "error":
            body = _anthropic_error_body(resp) if api == "anthropic" else _openai_error_body(resp)
            return web.json_response(body, status=resp.status, headers=resp.headers)
        if resp.kind == "malformed":
            return web.Response(body=resp.body, status=resp.status,
                                headers={**resp.headers, "Content-Type": resp.content_type})
        if resp.kind == "huge":
            return await self._send_huge(request, resp.repeat, resp.content_type)
        if resp.kind == "stream_error" and not recorded.stream:
            _drop_connection(request)
            raise asyncio.CancelledError
        if not recorded.stream:
            if api == "anthropic":
                return web.json_response(anthropic_message(resp, model))
            return web.json_response(openai_completion(resp, model))
        if api == "anthropic":
            return await self._stream_anthropic(request, resp, model)
        include_usage = bool((recorded.body.get("stream_options") or {}).get("include_usage"))
        return await self._stream_openai(request, resp, model, include_usage)

    async def _stream_anthropic(self, request: web.Request, resp: FakeResponse, model: str) -> web.StreamResponse:
        frames = (
            f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in anthropic_events(resp, model)
        )
        error = {
            "type": "error",
            "error": {"type": resp.error_type or "overloaded_error", "message": resp.message},
        }
        error_frame = f"event: error\ndata: {json.dumps(error)}\n\n".encode()
        return await self._write_stream(request, resp, frames, error_frame)

    async def _stream_openai(
        self, request: web.Request, resp: FakeResponse, model: str, include_usage: bool
    ) -> web.StreamResponse:
        chunks = (f"data: {json.dumps(c)}\n\n".encode() for c in openai_chunks(resp, model, include_usage))
        frames = itertools.chain(chunks, [b"data: [DONE]\n\n"])
        error = {"error": {"message": resp.message, "type": resp.error_type or "server_error", "code": None}}
        error_frame = f"data: {json.dumps(error)}\n\n".encode()
        return await self._write_stream(request, resp, frames, error_frame)

    async def _send_huge(self, request: web.Request, mebibytes: int, content_type: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": content_type})
        response.enable_chunked_encoding()
        await response.prepare(request)
        piece = b"x" * (1 << 20)
        self.huge_bytes_sent = 0
        try:
            await response.write(b'{"id": "')
            for _ in range(mebibytes):
                await response.write(piece)
                self.huge_bytes_sent += len(piece)
            await response.write(b'"}')
            await response.write_eof()
        except (ConnectionResetError, RuntimeError):  # the client stopped reading and went away
            pass
        return response

    async def _write_stream(
        self, request: web.Request, resp: FakeResponse, frames: Iterable[bytes], error_frame: bytes
    ) -> web.StreamResponse:
        sent = SentStream()
        with self._cond:
            self._streams.append(sent)
        try:
            return await self._send_frames(request, resp, frames, error_frame, sent)
        finally:  # (a write that failed, or the handler cancelled: the client went away first)
            self._stream_ended(sent, sent.ended or "client left")

    async def _send_frames(
        self, request: web.Request, resp: FakeResponse, frames: Iterable[bytes], error_frame: bytes, sent: SentStream
    ) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)
        failing = resp.kind == "stream_error"
        for frame in itertools.islice(frames, resp.fail_after) if failing else frames:
            await stream.write(frame)
            sent.frames += 1
            await asyncio.sleep(0)
        if failing:
            if resp.failure == "disconnect":
                await asyncio.sleep(0.01)  # let the client read what was sent before the drop
                sent.ended = "dropped"
                _drop_connection(request)
                raise asyncio.CancelledError
            if resp.failure == "error_event":
                await stream.write(error_frame)
        await stream.write_eof()
        sent.ended = "whole"
        return stream

    def _stream_ended(self, sent: SentStream, how: str) -> None:
        with self._cond:
            sent.ended = how
            self._cond.notify_all()

    def wait_for_stream_end(self, timeout: float = 5.0) -> SentStream:
        """Block until the first streamed answer not yet returned by this method has ended, and return it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self._streams_seen < len(self._streams) and self._streams[self._streams_seen].ended):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no streamed answer ended within {timeout} s")
                self._cond.wait(remaining)
            self._streams_seen += 1
            return self._streams[self._streams_seen - 1]

    async def wait_for_stream_end_async(self, timeout: float = 5.0) -> SentStream:
        """:meth:`wait_for_stream_end` for async tests."""
        return await asyncio.to_thread(self.wait_for_stream_end, timeout)

    async def _handle_anthropic(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "anthropic")

    async def _handle_openai(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "openai")

    async def _handle_embeddings(self, request: web.Request) -> web.StreamResponse:
        recorded = await self._record(request, "openai")
        with self._cond:
            resp = self._embedding_queue.popleft() if self._embedding_queue else None
            dim = self.embedding_dim
        if resp is not None:
            if resp.delay:
                await asyncio.sleep(resp.delay)
            if resp.kind == "error":
                return web.json_response(_openai_error_body(resp), status=resp.status, headers=resp.headers)
            if resp.kind == "malformed":
                return web.Response(body=resp.body, status=resp.status,
                                    headers={**resp.headers, "Content-Type": resp.content_type})
            if resp.kind == "huge":
                return await self._send_huge(request, resp.repeat, resp.content_type)
        return web.json_response(openai_embeddings(recorded.body, dim))

    async def _handle_count_tokens(self, request: web.Request) -> web.StreamResponse:
        recorded = await self._record(request, "anthropic")
        return web.json_response({"input_tokens": max(1, len(json.dumps(recorded.body)) // 4)})

    async def _handle_models(self, request: web.Request) -> web.StreamResponse:
        if self.models_missing:  # a server that chats but lists no models, answering with an HTML page
            return web.Response(status=404, content_type="text/html",
                                text="<html><head><title>404 Not Found</title></head><body><h1>Not Found</h1>"
                                     "<p>The requested URL was not found on this server.</p></body></html>")
        if "anthropic-version" in request.headers:
            await self._record(request, "anthropic")
            data: list[dict[str, Any]] = [
                {"type": "model", "id": m, "display_name": m, "created_at": "2025-01-01T00:00:00Z"} for m in self.models
            ]
            first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
            return web.json_response({"data": data, "has_more": False, "first_id": first, "last_id": last})
        await self._record(request, "openai")
        openai_data = [{"id": m, "object": "model", "created": 1735689600, "owned_by": "fake"} for m in self.models]
        return web.json_response({"object": "list", "data": openai_data})


def _drop_connection(request: web.Request) -> None:
    """Abort the TCP connection (no more bytes, no clean end of the chunked body)."""
    transport = request.transport
    if transport is None:
        return
    if isinstance(transport, asyncio.Transport):
        transport.abort()
    else:
        transport.close()


def main(argv: list[str] | None = None) -> None:
    """Serve the echo responder until interrupted."""
    parser = argparse.ArgumentParser(description="Fake Anthropic/OpenAI-compatible LLM server (echo responder).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    with FakeLLMServer(args.host, args.port) as srv:
        print(f"Fake LLM server on {srv.url}  (Anthropic base_url {srv.anthropic_url}, OpenAI {srv.openai_url})")
        print("Press Ctrl-C to stop.", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
