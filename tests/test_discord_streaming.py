"""Streamed replies on Discord: the real discord.py in this process against the fake Discord of
``tests/fakes/discord_server.py``, replies from the scripted provider, edits made to fail by the fake."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import discord
import pytest
import pytest_asyncio
import yarl

from adapters.discord import DiscordAdapter
from bot.app import App
from bot.config import parse_config
from tests.fakes.discord_server import FakeDiscord
from tests.fakes.provider import ScriptedProvider

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ANSWER = "Here is the whole answer, word by word, up to its very last word."


@pytest_asyncio.fixture
async def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[FakeDiscord, App]]:
    """A bot whose replies stream as one send and one final edit (the interval is longer than any test)."""
    with FakeDiscord() as fake:
        monkeypatch.setattr(discord.http.Route, "BASE", fake.api_base)
        monkeypatch.setattr(discord.gateway.DiscordWebSocket, "DEFAULT_GATEWAY", yarl.URL(fake.gateway_url))
        config = parse_config({
            "storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"},
            "chat": {"edit_interval_seconds": 60, "still_working_seconds": 0, "typing_indicator": False},
            "cortex": {"context_limit": 1000},
            "discord": {"enabled": True, "sync_commands": False},
        })
        app = App(config, llm=ScriptedProvider())
        await app.start()
        adapter = DiscordAdapter(app, config.discord)
        run = asyncio.create_task(adapter.bot.start("token"))
        try:
            await asyncio.wait_for(adapter.bot.wait_until_ready(), 30)
            yield fake, app
        finally:
            await adapter.close()
            await asyncio.gather(run, return_exceptions=True)
            await app.stop()


def shown(fake: FakeDiscord, channel_id: str) -> list[str]:
    """What the bot's messages in the channel read, each after its last edit, in order."""
    texts = {m.message_id: m.content or "" for m in fake.messages_in(channel_id)}
    for edit in fake.edits:
        if edit.message_id in texts:
            texts[edit.message_id] = edit.content or ""
    return list(texts.values())


@pytest.mark.parametrize("status", [404, 403])
async def test_a_failed_last_edit_still_shows_the_whole_reply(live: tuple[FakeDiscord, App], status: int) -> None:
    """The final edit of a streamed reply fails (the message was deleted meanwhile, the channel closed, Discord
    refused it): the whole reply is still shown, in a new message, and not cut off after its first word."""
    fake, app = live
    app.llm.enqueue(ANSWER)  # type: ignore[attr-defined]  # the ScriptedProvider of the fixture
    fake.fail_edits(status)
    sent = fake.dispatch_message("hello")
    await fake.wait_until_async(lambda f: ANSWER in shown(f, sent.channel_id))
    assert shown(fake, sent.channel_id)[0] == "Here"  # the streamed start stays as it was
    assert not any("⚠️" in text for text in shown(fake, sent.channel_id))
