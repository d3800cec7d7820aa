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
