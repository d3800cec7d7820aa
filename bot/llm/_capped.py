"""A cap on what a model server's non-streamed answer may send, by an event hook on the SDK's HTTP client.

A streamed answer is read event by event and fails past :data:`bot.llm.base.MAX_STREAMED_CHARS` characters; a
non-streamed one (a summary's, a cortex update's) was read whole by the SDK before any of it was
looked at: a broken or hostile server at the configured URL could fill the process's memory. The hook wraps each
response's body so that reading it fails past :data:`bot.llm.base.MAX_ANSWER_BYTES`, and the rest is not read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import httpx2

from bot.httpcap import PLAIN, CappedBody, refuse_unread
from bot.llm.base import MAX_ANSWER_BYTES, past_answer_cap
from bot.llm.errors import LLMBadResponse

# A request's JSON asking for a stream (its top-level "stream": true; inside a string its quotes would be escaped).
STREAM_ASKED = re.compile(rb'"stream"\s*:\s*true')


def _asked_to_stream(request: httpx2.Request) -> bool:
    """Whether ``request`` asked for a stream: only then is an event stream counted where it is read. One sent to a
    request for a whole answer is read whole by the SDK, and is capped like any other answer."""
    try:
        return STREAM_ASKED.search(request.content) is not None
    except httpx2.RequestNotRead:  # (a streamed request body: the SDKs send JSON, whose content is known)
        return False


def capped_http_client(provider: str, client_class: Callable[..., httpx2.AsyncClient]) -> httpx2.AsyncClient:
    """The SDK's own HTTP client (``client_class``: its ``DefaultAsyncHttpxClient``, with its defaults) whose
    answers are capped. A stream asked for (``text/event-stream``) is counted by its characters where it is read
    instead: its framing would count against its text here. Answers are asked for uncompressed, and a compressed
    one is refused unread: the cap counts what arrives, and 40 KB of gzip unpacked to 40 MB of answer."""

    def too_large() -> LLMBadResponse:
        return past_answer_cap(provider)

    async def cap(response: httpx2.Response) -> None:
        if _asked_to_stream(response.request) and response.headers.get("content-type", "").startswith(
                "text/event-stream"):
            return
        refuse_unread(response, MAX_ANSWER_BYTES, too_large, lambda encoding: LLMBadResponse(
            f"{provider}: the server compressed its answer ({encoding}) although none was asked for; unpacked, its "
            "size could pass any cap, so it was not read"))
        if isinstance(response.stream, httpx2.AsyncByteStream):
            response.stream = CappedBody(response.stream, MAX_ANSWER_BYTES, too_large)

    hooks: dict[str, list[Callable[[Any], Any]]] = {"response": [cap]}
    return client_class(event_hooks=hooks, headers=PLAIN)
