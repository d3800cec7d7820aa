"""Showing a streamed reply on a platform: one message edited in place, throttled, split at the limit.

The adapter supplies a :class:`MessageSink` (send a message, edit one). :class:`StreamedReply` sends
the first text as soon as it arrives, then edits that message at most once per ``interval`` seconds
while text streams in, and makes one final edit when the stream ends. When the text outgrows the
platform's limit, the current message is finished at a good boundary (see ``bot.splitting``) and
the rest continues in a new message. A sink that is rate-limited raises :class:`RateLimited`; the
reply then waits as asked (30 s at most) and doubles its interval (Discord counts edits against message
limits), and after ``RATE_LIMIT_TRIES`` refusals in a row that send or edit fails as any other does.
A library that waits out the limit itself (discord.py sleeps through a 429 and retries) shows as an
edit slower than the interval: the interval then grows to that edit's time, doubled. Any other failure of an
edit while the text streams in is logged and the reply goes on (the next edit shows it all); when the final
edit fails, the rest of the reply is sent as a new message, so its end is never lost. A message the platform
says is gone (:class:`MessageGone`: a moderator deleted it while it was written) is not sent again: nothing
more of the reply is shown, and the reply is marked ``gone`` (the router then deletes its stored copy).
A new message the platform refuses for good (:class:`CannotPost`: no right to send in the channel) is not tried
again for the reply: its later text, status lines and final edit send nothing, and :meth:`StreamedReply.finish`
raises that refusal (the router then keeps nothing of a reply nobody saw).
With ``streaming`` off, nothing is sent until the reply is complete.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bot.splitting import closing_fence, split_message
from bot.text import error_line

log = logging.getLogger(__name__)

MAX_INTERVAL = 30.0  # seconds between edits at most, however rate-limited
SLOW_EDIT = 1.0  # seconds: a send or edit that took longer (and longer than the interval) was held back
# A send or edit rate-limited this often in a row gives up (raises RateLimited): a platform that keeps refusing
# (a Cloudflare ban, a limit past the library's own retries) must not hold a reply, asking once a second, forever.
RATE_LIMIT_TRIES = 5


class RateLimited(Exception):
    def __init__(self, retry_after: float) -> None:
        super().__init__(f"rate-limited, retry after {retry_after:.2f} s")
        self.retry_after = retry_after


class MessageGone(Exception):
    """The message to edit was deleted on the platform (a moderator took the reply back as it was written)."""


class CannotPost(Exception):
    """The platform refuses the bot new messages here (no right to send in the channel): trying again is refused
    the same way, and the platform counts every refused request against the bot (Discord bans an address that
    makes too many)."""


class MessageSink(Protocol):
    limit: int

    async def send(self, text: str) -> Any:
        """Send a new message; returns a handle for :meth:`edit`."""

    async def edit(self, handle: Any, text: str) -> None: ...


@dataclass
class StreamedReply:
    sink: MessageSink
    interval: float = 1.0
    streaming: bool = True
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    _text: str = ""
    _done_chunks: int = 0  # pieces finished and sent for good
    _handle: Any = None
    _shown: str = ""  # what the current message shows
    _last_edit: float = field(default=float("-inf"))
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one send or edit at a time
    sent: list[Any] = field(default_factory=list)  # handles of every message, in order
    gone: bool = False  # a message of it was deleted on the platform: nothing more is shown
    refused: CannotPost | None = None  # the platform refused a new message of it: no new one is tried again

    @property
    def text(self) -> str:
        return self._text

    async def feed(self, delta: str) -> None:
        self._text += delta
        if self.streaming and self.refused is None and self.clock() - self._last_edit >= self.interval:
            async with self._lock:
                try:
                    await self._show(final=False)
                except CannotPost as exc:  # (finish says it: the reply is not shown)
                    log.info("the platform refused a message of a reply (%s); no more of it is sent", error_line(exc))
                except Exception as exc:  # the platform refused an edit: the next one (or the final one) shows all
                    what = "an edit of a streamed reply" if self._handle is not None else "the first message of a reply"
                    log.warning("%s failed (%s); the reply goes on", what, error_line(exc))
                    self._last_edit = self.clock()

    async def finish(self, fallback: str = "") -> list[Any]:
        """Show the whole reply (final edit, and any overflow messages); returns the message handles.
        With no reply text at all, ``fallback`` (an error line) is shown instead, in place of a placeholder."""
        async with self._lock:
            try:
                await self._end(fallback)
            except Exception as exc:
                if self._handle is None:  # a new message failed: there is nothing shown to continue from
                    raise
                log.warning("the last edit of a reply failed (%s); the rest goes in a new message", error_line(exc))
                self._handle, self._shown = None, ""
                await self._end(fallback)
        return self.sent

    async def _end(self, fallback: str) -> None:
        if not self._text and fallback:
            await self._put(fallback)
        else:
            await self._show(final=True)

    async def status(self, line: str) -> None:
        """Show ``line`` under the text so far while a tool runs ("looking that up…"); the next text
        (or the final edit) replaces it. Not part of the reply's text; nothing with streaming off."""
        if not self.streaming or self.refused is not None:
            return
        async with self._lock:
            pieces = split_message(self._text, self.sink.limit)
            current = pieces[-1] if pieces and self._done_chunks == len(pieces) - 1 else ""
            if fence := closing_fence(current):  # under the code block, not inside it
                current = current.rstrip("\n") + "\n" + fence
            shown = f"{current}\n\n_{line}_" if current else f"_{line}_"
            if len(shown) <= self.sink.limit:
                try:
                    await self._put(shown)
                except CannotPost as exc:  # (the tool still runs; finish says the reply could not be shown)
                    log.info("the platform refused a message of a reply (%s); no more of it is sent",
                             error_line(exc))

    async def placeholder_after(self, delay: float, text: str) -> None:
        """After ``delay`` seconds without any reply text, show ``text`` ("still working…"); the reply
        then replaces it. Run as a task and cancel it when the reply is done."""
        await self.sleep(delay)
        await asyncio.shield(self._placeholder(text))  # a cancel must not cut a send in half

    async def _placeholder(self, text: str) -> None:
        async with self._lock:
            if not self.sent and not self._text and self.refused is None:
                await self._put(text)

    async def _show(self, *, final: bool) -> None:
        pieces = split_message(self._text, self.sink.limit)
        if not pieces:
            return
        # Pieces before the last are complete: finish the current message with one, open new ones.
        while self._done_chunks < len(pieces) - 1:
            await self._put(pieces[self._done_chunks])
            self._done_chunks += 1
            self._handle, self._shown = None, ""
        current = pieces[-1]
        if final or current != self._shown:
            await self._put(current)

    async def _put(self, text: str) -> None:
        if self.gone or (text == self._shown and self._handle is not None):
            return
        if self.refused is not None and self._handle is None:  # said once to the platform is enough
            raise self.refused
        for tries in range(1, RATE_LIMIT_TRIES + 1):
            started = self.clock()
            try:
                if self._handle is None:
                    self._handle = await self.sink.send(text)
                    self.sent.append(self._handle)
                else:
                    await self.sink.edit(self._handle, text)
                break
            except CannotPost as exc:
                self.refused = exc
                raise
            except MessageGone:
                log.info("a reply's message was deleted on the platform while it was written; the rest is not shown")
                self.gone = True
                return
            except RateLimited as limited:
                self.interval = min(self.interval * 2, MAX_INTERVAL)
                if tries == RATE_LIMIT_TRIES:
                    raise
                await self.sleep(min(limited.retry_after, MAX_INTERVAL))
        took = self.clock() - started
        if took > max(self.interval, SLOW_EDIT):  # waited out a limit inside the platform's library
            self.interval = min(max(self.interval, took) * 2, MAX_INTERVAL)
        self._shown = text
        self._last_edit = self.clock()
