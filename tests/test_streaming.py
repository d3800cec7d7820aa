from __future__ import annotations

import pytest

from bot.ratelimit import RateLimiter
from bot.streaming import CannotPost, RateLimited, StreamedReply


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RecordingSink:
    def __init__(self, limit: int = 2000, fail_first_edits: int = 0) -> None:
        self.limit = limit
        self.messages: list[str] = []
        self.calls: list[tuple[str, int, str]] = []
        self.fail = fail_first_edits

    async def send(self, text: str) -> int:
        self.messages.append(text)
        self.calls.append(("send", len(self.messages) - 1, text))
        return len(self.messages) - 1

    async def edit(self, handle: int, text: str) -> None:
        if self.fail:
            self.fail -= 1
            raise RateLimited(0.25)
        self.messages[handle] = text
        self.calls.append(("edit", handle, text))


async def test_edits_are_throttled_and_the_final_edit_shows_everything() -> None:
    clock, sink = Clock(), RecordingSink()
    reply = StreamedReply(sink, interval=1.0, clock=clock)
    for i in range(20):
        await reply.feed(f"word{i} ")
        clock.now += 0.2  # 5 deltas per second
    await reply.finish()
    assert sink.messages == ["".join(f"word{i} " for i in range(20)).strip()]
    edits = [c for c in sink.calls if c[0] == "edit"]
    assert 3 <= len(edits) <= 5  # about one per second over 4 seconds, plus the final one
    assert sink.calls[0][0] == "send" and sink.calls[0][2] == "word0"


def refused_reply() -> tuple[Clock, StreamedReply, list[str]]:
    """A reply to a platform that refuses every new message (403 Missing Permissions), and the texts it tried."""
    clock, sink = Clock(), RecordingSink()
    tries: list[str] = []

    async def refuse(text: str) -> int:
        tries.append(text)
        raise CannotPost("403 Forbidden (error code: 50013): Missing Permissions")

    sink.send = refuse  # type: ignore[method-assign]
    return clock, StreamedReply(sink, interval=0.0, clock=clock), tries


async def test_a_message_the_platform_refuses_for_good_is_asked_for_once() -> None:
    """No right to send here: every later piece of text, status line and the final edit sent the refused first
    message again (the platform counts each refusal against the bot); now ``finish`` says the refusal instead."""
    clock, reply, tries = refused_reply()
    for i in range(10):
        await reply.feed(f"word{i} ")
        clock.now += 1.0
    await reply.status("looking that up…")
    await reply._placeholder("still working…")
    with pytest.raises(CannotPost, match="Missing Permissions"):
        await reply.finish()
    assert tries == ["word0"] and reply.sent == []


async def test_a_status_line_the_platform_refuses_as_the_first_message_lets_the_tool_run() -> None:
    """A tool called before any text: its status line is the reply's first message, and its refusal came out of
    ``status`` (the tool call failed, the reply ended as a bug with a traceback and a second refused message)."""
    _, reply, tries = refused_reply()
    await reply.status("looking that up…")
    await reply.status("looking that up again…")
    await reply.feed("the answer")
    with pytest.raises(CannotPost, match="Missing Permissions"):
        await reply.finish()
    assert tries == ["_looking that up…_"] and reply.sent == []


async def test_long_replies_continue_in_new_messages_without_breaking_code() -> None:
    clock, sink = Clock(), RecordingSink(limit=200)
    reply = StreamedReply(sink, interval=0.0, clock=clock)
    text = "Intro.\n\n```python\n" + "\n".join(f"x = {i}  # value" for i in range(40)) + "\n```\nBye."
    for i in range(0, len(text), 7):
        await reply.feed(text[i:i + 7])
        clock.now += 0.1
    handles = await reply.finish()
    assert len(handles) == len(sink.messages) > 2
    assert all(len(m) <= 200 for m in sink.messages)
    assert all(sum(line.startswith("```") for line in m.split("\n")) % 2 == 0 for m in sink.messages)
    assert sink.messages[-1].endswith("Bye.")


def _sleeping_reply(sink: RecordingSink, clock: Clock) -> tuple[StreamedReply, list[float]]:
    """A reply whose waits are recorded instead of slept."""
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    return StreamedReply(sink, interval=1.0, clock=clock, sleep=fake_sleep), slept


async def test_rate_limited_edits_back_off_and_retry() -> None:
    clock, sink = Clock(), RecordingSink(fail_first_edits=2)
    reply, slept = _sleeping_reply(sink, clock)
    await reply.feed("hello")
    clock.now += 2
    await reply.feed(" world")
    await reply.finish()
    assert sink.messages == ["hello world"]
    assert slept == [0.25, 0.25] and reply.interval == 4.0


async def test_a_platform_that_keeps_refusing_does_not_hold_the_reply_forever() -> None:
    """An attacker's finding: under a Cloudflare ban (or 429s past discord.py's own retries) every edit was tried
    again once a second, without end: the reply never finished and its requests kept the ban going. After
    ``RATE_LIMIT_TRIES`` refusals an edit fails like any other: the final edit's failure sends the rest as a new
    message, and when that is refused as often, the failure reaches the adapter."""
    from bot.streaming import RATE_LIMIT_TRIES

    clock, sink = Clock(), RecordingSink(fail_first_edits=10**6)
    reply, slept = _sleeping_reply(sink, clock)
    await reply.feed("hello")
    clock.now += 2
    await reply.feed(" world")  # (refused on the way: logged, the reply goes on)
    assert len(slept) == RATE_LIMIT_TRIES - 1 and sink.messages == ["hello"]
    await reply.finish()  # the final edit is refused too: the rest goes in a new message
    assert sink.messages == ["hello", "hello world"] and len(slept) == 2 * (RATE_LIMIT_TRIES - 1)

    async def refused(text: str) -> int:
        raise RateLimited(0.25)

    sink.send = refused  # type: ignore[method-assign]  (sends refused as well)
    reply, _ = _sleeping_reply(sink, clock)
    with pytest.raises(RateLimited):
        await reply.finish("the model is unavailable")


async def test_a_failed_edit_on_the_way_does_not_end_the_reply() -> None:
    """An edit while the text streams in fails (not a rate limit: the platform refused it): the reply goes on, and
    the next edit shows everything."""
    clock, sink = Clock(), RecordingSink()
    refused = [ConnectionError("the platform refused the edit")]
    edit = RecordingSink.edit

    async def failing_edit(self: RecordingSink, handle: int, text: str) -> None:
        if refused:
            raise refused.pop()
        await edit(self, handle, text)

    sink.edit = failing_edit.__get__(sink)  # type: ignore[method-assign]
    reply = StreamedReply(sink, interval=1.0, clock=clock)
    for word in ("one", " two", " three"):
        await reply.feed(word)
        clock.now += 1.5
    await reply.finish()
    assert sink.messages == ["one two three"] and not refused


async def test_a_failed_last_edit_sends_the_rest_anew() -> None:
    """The final edit fails: the whole last piece goes in a new message, so no tail is lost."""
    clock, sink = Clock(), RecordingSink(limit=100)
    reply = StreamedReply(sink, interval=1.0, clock=clock)
    await reply.feed("First words")
    text = "First words and then " + "more words " * 20 + "to the end."
    await reply.feed(text.removeprefix("First words"))

    async def refused(handle: int, text: str) -> None:
        raise ConnectionError("the platform refused the edit")

    sink.edit = refused  # type: ignore[method-assign]
    await reply.finish()
    assert sink.messages[0] == "First words" and " ".join(sink.messages[1:]).split() == text.split()


async def test_an_edit_held_back_by_the_platforms_library_widens_the_interval() -> None:
    """discord.py sleeps through a 429 itself and retries, so the adapter never sees the limit: the edit
    just takes that long. The reply then edits less often instead of running into the limit again."""
    clock, sink = Clock(), RecordingSink()
    held = RecordingSink.edit

    async def slow_edit(self: RecordingSink, handle: int, text: str) -> None:
        clock.now += 3.0 if len(self.calls) == 1 else 0.1  # the first edit waited out a 3 s limit
        await held(self, handle, text)

    sink.edit = slow_edit.__get__(sink)  # type: ignore[method-assign]
    reply = StreamedReply(sink, interval=1.0, clock=clock)
    await reply.feed("hello")
    clock.now += 1.5
    await reply.feed(" there")
    assert reply.interval == 6.0
    clock.now += 0.5
    for word in (" and", " more", " words"):  # within the wider interval: no edit
        await reply.feed(word)
        clock.now += 1.0
    assert [c[0] for c in sink.calls] == ["send", "edit"]
    await reply.finish()
    assert sink.messages == ["hello there and more words"]
    assert reply.interval == 6.0  # a quick edit does not narrow it again within this reply


async def test_non_streaming_sends_once_at_the_end() -> None:
    sink = RecordingSink()
    reply = StreamedReply(sink, streaming=False)
    for word in "one two three".split():
        await reply.feed(word + " ")
    assert sink.calls == []
    await reply.finish()
    assert sink.calls == [("send", 0, "one two three")]


def test_rate_limiter_sliding_window() -> None:
    clock = Clock()
    limiter = RateLimiter(3, clock=clock)
    assert [limiter.check("ann") for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = limiter.check("ann")
    assert wait == pytest.approx(60.0)
    assert limiter.check("bob") == 0.0
    clock.now = 59.0
    assert limiter.check("ann") == pytest.approx(1.0)
    clock.now = 60.5
    assert limiter.check("ann") == 0.0
    assert RateLimiter(0).check("x") == 0.0


async def test_a_tool_status_shows_under_the_text_and_the_next_text_replaces_it() -> None:
    sink = _StatusSink()
    shown = StreamedReply(sink, interval=0.0)
    await shown.feed("Let me check.")
    await shown.status("looking that up…")
    assert sink.messages == ["Let me check.\n\n_looking that up…_"]
    await shown.feed(" It is noon.")
    await shown.finish()
    assert sink.messages == ["Let me check. It is noon."]
    quiet = _StatusSink()
    await StreamedReply(quiet, streaming=False).status("looking that up…")
    assert quiet.messages == []  # with streaming off nothing is sent before the reply


async def test_a_tool_status_under_an_open_code_block_shows_below_the_block_not_inside_it() -> None:
    sink = _StatusSink()
    shown = StreamedReply(sink, interval=0.0)
    await shown.feed("Try this:\n```python\nprint('hi')\n")
    await shown.status("running it…")
    assert sink.messages == ["Try this:\n```python\nprint('hi')\n```\n\n_running it…_"]
    await shown.feed("```\nDone.")
    await shown.finish()
    assert sink.messages == ["Try this:\n```python\nprint('hi')\n```\nDone."]  # the final text as written
    closed = _StatusSink()
    done = StreamedReply(closed, interval=0.0)
    await done.feed("~~~\nx\n~~~\nThen:")  # a closed block is left as it is
    await done.status("checking…")
    assert closed.messages == ["~~~\nx\n~~~\nThen:\n\n_checking…_"]


class _StatusSink:
    limit = 2000

    def __init__(self) -> None:
        self.messages: list[str] = []

    async def send(self, text: str) -> int:
        self.messages.append(text)
        return len(self.messages) - 1

    async def edit(self, handle: int, text: str) -> None:
        self.messages[handle] = text


def test_rate_limiter_forgets_idle_users_and_keeps_limiting_busy_ones_among_many() -> None:
    clock = Clock()
    limiter = RateLimiter(2, clock=clock)
    for number in range(30_000):  # a large bot's minute: each user sends once
        assert limiter.check(f"user{number}") == 0.0
    clock.now = 30.0
    assert limiter.check("user5") == 0.0
    assert limiter.check("user5") == pytest.approx(30.0)  # two in the window: the third waits
    clock.now = 60.5  # every other user's one send left the window
    assert limiter.check("ann") == 0.0
    assert set(limiter._seen) == {"user5", "ann"}  # the idle ones were dropped, at this one check
    assert limiter.check("user5") == 0.0  # its first send left the window; its second still counts
    assert limiter.check("user5") == pytest.approx(30.0 - 0.5)


def test_rate_limiter_tells_each_user_once_per_wait_and_forgets_those_whose_wait_ended() -> None:
    clock = Clock()
    limiter = RateLimiter(1, clock=clock)
    assert limiter.tell("ann", 10.0) and not limiter.tell("ann", 10.0)
    assert limiter.tell("bob", 60.0)
    clock.now = 10.0
    assert limiter.tell("ann", 5.0)  # her wait ended: told again
    clock.now = 61.0
    assert limiter.tell("cy", 1.0)
    assert set(limiter._told) == {"cy"}  # ann's and bob's waits ended: forgotten
