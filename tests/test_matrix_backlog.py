"""Messages the bot reads late (a burst, what was said while it was stopped) are stored and answered once each,
in the order they came, against a real Synapse."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.synapse import SynapseServer
from tests.test_matrix import Bot, Timeline, dm_with, send_text, start_bot, stop_bot, user

pytestmark = pytest.mark.slow


async def _stored(bot: Bot, room: str) -> list[tuple[str, str]]:
    """The room's stored messages, oldest first, as (role, text)."""
    channel = await bot.app.storage.get_channel(f"matrix:{room}")
    if channel is None:
        return []
    return [(m.role, m.text) for m in reversed(await bot.app.storage.recent_messages(channel.id, 200))]


async def _until_answered(bot: Bot, room: str, answers: int, deadline: float = 60.0) -> list[tuple[str, str]]:
    """The stored messages once ``answers`` replies are stored (or the deadline passed)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while True:
        stored = await _stored(bot, room)
        if sum(role == "assistant" for role, _ in stored) >= answers or loop.time() > end:
            return stored
        await asyncio.sleep(0.2)


def _said(stored: list[tuple[str, str]]) -> list[str]:
    return [text for role, text in stored if role == "user"]


def _slow_first(bot: Bot, name: str, seconds: float) -> None:
    """The homeserver's first answer to the client's ``name`` request comes ``seconds`` late."""
    client: Any = bot.adapter.client
    original, calls = getattr(client, name), []

    async def slow(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            await asyncio.sleep(seconds)
        return await original(*args, **kwargs)
    setattr(client, name, slow)


async def test_a_burst_is_stored_and_answered_in_the_order_it_came(synapse: SynapseServer, tmp_path: Path) -> None:
    """Each message was handled as a task of its own that asked the homeserver things (the room's creators) before
    it reached its line: when the first answer was slow, the messages after it were stored (and answered) before
    it, and its reply's prompt held later messages as if said before it."""
    bot = await start_bot(synapse, tmp_path)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, bot.user_id)
        _slow_first(bot, "room_get_state", 1.5)
        sent = [f"burst {n}" for n in range(5)]
        for text in sent:
            await send_text(alice, room, text)
        stored = await _until_answered(bot, room, len(sent))
        assert _said(stored) == sent, stored
        assert [text for role, text in stored if role == "assistant"] == [f"echo: {text}" for text in sent], stored
        last = bot.app.llm.requests[-1].messages
        assert [m.content[-len("burst 0"):] for m in last if m.role == "user" and "burst" in m.content] == sent
    finally:
        await alice.close()
        await stop_bot(bot)


async def test_a_slow_command_does_not_hold_up_the_next_message(synapse: SynapseServer, tmp_path: Path) -> None:
    """A command kept its place in the room's line until it had run: one that took 20 s (a model checked, a file
    downloaded) held the next message's answer (anyone's in a group) for as long."""
    bot = await start_bot(synapse, tmp_path)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    commands: Any = bot.app.commands
    original, release = commands.dispatch, asyncio.Event()

    async def slow(line: str, *args: Any, **kwargs: Any) -> Any:
        if "stats" in line:
            await release.wait()
        return await original(line, *args, **kwargs)

    commands.dispatch = slow
    try:
        room = await dm_with(seen, bot.user_id)
        await send_text(alice, room, "!stats")
        await send_text(alice, room, "hello while it runs")
        stored = await _until_answered(bot, room, 1, deadline=20)
        assert _said(stored) == ["hello while it runs"] and ("assistant", "echo: hello while it runs") in stored
    finally:
        release.set()
        await alice.close()
        await stop_bot(bot)


async def _down_then_up(synapse: SynapseServer, tmp_path: Path, said: list[str], *, rate_limited: bool = False
                        ) -> tuple[Bot, Timeline, str]:
    """A DM answered once ("before"), then ``said`` sent while the bot is stopped, then the bot started again."""
    first = await start_bot(synapse, tmp_path)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    room = await dm_with(seen, first.user_id)
    await send_text(alice, room, "before")
    await seen.sync_until(lambda: any("before" in b for b in seen.bodies(room, first.user_id)), "the first answer")
    await stop_bot(first)
    for text in said:
        await send_text(alice, room, text)
    unlimited = {} if rate_limited else {"chat": {"rate_limit_per_minute": 0}}  # (all of them come within a minute)
    return await start_bot(synapse, tmp_path, user_id=first.user_id, sections=unlimited), seen, room


async def test_messages_sent_while_the_bot_was_stopped_are_all_read_in_order(synapse: SynapseServer,
                                                                            tmp_path: Path) -> None:
    """A sync holds a room's last 10 events and says the rest were cut off: of 14 messages sent while the bot was
    stopped, the first 4 were never stored nor answered (only the redactions of that stretch were read back), and
    the other 10 were stored shuffled."""
    said = [f"while down {n:02d}" for n in range(14)]
    bot, seen, room = await _down_then_up(synapse, tmp_path, said)
    try:
        stored = await _until_answered(bot, room, 1 + len(said))
        assert _said(stored) == ["before", *said], repr(stored)
        assert [text for role, text in stored if role == "assistant"][1:] == [f"echo: {text}" for text in said]
        last = bot.app.llm.requests[-1].messages
        assert [m.content[-len(said[0]):] for m in last if m.role == "user" and "while down" in m.content] == said
        await asyncio.sleep(1.0)
        assert _said(await _stored(bot, room)) == ["before", *said]  # (each once)
        assert not bot.adapter.backlogs.saved()  # (nothing left for a restart to go on with)
    finally:
        await seen.client.close()
        await stop_bot(bot)


async def test_past_the_backlog_cap_the_user_is_told_what_was_not_read(
        synapse: SynapseServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the cap on a stretch's messages, the oldest ones are not read: the user of the direct chat is told how
    many, once (they were lost without a word)."""
    import adapters.matrix_gaps as gaps

    monkeypatch.setattr(gaps, "BACKLOG_MESSAGES", 3)
    said = [f"while down {n:02d}" for n in range(15)]  # 10 in the sync, 5 skipped: 3 read back, 2 not
    bot, seen, room = await _down_then_up(synapse, tmp_path, said)
    try:
        stored = await _until_answered(bot, room, 1 + 13)
        assert _said(stored) == ["before", *said[2:]], stored
        await seen.sync_until(lambda: True, "a sync")
        history = await seen.client.room_messages(room, start=seen.client.next_batch, limit=100)
        notes = [e.body for e in history.chunk if e.sender == bot.user_id and "did not read" in getattr(e, "body", "")]
        assert len(notes) == 1 and "2 of your messages" in notes[0] and "last 3" in notes[0], notes
    finally:
        await seen.client.close()
        await stop_bot(bot)


async def test_messages_read_back_are_not_held_to_the_rate_limit(synapse: SynapseServer, tmp_path: Path) -> None:
    """Sent over an evening while the bot was stopped, 20 messages were all counted as they were read back: the
    12 oldest were answered, then "you are sending messages faster than I can answer", and the 8 newest (the
    ones that mattered now) were dropped for good."""
    said = [f"while down {n:02d}" for n in range(20)]
    bot, seen, room = await _down_then_up(synapse, tmp_path, said, rate_limited=True)
    try:
        stored = await _until_answered(bot, room, 1 + len(said))
        assert _said(stored) == ["before", *said], repr(stored)
        assert not any("faster than I can answer" in b for b in seen.bodies(room, bot.user_id))
    finally:
        await seen.client.close()
        await stop_bot(bot)
