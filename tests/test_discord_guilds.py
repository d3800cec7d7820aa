"""Server channels on the wire: the real discord.py in this process against the fake Discord of
``tests/fakes/discord_server.py`` with one server; replies from the scripted provider."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from bot.app import App
from tests.fakes.discord_server import FakeDiscord
from tests.test_discord_streaming import running_bot

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

GUILD = 123 << 22
CHANNEL, OTHER_CHANNEL = GUILD + 1, GUILD + 2
ANN = 700_000_000_000_000_001


@pytest_asyncio.fixture
async def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[FakeDiscord, App]]:
    """A bot in one server with two text channels, replies not streamed."""
    with FakeDiscord() as fake:
        fake.add_guild(GUILD, channel_ids=(CHANNEL, OTHER_CHANNEL), members=(ANN,))
        async with running_bot(fake, tmp_path, monkeypatch, {"streaming": False}) as app:
            yield fake, app


async def _said(fake: FakeDiscord, app: App, text: str, channel: int) -> None:
    """``text`` said to the bot in ``channel``, once its answer is out."""
    before = len(fake.messages_in(str(channel)))
    fake.dispatch_message(text, author_id=ANN, guild_id=GUILD, channel_id=channel, mentions_bot=True)
    await fake.wait_until_async(lambda f: len(f.messages_in(str(channel))) > before)


async def test_a_message_of_a_server_not_loaded_yet_is_not_taken_for_a_dm(live: tuple[FakeDiscord, App]) -> None:
    """discord.py gives a message of a server it has not loaded (before its GUILD_CREATE, after an outage) no
    guild, and the bot took ``guild is None`` for a DM: it answered unmentioned, and a private command's answer
    (a pinned PIN) went into the server's channel."""
    fake, app = live
    dm = fake.dispatch_message("!memory remember --pin my PIN is 4321", author_id=ANN)
    await fake.wait_until_async(lambda f: f.messages_in(dm.channel_id))
    unknown_guild, unknown_channel = 456 << 22, (456 << 22) + 1
    fake.dispatch_message("!memory list", author_id=ANN, guild_id=unknown_guild, channel_id=unknown_channel)
    fake.dispatch_message("hello there", author_id=ANN, guild_id=unknown_guild, channel_id=unknown_channel)
    await _said(fake, app, "and here?", CHANNEL)  # (handled after the two above)
    assert fake.messages_in(str(unknown_channel)) == []
    channels = [str(r[0]) for r in await app.storage.db.fetch_all("SELECT key FROM channels")]
    assert f"discord:{unknown_channel}" not in channels


async def test_a_deleted_channel_takes_its_messages_summaries_and_items(live: tuple[FakeDiscord, App]) -> None:
    """Deleting a channel deletes every message in it, and Discord says so with CHANNEL_DELETE alone (no
    message deletions): the bot kept all it stored of it, in history, search and its summary."""
    fake, app = live
    said = fake.dispatch_message("my secret plan is X", author_id=ANN, guild_id=GUILD, channel_id=CHANNEL,
                                 mentions_bot=True)
    await fake.wait_until_async(lambda f: len(f.messages_in(str(CHANNEL))) == 1)
    # As "Remember this" on that message does (a 🧠 reaction too):
    fake.dispatch_message(f"!memory remember --from discord-message:{said.message_id} the plan is X", author_id=ANN,
                          guild_id=GUILD, channel_id=CHANNEL)
    await fake.wait_until_async(lambda f: len(f.messages_in(str(CHANNEL))) == 2)
    await _said(fake, app, "the other channel stays", OTHER_CHANNEL)
    channel = await app.storage.get_channel(f"discord:{CHANNEL}")
    assert channel is not None
    stored = await app.storage.messages_between(channel.id, 0, 2**40, 100)
    await app.storage.add_summary(channel.id, "Ann's secret plan is X.", stored[0].id, stored[-1].id, 8, "m")
    assert await app.storage.latest_summary(channel.id) is not None
    fake.dispatch_event("CHANNEL_DELETE", {"id": str(CHANNEL), "type": 0, "guild_id": str(GUILD),
                                           "name": "channel-0", "position": 0, "permission_overwrites": []},
                        guild_id=GUILD)
    await _gone(app, "secret plan")
    assert await app.storage.latest_summary(channel.id) is None
    items = await app.storage.db.fetch_all("SELECT archived_at, archive_reason FROM memory_items")
    assert [(r[0] is not None, r[1]) for r in items] == [(True, "its channel was deleted")]
    assert await app.storage.db.fetch_all("SELECT id FROM messages WHERE text LIKE '%other channel stays%'")


async def test_a_deleted_thread_takes_its_messages(live: tuple[FakeDiscord, App]) -> None:
    """A thread or forum post deleted (THREAD_DELETE, raw: the thread need not be loaded)."""
    fake, app = live
    await _said(fake, app, "a thread's secret", OTHER_CHANNEL)
    fake.dispatch_event("THREAD_DELETE", {"id": str(OTHER_CHANNEL), "guild_id": str(GUILD), "parent_id": str(CHANNEL),
                                          "type": 11}, guild_id=GUILD)
    await _gone(app, "a thread's secret")


async def _gone(app: App, words: str) -> None:
    """Wait until no stored message holds ``words`` (the deletion is handled on the bot's loop)."""
    for _ in range(100):
        if not await app.storage.db.fetch_all("SELECT id FROM messages WHERE text LIKE ?", (f"%{words}%",)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"messages with {words!r} are still stored")


async def test_a_reply_discord_refuses_to_post_is_not_kept_and_is_said_in_one_line(
        live: tuple[FakeDiscord, App], caplog: pytest.LogCaptureFixture) -> None:
    """A channel the bot may read but not write in (403, 50013): nothing reached Discord, yet the whole answer was
    stored as one the person had read (and entered later prompts), with a 29-line traceback in the log."""
    import logging

    fake, app = live
    caplog.set_level(logging.INFO)
    app.llm.enqueue("Here is the whole answer.")  # type: ignore[attr-defined]
    fake.refuse_posts(OTHER_CHANNEL)
    fake.dispatch_message("hello bot", author_id=ANN, guild_id=GUILD, channel_id=OTHER_CHANNEL, mentions_bot=True)

    async def said_so() -> bool:
        return any("could not be shown" in r.getMessage() for r in caplog.records)

    for _ in range(100):
        if await said_so():
            break
        await asyncio.sleep(0.1)
    lines = [r.getMessage() for r in caplog.records if "could not be shown" in r.getMessage()]
    assert lines and "Missing Permissions" in lines[0] and "it is not kept" in lines[0], lines
    assert not any(r.exc_info for r in caplog.records if r.name.startswith(("adapters", "bot")))
    channel = await app.storage.get_channel(f"discord:{OTHER_CHANNEL}")
    assert channel is not None
    stored = [(m.role, m.text) for m in reversed(await app.storage.recent_messages(channel.id, 10))]
    assert stored == [("user", "hello bot")]  # the person's message stays
    await _said(fake, app, "and here?", CHANNEL)  # the bot goes on elsewhere
    # a private answer there, DMs closed too: the note in the channel cannot go either; one line, no traceback
    fake.refuse_posts(ANN + 1, code=50007, message="Cannot send messages to this user")
    fake.dispatch_message("!persona", author_id=ANN, guild_id=GUILD, channel_id=OTHER_CHANNEL)
    for _ in range(100):
        if any("a private answer's note could not be sent" in r.getMessage() for r in caplog.records):
            break
        await asyncio.sleep(0.1)
    assert any("a private answer's note could not be sent" in r.getMessage() for r in caplog.records)
    assert not any(r.exc_info for r in caplog.records if r.name.startswith(("adapters", "bot")))


def _sticker_only(fake: FakeDiscord, channel: int, guild: int | None = None) -> dict[str, Any]:
    """A MESSAGE_CREATE of a sticker without words (the bot mentioned, in a server), as Discord sends one."""
    extra: dict[str, Any] = {"sticker_items": [{"id": "749054660769218631", "name": "Wave", "format_type": 1}]}
    if guild is not None:
        extra |= {"guild_id": str(guild), "mentions": [fake.bot_user], "member": {
            "roles": [], "joined_at": "2024-01-01T00:00:00+00:00", "deaf": False, "mute": False, "flags": 0}}
    return fake._message(str(channel), "", {"id": str(ANN), "username": "ann", "discriminator": "0", "avatar": None},
                         **extra)


async def test_a_hint_discord_refuses_to_post_is_one_line(live: tuple[FakeDiscord, App],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A sticker (or a picture) alone gets a line saying the bot reads text; where Discord refused it (a channel
    the bot may read but not write in, a DM of someone whose DMs are closed to it) the log got a traceback of
    "failed to handle message", as for a fault of the bot's, where a refused reply gets one line."""
    import logging

    fake, app = live
    caplog.set_level(logging.INFO)
    fake.refuse_posts(OTHER_CHANNEL)
    fake.refuse_posts(ANN + 1, code=50007, message="Cannot send messages to this user")
    fake.dispatch_event("MESSAGE_CREATE", _sticker_only(fake, OTHER_CHANNEL, GUILD), guild_id=GUILD)
    fake.dispatch_event("MESSAGE_CREATE", _sticker_only(fake, ANN + 1))

    def refused() -> list[str]:
        return [r.getMessage() for r in caplog.records if "could not be sent in channel" in r.getMessage()]

    for _ in range(100):
        if len(refused()) == 2:
            break
        await asyncio.sleep(0.05)
    assert len(refused()) == 2 and "Missing Permissions" in refused()[0] and "50007" in refused()[1], refused()
    assert not any(r.exc_info for r in caplog.records if r.name.startswith(("adapters", "bot")))
