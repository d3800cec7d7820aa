"""One answer at a time per person and channel (bot.turns): a quick second message is stored at once,
answered after the first answer with that answer in its prompt; other people are answered side by side."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import pytest

from bot import metrics
from bot.app import App
from bot.commands import CommandReply
from bot.config import parse_config
from bot.errors import MessageWithdrawn
from bot.history import HistoryWindow, in_reply_order
from bot.llm.base import Completion, LLMRequest, StreamEvent, Usage
from bot.llm.errors import LLMOverloaded
from bot.policy import Inbound
from bot.ports import IncomingMessage
from bot.storage.base import StoredMessage
from bot.turns import Turns
from tests.engines import db_url_for
from tests.fakes.provider import ScriptedProvider
from tests.test_router import Sink

pytestmark = pytest.mark.both_engines


@dataclass
class GatedProvider(ScriptedProvider):
    """Echoes; a reply whose message is in ``held`` waits for ``release``. ``answered`` lists the messages
    replies were asked for, in the order the model was asked."""

    held: set[str] = field(default_factory=set)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    holding: asyncio.Event = field(default_factory=asyncio.Event)
    asked: list[LLMRequest] = field(default_factory=list)

    async def stream(self, request: LLMRequest) -> AsyncIterator[StreamEvent]:
        self.asked.append(request)
        if str(request.messages[-1].content).split(": ")[-1] in self.held:  # (in a group: "Ann: text")
            self.holding.set()
            await self.release.wait()
        async for event in super().stream(request):
            yield event

    def turns_of(self, n: int) -> list[tuple[str, str]]:
        return [(m.role, str(m.content)) for m in self.asked[n].messages]


def _config(tmp_path: Path) -> object:
    return parse_config({"storage": {"url": db_url_for(tmp_path)}, "personas": [{"name": "Cora"}],
                         "history": {"history_tokens": 4000}})


def _msg(text: str, user: str = "ann", channel: str = "dm-ann", dm: bool = True) -> IncomingMessage:
    return IncomingMessage("console", channel, user, user.title(), text, is_dm=dm, sent_at=datetime.now(UTC))


def _ask(app: App, message: IncomingMessage) -> asyncio.Task[str]:
    """The reply to ``message``, on its way."""
    return asyncio.create_task(app.core.reply(message, "Cora").text())


async def _held(app: App, llm: GatedProvider, message: IncomingMessage) -> asyncio.Task[str]:
    """The reply to ``message``, on its way and held at the model (one of ``llm.held``)."""
    reply = _ask(app, message)
    await asyncio.wait_for(llm.holding.wait(), 10)
    return reply


async def _stored(app: App, channel_key: str) -> list[str]:
    channel = await app.storage.upsert_channel(f"console:{channel_key}", channel_key, True)
    return [m.text for m in reversed(await app.storage.recent_messages(channel.id, 20))]


async def test_a_quick_second_message_is_stored_at_once_and_answered_after_the_first_answer(tmp_path: Path) -> None:
    llm = GatedProvider(held={"hi"})
    async with App(_config(tmp_path), llm=llm) as app:
        first = await _held(app, llm, _msg("hi"))
        second = _ask(app, _msg("are you there?"))
        for _ in range(100):  # stored at once, though not answered yet
            if "are you there?" in await _stored(app, "dm-ann"):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        assert await _stored(app, "dm-ann") == ["hi", "are you there?"]
        assert len(llm.asked) == 1 and not second.done()  # its answer waits for the first one's
        llm.release.set()
        assert await asyncio.wait_for(first, 10) == "echo: hi"
        assert await asyncio.wait_for(second, 10) == "echo: are you there?"
        # The second answer was written knowing the first: the conversation in the order it happened.
        assert llm.turns_of(1) == [("user", "hi"), ("assistant", "echo: hi"), ("user", "are you there?")]
        assert await app.core.reply(_msg("and now?"), "Cora").text() == "echo: and now?"
        assert llm.turns_of(2) == [("user", "hi"), ("assistant", "echo: hi"), ("user", "are you there?"),
                                   ("assistant", "echo: are you there?"), ("user", "and now?")]
        assert app.core.turns.busy() == 0


async def test_other_people_in_a_channel_are_answered_side_by_side(tmp_path: Path) -> None:
    llm = GatedProvider(held={"ann asks"})
    async with App(_config(tmp_path), llm=llm) as app:
        ann = await _held(app, llm, _msg("ann asks", "ann", "room", dm=False))
        bob = await asyncio.wait_for(app.core.reply(_msg("bob asks", "bob", "room", dm=False), "Cora").text(), 10)
        assert bob == "echo: Bob: bob asks" and not ann.done()
        llm.release.set()
        assert await asyncio.wait_for(ann, 10) == "echo: Ann: ann asks"
        # Ann's answer was stored after Bob's exchange; later prompts show it after her message.
        await app.core.reply(_msg("ann again", "ann", "room", dm=False), "Cora").text()
        assert [text.split(": ")[-1] for _, text in llm.turns_of(2)] == [
            "ann asks", "ann asks", "bob asks", "bob asks", "ann again"]
        assert [role for role, _ in llm.turns_of(2)] == ["user", "assistant", "user", "assistant", "user"]


async def test_an_answer_that_hangs_delays_the_next_one_only_so_long(tmp_path: Path) -> None:
    llm = GatedProvider(held={"slow"})
    async with App(_config(tmp_path), llm=llm) as app:
        app.core.turns.wait_seconds = 0.3
        first = await _held(app, llm, _msg("slow"))
        assert await asyncio.wait_for(app.core.reply(_msg("next"), "Cora").text(), 10) == "echo: next"
        assert not first.done()
        llm.release.set()
        assert await asyncio.wait_for(first, 10) == "echo: slow"
        assert app.core.turns.busy() == 0


async def test_a_cancelled_answer_gives_its_turn_up_at_once(tmp_path: Path) -> None:
    llm = GatedProvider(held={"hi"})
    async with App(_config(tmp_path), llm=llm) as app:
        first = await _held(app, llm, _msg("hi"))
        second = _ask(app, _msg("hello?"))
        await asyncio.sleep(0.1)
        first.cancel()
        assert await asyncio.wait_for(second, 5) == "echo: hello?"  # not after the 90 s a hung turn gets
        assert llm.turns_of(1) == [("user", "hi"), ("user", "hello?")]


def _m(id_: int, role: str, reply_to: int | None = None) -> StoredMessage:
    return StoredMessage(id_, 1, 1, "Cora", role, "x", f"m{id_}", 1, id_, datetime.now(UTC), reply_to)  # type: ignore[arg-type]


def test_answers_follow_their_message_and_others_keep_their_place() -> None:
    messages = [_m(1, "user"), _m(2, "user"), _m(3, "assistant", 1), _m(4, "assistant", 2), _m(5, "assistant", 99),
                _m(6, "user"), _m(7, "assistant"), _m(8, "assistant", 1)]
    assert [m.id for m in in_reply_order(messages)] == [1, 3, 8, 2, 4, 5, 6, 7]
    assert in_reply_order(messages[:2]) == messages[:2] and in_reply_order([]) == []
    # The window begins after a message whose answer was stored later: that answer opens the window, and the
    # window's oldest message (where the summary's material ends) is still the lowest id in it.
    assert [m.id for m in in_reply_order(messages[1:])] == [3, 8, 2, 4, 5, 6, 7]
    assert HistoryWindow(in_reply_order(messages[1:])).oldest_id == 2


async def test_turns_are_dropped_once_nobody_is_in_line() -> None:
    turns = Turns(wait_seconds=5)
    first, other = turns.join("a"), turns.join("b")
    await first.wait()
    await other.wait()
    assert not first.waited and not other.waited and turns.busy() == 2
    first.leave()
    first.leave()  # (twice: nothing more happens)
    other.leave()
    assert turns.busy() == 0


async def test_one_who_joins_as_the_turn_passes_on_still_waits_at_most_so_long() -> None:
    """The lock looks free between one answer's end and the next one's wake-up: a third answer joining then
    must know it waits (for late answers, and for the bound on its wait)."""
    turns = Turns(wait_seconds=0.3)
    a = turns.join("k")
    await a.wait()
    b = turns.join("k")
    b_waits = asyncio.create_task(b.wait())
    await asyncio.sleep(0)
    a.leave()  # b is woken, not yet running
    c = turns.join("k")
    assert b.waited and c.waited
    await b_waits  # b holds the turn and hangs
    await asyncio.wait_for(c.wait(), 2)  # c goes ahead after 0.3 s, not never
    assert 0.25 < c.waited_seconds < 1.5
    b.leave()
    c.leave()
    assert turns.busy() == 0


async def test_turns_come_in_the_order_the_messages_joined() -> None:
    """The first message's store took longer than the second's: the second must not take the turn first."""
    turns = Turns(wait_seconds=5)
    first, second = turns.join("k"), turns.join("k")
    second_waits = asyncio.create_task(second.wait())
    await asyncio.sleep(0.05)
    assert not second_waits.done()  # the first one's turn, though it has not asked yet
    await first.wait()
    first.leave()
    await asyncio.wait_for(second_waits, 1)
    second.leave()
    third = turns.join("k")  # a place given up before its turn (its message failed) passes the turn on
    fourth = turns.join("k")
    third.leave()
    await asyncio.wait_for(fourth.wait(), 1)
    fourth.leave()
    assert turns.busy() == 0


async def test_after_a_hung_answer_the_rest_of_the_line_still_goes_one_by_one(tmp_path: Path) -> None:
    """Once the hung answer's time is up, the next one goes ahead, and the ones after it wait for it: not all
    of them at once, side by side."""
    llm = GatedProvider(held={"m1"})
    async with App(_config(tmp_path), llm=llm) as app:
        app.core.turns.wait_seconds = 0.3
        hung = await _held(app, llm, _msg("m1"))
        rest = []
        for text in ("m2", "m3", "m4"):
            rest.append(_ask(app, _msg(text)))
            await asyncio.sleep(0.02)
        assert await asyncio.wait_for(asyncio.gather(*rest), 10) == ["echo: m2", "echo: m3", "echo: m4"]
        prompts = {str(r.messages[-1].content): [str(m.content) for m in r.messages] for r in llm.asked}
        assert "echo: m2" in prompts["m3"] and "echo: m3" in prompts["m4"], prompts
        llm.release.set()
        await asyncio.wait_for(hung, 10)


async def test_a_message_whose_store_is_slow_is_still_stored_and_answered_first(tmp_path: Path) -> None:
    """Two quick messages; the first one's store takes longer: it is stored first all the same, answered
    first, and the second answer knows the first exchange."""
    llm = GatedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        add_message = app.storage.add_message

        async def slow_first(*args: object, **kwargs: object) -> object:
            if args[5] == "first":
                await asyncio.sleep(0.3)
            return await add_message(*args, **kwargs)  # type: ignore[arg-type]

        app.storage.add_message = slow_first  # type: ignore[method-assign, assignment]
        first = _ask(app, _msg("first"))
        await asyncio.sleep(0.05)
        second = _ask(app, _msg("second"))
        assert await asyncio.wait_for(asyncio.gather(first, second), 10) == ["echo: first", "echo: second"]
        assert await _stored(app, "dm-ann") == ["first", "second", "echo: first", "echo: second"] \
            or await _stored(app, "dm-ann") == ["first", "echo: first", "second", "echo: second"]
        assert llm.turns_of(1) == [("user", "first"), ("assistant", "echo: first"), ("user", "second")]


async def test_one_who_gave_up_its_place_passes_on_the_wait_not_the_turn() -> None:
    """The second message failed before its turn (deleted before it was stored): the third still waits for
    the first answer, which is being written, instead of going at once beside it."""
    turns = Turns(wait_seconds=5)
    first = turns.join("k")
    await first.before_store()
    first.stored()
    await first.wait()
    second, third = turns.join("k"), turns.join("k")
    second.leave()
    await asyncio.wait_for(third.before_store(), 1)  # (the first one is stored: nothing to wait for)
    third.stored()
    third_waits = asyncio.create_task(third.wait())
    await asyncio.sleep(0.05)
    assert not third_waits.done()
    first.leave()
    await asyncio.wait_for(third_waits, 1)
    third.leave()
    assert turns.busy() == 0
    # The last one in line gives up its place: the line goes on with the one ahead, still being answered.
    answering = turns.join("k")
    await answering.wait()
    turns.join("k").leave()
    assert turns.join("k").waited


async def test_an_answer_stored_while_the_next_message_is_stored_is_in_its_prompt(tmp_path: Path) -> None:
    """The first answer ended between the second message's store and its turn: it is stored after that
    message, and must reach its prompt all the same."""
    llm = GatedProvider(held={"hi"})
    async with App(_config(tmp_path), llm=llm) as app:
        first = await _held(app, llm, _msg("hi"))
        link, linking, go_on = app.storage.sources.link, asyncio.Event(), asyncio.Event()

        async def slow_link(*args: object, **kwargs: object) -> None:
            linking.set()
            await go_on.wait()
            await link(*args, **kwargs)  # type: ignore[arg-type]

        app.storage.sources.link = slow_link  # type: ignore[method-assign]
        message = replace(_msg("and?"), message_key="console-message:2")
        second = _ask(app, message)
        await asyncio.wait_for(linking.wait(), 10)
        llm.release.set()
        assert await asyncio.wait_for(first, 10) == "echo: hi"
        go_on.set()
        assert await asyncio.wait_for(second, 10) == "echo: and?"
        assert llm.turns_of(1) == [("user", "hi"), ("assistant", "echo: hi"), ("user", "and?")]


async def test_a_message_deleted_or_forgotten_while_it_waits_never_reaches_the_model(tmp_path: Path) -> None:
    llm = GatedProvider(held={"hi"})
    async with App(_config(tmp_path), llm=llm) as app:
        first = await _held(app, llm, _msg("hi"))
        message = replace(_msg("oops, my password is hunter2"), message_key="console-message:9")
        deleted = _ask(app, message)
        await asyncio.sleep(0.2)
        assert await app.core.withdraw("console-message:9", message.author_key)
        forgotten = _ask(app, _msg("my secret"))
        await asyncio.sleep(0.2)
        assert await app.storage.forget_user("console:ann") is not None
        llm.release.set()
        await asyncio.wait_for(first, 10)
        for waiting in (deleted, forgotten):
            with pytest.raises(MessageWithdrawn):
                await asyncio.wait_for(waiting, 10)
        assert len(llm.asked) == 1 and "hunter2" not in str(llm.asked) and "my secret" not in str(llm.asked)


async def test_the_reply_overhead_leaves_the_wait_for_the_turn_out(tmp_path: Path, monkeypatch) -> None:
    overheads: list[float] = []
    monkeypatch.setattr(metrics, "observe_reply", lambda stats, overhead: overheads.append(overhead))
    llm = GatedProvider(held={"hi"})
    async with App(_config(tmp_path), llm=llm) as app:
        first = await _held(app, llm, _msg("hi"))
        second = _ask(app, _msg("and?"))
        await asyncio.sleep(1.0)
        llm.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert len(overheads) == 2 and max(overheads) < 0.8, overheads


async def test_the_next_answer_is_shown_after_the_whole_answer_before_it(tmp_path: Path) -> None:
    """A long answer is shown in several messages; the next one (and its "still working" line) comes after
    all of them, never between."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "personas": [{"name": "Cora"}],
                           "chat": {"still_working_seconds": 0.1, "edit_interval_seconds": 0.2}})
    llm = GatedProvider(held={"tell me a story"})
    llm.enqueue(" ".join(f"word{i}" for i in range(200)))
    async with App(config, llm=llm) as app:
        sink = Sink()
        sink.limit = 300
        dm = partial(Inbound, is_admin=False)
        first = asyncio.create_task(app.router.handle(dm(_msg("tell me a story")), sink))
        await asyncio.wait_for(llm.holding.wait(), 10)
        second = asyncio.create_task(app.router.handle(dm(_msg("and then?")), sink))
        await asyncio.sleep(0.5)
        llm.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert sink.messages[-1] == "echo: and then?", sink.messages
    story = " ".join(sink.messages[:-1]).split()
    assert story == [f"word{i}" for i in range(200)] and len(sink.messages) > 3, sink.messages


async def test_summaries_read_each_answer_after_its_message(tmp_path: Path) -> None:
    """Ann's answers were stored after Bob's exchanges (answered side by side): the summary job reads them in
    the order the conversation had, not in the order they were stored."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "personas": [{"name": "Cora"}],
                           "history": {"history_tokens": 200, "summary_trigger": 10, "summary_batch": 2},
                           "jobs": {"poll_seconds": 0.05}})
    llm = ScriptedProvider()
    llm.default = lambda r: Completion("A summary." if "rolling summary" in r.system else "ok", usage=Usage(0, 1))
    async with App(config, llm=llm) as app:
        channel = await app.storage.upsert_channel("console:room", "room", False)
        ann, bob = [await app.storage.upsert_user(f"console:{n}", n.title()) for n in ("ann", "bob")]
        for i in range(12):
            asked_ann = await app.storage.add_message(channel.id, ann.id, "Cora", "user", "Ann", f"ann asks {i}", 4)
            asked_bob = await app.storage.add_message(channel.id, bob.id, "Cora", "user", "Bob", f"bob asks {i}", 4)
            for who, asked in ((bob, asked_bob), (ann, asked_ann)):
                await app.storage.add_message(channel.id, who.id, "Cora", "assistant", "Cora",
                                              f"answer to {who.display_name} {i}", 4, reply_to=asked.id)
        await app.core.reply(_msg("one more", "ann", "room", dm=False), "Cora").text()
        assert await app.workers.drain(10)
        summary = next(r for r in llm.requests if "rolling summary" in r.system)
        text = str(summary.messages[-1].content)
        assert text.index("ann asks 0") < text.index("answer to Ann 0") < text.index("bob asks 0") \
            < text.index("answer to Bob 0") < text.index("ann asks 1")


async def test_a_failed_answer_says_so_before_the_next_answer_begins(tmp_path: Path) -> None:
    class Ordered(Sink):
        def __init__(self) -> None:
            super().__init__()
            self.order: list[str] = []

        async def send(self, text: str) -> int:
            self.order.append(f"message {len(self.messages)}")
            return await super().send(text)

        async def send_reply(self, reply: CommandReply) -> None:
            await asyncio.sleep(0.3)  # (a platform that takes its time)
            self.order.append(reply.text)
            await super().send_reply(reply)

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "personas": [{"name": "Cora"}],
                           "chat": {"still_working_seconds": 0}})
    llm = GatedProvider(held={"hi"})
    llm.enqueue(LLMOverloaded("busy"))
    async with App(config, llm=llm) as app:
        sink = Ordered()
        first = asyncio.create_task(app.router.handle(Inbound(_msg("hi")), sink))
        await asyncio.wait_for(llm.holding.wait(), 10)
        second = asyncio.create_task(app.router.handle(Inbound(_msg("and?")), sink))
        await asyncio.sleep(0.2)
        llm.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert len(sink.order) == 2 and sink.order[0].startswith("⚠️") and sink.order[1] == "message 0", sink.order
    assert sink.messages == ["echo: and?"]


async def test_a_stretch_message_that_waits_past_the_stretchs_end_says_why_it_is_not_answered(tmp_path: Path) -> None:
    """A message sent during `!memory pause` waits for the answer before it; `!memory resume` comes meanwhile and
    the stretch's messages go with it, the waiting one too. It went unanswered without a word; it says why now,
    and its words never reach the model."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "personas": [{"name": "Cora"}],
                           "chat": {"still_working_seconds": 0}})
    llm = GatedProvider(held={"hi"})
    async with App(config, llm=llm) as app:
        sink = Sink()
        await app.router.handle(Inbound(_msg("!memory pause")), sink)
        first = asyncio.create_task(app.router.handle(Inbound(_msg("hi")), sink))
        await asyncio.wait_for(llm.holding.wait(), 10)
        second = asyncio.create_task(app.router.handle(Inbound(_msg("my secret plan")), sink))
        await asyncio.sleep(0.3)
        await app.router.handle(Inbound(_msg("!memory resume")), sink)
        llm.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert await _stored(app, "dm-ann") == []
    assert len(llm.asked) == 1 and "my secret plan" not in str(llm.asked)
    assert "incognito stretch" in sink.public[-1].text and "not answered" in sink.public[-1].text.lower(), sink.public


async def test_a_cancel_that_comes_as_the_wait_ends_is_kept() -> None:
    """A reply cancelled (its chat stopped it) just as the answer ahead was done: Python 3.11's ``wait_for`` returned
    as if nothing happened, and the cancelled reply went on to the model."""
    from bot.turns import _at_most

    done = asyncio.Event()
    waiting = asyncio.create_task(_at_most(done.wait(), 10))
    await asyncio.sleep(0.01)
    done.set()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
