"""A cap on the body of an HTTP answer, for the clients that talk to servers the operator configured (model servers,
MCP servers): a broken or hostile one could otherwise send more than the process can hold. Each asks for plain
bodies (``Accept-Encoding: identity``) and refuses a compressed one: the cap counts what arrives, and a few
kilobytes of gzip unpack to hundreds of megabytes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import httpx2

PLAIN = {"Accept-Encoding": "identity"}  # a client's headers: bodies as they are, countable as they arrive


def compression(response: httpx2.Response) -> str:
    """The compression of ``response``'s body ("" for none)."""
    encoding = response.headers.get("content-encoding", "").strip().lower()
    return "" if encoding in ("", "identity") else encoding


def refuse_unread(response: httpx2.Response, limit: int, too_large: Callable[[], Exception],
                  compressed: Callable[[str], Exception]) -> None:
    """Before a body is read: ``compressed(encoding)`` raised for a compressed one, ``too_large()`` for one whose
    declared length passes ``limit`` (then it is not read at all)."""
    if encoding := compression(response):
        raise compressed(encoding)
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large()


class CappedBody(httpx2.AsyncByteStream):
    """A response body that fails with ``too_large()`` once more than ``limit`` bytes of it arrived, before it is
    all held; with ``refused``, it fails with that at once (a compressed body: its unpacked size is known only once
    it is held)."""

    def __init__(self, body: httpx2.AsyncByteStream, limit: int, too_large: Callable[[], Exception],
                 refused: Exception | None = None) -> None:
        self._body, self._limit, self._too_large, self._refused = body, limit, too_large, refused

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._refused is not None:
            raise self._refused
        read = 0
        async for chunk in self._body:
            read += len(chunk)
            if read > self._limit:
                raise self._too_large()
            yield chunk

    async def aclose(self) -> None:
        await self._body.aclose()


class CappedSyncBody(httpx2.SyncByteStream):
    """:class:`CappedBody` for a synchronous client's response (the OpenAI-compatible embedder's)."""

    def __init__(self, body: httpx2.SyncByteStream, limit: int, too_large: Callable[[], Exception]) -> None:
        self._body, self._limit, self._too_large = body, limit, too_large

    def __iter__(self) -> Iterator[bytes]:
        read = 0
        for chunk in self._body:
            read += len(chunk)
            if read > self._limit:
                raise self._too_large()
            yield chunk

    def close(self) -> None:
        self._body.close()
