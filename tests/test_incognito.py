"""Incognito: the bot answers, but nothing from the stretch reaches summaries, cortex updates, tiers or
embeddings, replies carry a marker, and the stretch's messages are deleted when it ends (by command or
after incognito_hours) — on SQLite without a trace in the file."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import pytest

from bot.app import App
from bot.config import parse_config
from bot.llm.base import Completion, LLMRequest, Usage
from bot.policy import Inbound
from bot.ports import IncomingMessage
from bot.storage import Storage
from cortex.memory.upkeep import end_expired_incognito
from tests.engines import db_url_for
from tests.fakes.provider import ScriptedProvider
from tests.test_forget_races import HeldProvider
from tests.test_router import Sink

pytestmark = pytest.mark.both_engines


def _inbound(text: str) -> Inbound:
    return Inbound(IncomingMessage("discord", "dm-ann", "7", "Ann", text, is_dm=True))


async def _said(app: App, text: str) -> Sink:
    """What Ann's DM ``text`` got back (through the router, as any platform sends it)."""
    sink = Sink()
    await app.router.handle(_inbound(text), sink)
    return sink


def _database_bytes(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.iterdir()) if p.name.startswith("bot.db"))


async def test_an_incognito_stretch_is_answered_kept_apart_and_deleted(tmp_path: Path) -> None:
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=ScriptedProvider()) as app:
        say = partial(_said, app)

        await say("my garden has roses")
        paused = await say("!memory pause")
        assert "Incognito with Cora since" in paused.public[0].text
        replies = [await say(f"my secret word is xyzzyplover {i}") for i in range(3)]
        assert all(r.messages[0].startswith("🕶️ echo: my secret word") for r in replies)
        user = await app.storage.get_user("discord:7")
        pair = await app.cortex.store.count_messages(user.id, "Cora", 0)
        assert pair.cycle_count == 2  # the two messages before the stretch (one exchange) only
        channel = await app.storage.get_channel("discord:dm-ann")
        visible = [m.text for m in await app.storage.messages_between(channel.id, 0, 2**40, 100)]
        assert visible and not any("xyzzyplover" in t for t in visible)  # summaries never see them
        history = [m.text for m, _ in await app.cortex.store.pair_messages(user.id, "Cora", 100)]
        assert not any("xyzzyplover" in t for t in history)  # nor cortex updates
        backlog = [r["text"] for r in await app.storage.memory.messages_to_embed("any-model", 2**40, 100)]
        assert backlog and not any("xyzzyplover" in t for t in backlog)  # nor embeddings
        window = [m.text for m in await app.storage.recent_messages(channel.id, 20)]
        assert any("xyzzyplover" in t for t in window)  # the conversation itself still has them
        found = await app.cortex.memory.search(pair.id, "secret word xyzzyplover roses garden", user_id=user.id,
                                               persona="Cora", use_vectors=False)
        assert found and not any("xyzzyplover" in h.text for h in found)  # nor a search by words (another channel's)
        app.cortex.memory._term_counts_cache[("messages_fts", "Cora", "xyzzyplover")] = (3, 0.0, 0)  # (PostgreSQL's)
        ended = await say("!memory resume")
        assert not app.cortex.memory._term_counts_cache  # the words searched for lately went with the stretch
        assert "6 messages from that stretch are deleted" in ended.public[0].text
        window = [m.text for m in await app.storage.recent_messages(channel.id, 20)]
        assert not any("xyzzyplover" in t for t in window) and "my garden has roses" in window
        assert "not incognito" in (await say("!memory resume")).public[0].text
        assert not (await say("hello again")).messages[0].startswith("🕶️")
    if db_url_for(tmp_path).startswith("sqlite"):
        assert b"xyzzyplover" not in _database_bytes(tmp_path)


async def test_pausing_and_resuming_in_a_loop_scrubs_the_files_once_a_spell(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrub merges the whole database's full-text indexes under the write lock: each `!memory resume` and
    forget-me did one, so a user resuming or forgetting in a loop held everyone's writes. Nothing deleted: no
    scrub. Deleted again within the spacing: one scrub after it, for all of them."""
    import bot.storage.core

    monkeypatch.setattr(bot.storage.core, "SCRUB_SPACING", 1.0)
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}})
    async with App(config, llm=ScriptedProvider()) as app:
        scrubs: list[float] = []
        real = app.storage.db.scrub

        async def counted(indexes: object) -> bool:
            scrubs.append(asyncio.get_running_loop().time())
            return await real(indexes)  # type: ignore[arg-type]

        monkeypatch.setattr(app.storage.db, "scrub", counted)
        say = partial(_said, app)
        for word in ("plughfirst", "plughsecond", "plughthird"):
            await say("!memory pause")
            await say(f"the word is {word}")
            await say("!memory resume")
        assert len(scrubs) == 1  # the first at once, the others wait for the spacing
        assert await app.storage.get_setting(bot.storage.core.SCRUB_PENDING) is not None
        for _ in range(40):
            if len(scrubs) == 2:
                break
            await asyncio.sleep(0.1)
        assert len(scrubs) == 2 and scrubs[1] - scrubs[0] >= 0.9  # one scrub for both, after the spacing
        assert await app.storage.get_setting(bot.storage.core.SCRUB_PENDING) is None
        await say("!memory pause")
        assert "0 messages" in (await say("!memory resume")).public[0].text
        await asyncio.sleep(1.0)
        await say("!memory forget-me confirm")
        assert len(scrubs) == 3  # a minute (here a second) after the last: at once
        await say("!memory forget-me confirm")  # nothing stored, nothing noted: nothing to scrub
        await say("hello again")
        await say("!memory forget-me confirm")  # within the spacing: one scrub after it
        assert len(scrubs) == 3
        for _ in range(40):
            if len(scrubs) == 4:
                break
            await asyncio.sleep(0.1)
        assert len(scrubs) == 4 and scrubs[3] - scrubs[2] >= 0.9
    assert b"plugh" not in _database_bytes(tmp_path)


async def test_a_forgotten_stretch_ends_by_itself(tmp_path: Path) -> None:
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "memory": {"incognito_hours": 1}})
    async with App(config, llm=ScriptedProvider()) as app:
        await app.router.handle(_inbound("!memory pause"), Sink())
        await app.router.handle(_inbound("a secret"), Sink())
        assert await end_expired_incognito(app.storage, 1) == 0  # not yet
        await app.storage.db.write("UPDATE incognito SET started_at = started_at - 7200")
        await app.storage.db.write("UPDATE messages SET created_at = created_at - 3600")
        assert await end_expired_incognito(app.storage, 1) == 1
        channel = await app.storage.get_channel("discord:dm-ann")
        assert await app.storage.recent_messages(channel.id, 10) == []


async def test_a_stretch_whose_hours_ran_out_while_the_bot_was_stopped_ends_at_the_start(tmp_path: Path) -> None:
    """The check ran first ten minutes after the start: a terminal chat started two days later answered 🕶️
    and exported the stretch's messages."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "memory": {"incognito_hours": 1}})
    async with App(config, llm=ScriptedProvider()) as app:
        await app.router.handle(_inbound("!memory pause"), Sink())
        await app.router.handle(_inbound("a secret from before"), Sink())
        await app.storage.db.write("UPDATE incognito SET started_at = started_at - 7200")
        await app.storage.db.write("UPDATE messages SET created_at = created_at - 3600")
    async with App(config, llm=ScriptedProvider()) as app:
        reply = await _said(app, "am I still incognito?")
        assert not reply.messages[0].startswith("🕶️")
        channel = await app.storage.get_channel("discord:dm-ann")
        texts = [m.text for m in await app.storage.recent_messages(channel.id, 10)]
        assert "am I still incognito?" in texts and not any("secret" in t for t in texts)


async def test_messages_older_than_the_retention_go_and_memory_stays(tmp_path: Path) -> None:
    from cortex.memory.upkeep import expire_old_messages

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "memory": {"keep_messages_days": 30}})
    async with App(config, llm=ScriptedProvider()) as app:
        await app.router.handle(_inbound("an old message"), Sink())
        await app.router.handle(_inbound("!memory remember Ann grows figs"), Sink())
        channel = await app.storage.get_channel("discord:dm-ann")
        await app.storage.db.write("UPDATE messages SET created_at = created_at - 40 * 86400")
        await app.router.handle(_inbound("a new message"), Sink())
        assert await expire_old_messages(app.storage, 0) == 0  # 0: keep forever
        assert await expire_old_messages(app.storage, 30) == 2  # the old message and its reply
        texts = [m.text for m in await app.storage.recent_messages(channel.id, 10)]
        assert "an old message" not in texts and "a new message" in texts
        assert await app.storage.count_messages(channel.id) == 2
        listed = (await app.commands.dispatch("!memory list", app.router.context_for(_inbound(""), "Cora"))).text
        assert "Ann grows figs" in listed  # items stay


async def test_ending_a_stretch_after_its_reply_stats_were_written(tmp_path: Path) -> None:
    """Reply statistics point at the stretch's messages once the buffer is written: ending the stretch
    (and the retention) must take them along, not fail on the reference."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}})
    async with App(config, llm=ScriptedProvider()) as app:
        await app.router.handle(_inbound("!memory pause"), Sink())
        await app.router.handle(_inbound("a secret"), Sink())
        await app.storage.flush_audit()
        assert (await app.storage.db.fetch_one("SELECT count(*) FROM reply_stats"))[0] == 1
        ended = Sink()
        await app.router.handle(_inbound("!memory resume"), ended)
        assert "2 messages from that stretch are deleted" in ended.public[0].text
        assert (await app.storage.db.fetch_one("SELECT count(*) FROM reply_stats"))[0] == 0
        await app.router.handle(_inbound("an old one"), Sink())
        await app.storage.db.write("UPDATE messages SET created_at = created_at - 40 * 86400")
        from cortex.memory.upkeep import expire_old_messages

        assert await expire_old_messages(app.storage, 30) == 2  # its reply stats are buffered, then go too
        assert (await app.storage.db.fetch_one("SELECT count(*) FROM reply_stats"))[0] == 0


async def test_a_forget_me_during_a_pause_keeps_the_pause(tmp_path: Path) -> None:
    """Everything goes, the pause does not: the next message is answered incognito and never kept, and
    the stretch still ends on time (from its first start)."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000},
                           "memory": {"incognito_hours": 1}})
    async with App(config, llm=ScriptedProvider()) as app:
        say = partial(_said, app)

        await say("my garden has roses")
        await say("!memory pause")
        started = await app.storage.incognito.since((await app.storage.get_user("discord:7")).id, "Cora")
        forgot = (await say("!memory forget-me confirm")).public[0].text
        assert forgot.startswith("Done. Deleted 2 messages") and "still incognito with Cora" in forgot, forgot
        assert (await say("after the forget-me xyzzyplover")).messages[0].startswith("🕶️")
        user = await app.storage.get_user("discord:7")
        assert user is not None and await app.storage.incognito.since(user.id, "Cora") == started
        assert await app.storage.export.messages(user.id) != []  # kept while the stretch runs, then gone:
        await app.storage.db.write("UPDATE incognito SET started_at = started_at - 7200")
        assert await end_expired_incognito(app.storage, 1) == 1
        assert await app.storage.export.messages(user.id) == []
        # (the message of the stretch wrote their name into the row the pause kept: it goes with the stretch, as
        # nothing else of them is stored; it stayed, naming them)
        assert await app.storage.get_user("discord:7") is None
        await say("!memory pause")
        await say("!memory forget-me confirm")
        assert "Incognito ended" in (await say("!memory resume")).public[0].text
        assert await app.storage.get_user("discord:7") is None  # the key kept for the pause goes with it
        nothing = (await say("!memory forget-me confirm")).public[0].text
        assert nothing.startswith("The bot stores nothing about you")


async def test_skill_calls_during_a_stretch_leave_no_words_in_the_audit(tmp_path: Path) -> None:
    """The skill audit keeps which tool ran and when, never what it was asked during a pause (the stretch's
    words would outlive !memory resume there)."""
    from bot.llm.base import Completion, ToolCall, Usage

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    llm = ScriptedProvider()
    async with App(config, llm=llm) as app:
        say = partial(_said, app)

        await say("!memory pause")
        llm.enqueue(Completion("", tool_calls=(ToolCall("c1", "search_memory", {"query": "my diagnosis xyzzyplover"}),),
                               usage=Usage(0, 1)), "ok")
        await say("did I tell you about my diagnosis xyzzyplover?")
        await say("!memory resume")
        rows = await app.storage.db.fetch_all("SELECT skill, arguments FROM skill_executions")
        assert [str(r[0]) for r in rows] == ["search_memory"] and "xyzzyplover" not in str(rows[0][1])
    if db_url_for(tmp_path).startswith("sqlite"):
        assert b"xyzzyplover" not in _database_bytes(tmp_path)


async def test_a_stretch_ended_while_its_reply_is_written_keeps_no_reply(tmp_path: Path) -> None:
    """``!memory resume`` sent while the model still writes the answer to a paused message: the message goes
    with the stretch, and the reply (which repeats it) must not be stored after it, outside any stretch,
    where summaries, embeddings, recall and cortex updates would keep it."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}})
    llm = HeldProvider()
    async with App(config, llm=llm) as app:
        await app.router.handle(_inbound("!memory pause"), Sink())
        reply = asyncio.create_task(app.router.handle(_inbound("my secret word is xyzzyplover"), Sink()))
        await asyncio.wait_for(llm.waiting.wait(), 10)
        ended = Sink()
        await app.router.handle(_inbound("!memory resume"), ended)
        assert "1 message from that stretch is deleted" in ended.public[0].text, ended.public[0].text
        llm.release.set()
        await reply
        rows = await app.storage.db.fetch_all("SELECT text FROM messages")
        assert not any("xyzzyplover" in str(r[0]) for r in rows), rows
        await app.storage.scrub()
    if db_url_for(tmp_path).startswith("sqlite"):
        assert b"xyzzyplover" not in _database_bytes(tmp_path)


async def test_a_stretch_ended_just_before_its_reply_is_stored_keeps_no_reply(tmp_path: Path) -> None:
    """The same when the stretch ends between the core's check and the reply's insert: the reply goes again."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}})
    async with App(config, llm=ScriptedProvider()) as app:
        await app.router.handle(_inbound("!memory pause"), Sink())
        add_message = app.storage.add_message

        async def resumed_first(*args: object, **kwargs: object) -> object:
            if args[3] == "assistant":
                user = await app.storage.get_user("discord:7")
                assert user is not None and await app.storage.end_incognito(user.id, "Cora") == 1
            return await add_message(*args, **kwargs)  # type: ignore[arg-type]

        app.storage.add_message = resumed_first  # type: ignore[assignment, method-assign]
        shown = Sink()
        await app.router.handle(_inbound("my secret word is xyzzyplover"), shown)
        assert shown.messages[0].startswith("🕶️ echo: my secret word")  # shown as it streamed
        assert await app.storage.db.fetch_all("SELECT text FROM messages") == []


async def test_the_end_of_a_stretch_leaves_its_words_in_no_cache_of_the_process(tmp_path: Path) -> None:
    """The rows went at the stretch's end, but the process still held its last words per channel (a follow-up's
    context) and the query vectors it had kept; both are dropped now, at resume and when the stretch runs out."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=ScriptedProvider()) as app:
        say = partial(_said, app)

        await say("!memory pause")
        await say("my secret word is xyzzyplover")
        assert any("xyzzyplover" in t for t in app.core._last_text.values())
        embeddings = app.cortex.embeddings
        if embeddings is not None:
            embeddings._queries["my secret word is xyzzyplover"] = None  # type: ignore[assignment]
        await say("!memory resume")
        assert not any("xyzzyplover" in t for t in app.core._last_text.values())
        assert embeddings is None or "my secret word is xyzzyplover" not in embeddings._queries
        await say("!memory pause")
        await say("my other word is plughxyzzy")
        user = await app.storage.get_user("discord:7")
        await app.storage.db.write("UPDATE incognito SET started_at = 0 WHERE user_id = ?", (user.id,))
        await app._end_incognito()  # (the hourly check: it ran past incognito_hours)
        assert not any("plughxyzzy" in t for t in app.core._last_text.values())


async def test_a_message_sent_just_after_the_pause_is_in_the_stretch_whenever_it_is_handled(tmp_path: Path) -> None:
    """A privacy auditor's finding: the stretch began at the bot's clock when it got to `!memory pause`, while
    messages are stored by the platform's time: a message sent a moment after the pause but handled before it
    (Matrix runs each event as a task), or stamped earlier than the bot got to the pause (Discord), was kept for
    good, under a 🕶️ that said it was not. The stretch begins when the platform says the pause was sent, and a
    reply is never stored as older than its message."""
    from datetime import UTC, datetime, timedelta

    def inbound(text: str, sent: datetime) -> Inbound:
        return Inbound(IncomingMessage("discord", "dm-ann", "7", "Ann", text, is_dm=True, sent_at=sent))

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=ScriptedProvider()) as app:
        before, pause, secret, late = Sink(), Sink(), Sink(), Sink()
        await app.router.handle(inbound("said before the pause", datetime.now(UTC) - timedelta(seconds=3)), before)
        await asyncio.sleep(0.05)  # (its reply stored before the pause was sent)
        paused_at = datetime.now(UTC)
        await asyncio.sleep(0.3)  # the bot gets to the next messages a moment late (a busy bot, a reconnect)
        # the secret, sent just after the pause, is handled first
        await app.router.handle(inbound("my secret zanzibarquux", paused_at + timedelta(seconds=0.1)), secret)
        await app.router.handle(inbound("!memory pause", paused_at), pause)
        await app.router.handle(inbound("another zanzibarquux", paused_at + timedelta(seconds=0.2)), late)
        assert not before.messages[0].startswith("🕶️") and late.messages[0].startswith("🕶️")
        channel = await app.storage.get_channel("discord:dm-ann")
        assert channel is not None
        kept = [m.text for m in await app.storage.messages_between(channel.id, 0, 2**40, 100)]
        assert "said before the pause" in kept and not any("zanzibarquux" in t for t in kept)  # (nor the echoes)
        ended = await _said(app, "!memory resume")
        assert "4 messages from that stretch are deleted" in ended.public[0].text, ended.public[0].text
        window = [m.text for m in await app.storage.recent_messages(channel.id, 20)]
        assert not any("zanzibarquux" in t for t in window), window
        assert sorted(window) == ["echo: said before the pause", "said before the pause"], window


async def test_a_stretch_is_answered_in_its_own_conversation_only(tmp_path: Path) -> None:
    """A privacy auditor's finding: what Ann said while incognito went into the prompt of Bob's next reply in the
    same group channel (and of another persona's in her DM): a model that repeated it put it into Bob's kept reply,
    the channel's summary and Bob's files, all of which outlive Ann's resume."""
    def said(user: str, name: str, text: str, channel: str = "room") -> IncomingMessage:
        return IncomingMessage("discord", channel, user, name, text, is_dm=channel.startswith("dm-"))

    def last_prompt(llm: ScriptedProvider) -> str:
        request = llm.requests[-1]
        return request.system + " ".join(str(m.content) for m in request.messages)

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000},
                           "personas": [{"name": "Cora"}, {"name": "Nemo"}]})
    llm = ScriptedProvider()
    async with App(config, llm=llm) as app:
        await app.core.reply(said("7", "Ann", "hello all")).text()
        await _said(app, "!memory pause")  # (Ann with Cora, everywhere)
        await app.core.reply(said("7", "Ann", "my secret zanzibarquux")).text()
        await app.core.reply(said("8", "Bob", "what did everyone say?")).text()
        assert "zanzibarquux" not in last_prompt(llm) and "hello all" in last_prompt(llm)  # Bob's reply
        await app.core.reply(said("7", "Ann", "and now?")).text()
        assert "zanzibarquux" in last_prompt(llm)  # Ann's own stretch goes on with what she said in it
        await app.core.reply(said("7", "Ann", "tell Nemo zanzibarquux too", "dm-ann"), "Cora").text()
        await app.core.reply(said("7", "Ann", "hi Nemo", "dm-ann"), "Nemo").text()
        assert "zanzibarquux" not in last_prompt(llm)  # another persona: not her stretch with Cora


async def test_a_message_sent_before_the_pause_keeps_its_reply_however_late_it_is_answered(tmp_path: Path) -> None:
    """A review's finding: a message sent just before `!memory pause` but handled after it is outside the stretch,
    yet its reply, stored at the bot's time, fell inside it: `resume` deleted the reply and kept the message."""
    from datetime import UTC, datetime, timedelta

    def inbound(text: str, sent: datetime) -> Inbound:
        return Inbound(IncomingMessage("discord", "dm-ann", "7", "Ann", text, is_dm=True, sent_at=sent))

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=ScriptedProvider()) as app:
        now = datetime.now(UTC)
        answered = Sink()
        await app.router.handle(inbound("!memory pause", now - timedelta(seconds=1)), Sink())
        await app.router.handle(inbound("sent before the pause", now - timedelta(seconds=2)), answered)
        assert not answered.messages[0].startswith("🕶️")
        ended = await _said(app, "!memory resume")
        assert "0 messages from that stretch are deleted" in ended.public[0].text, ended.public[0].text
        channel = await app.storage.get_channel("discord:dm-ann")
        assert channel is not None
        kept = sorted(m.text for m in await app.storage.recent_messages(channel.id, 20))
        assert kept == ["echo: sent before the pause", "sent before the pause"], kept


async def test_a_pause_that_begins_while_a_reply_is_written_keeps_that_reply(tmp_path: Path) -> None:
    """A message sent before `!memory pause`, its reply still being written when the pause began: the reply was
    stored inside the stretch (by the bot's clock) and `resume` deleted it, leaving the message unanswered."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}})
    llm = HeldProvider()
    async with App(config, llm=llm) as app:
        reply = asyncio.create_task(app.router.handle(_inbound("what is a good tea?"), Sink()))
        await asyncio.wait_for(llm.waiting.wait(), 10)
        await asyncio.sleep(0.01)  # (the pause begins strictly after the message was stored)
        await app.router.handle(_inbound("!memory pause"), Sink())
        llm.release.set()
        await reply
        await _said(app, "in the stretch")
        ended = await _said(app, "!memory resume")
        assert "2 messages from that stretch are deleted" in ended.public[0].text, ended.public[0].text
        channel = await app.storage.get_channel("discord:dm-ann")
        assert channel is not None
        kept = [(m.role, m.text) for m in reversed(await app.storage.recent_messages(channel.id, 20))]
        assert kept == [("user", "what is a good tea?"), ("assistant", "echo: what is a good tea?")], kept


@pytest.mark.parametrize("pause_first", [True, False])
async def test_a_reply_whose_history_held_the_stretch_goes_with_it(tmp_path: Path, pause_first: bool) -> None:
    """Events are handled out of order (Matrix: each one a task): a message sent in the stretch was stored before
    an older message sent before the pause, whose reply then read it. That reply belongs to the stretch: kept
    (at its message's time, or moved back there at resume), it would carry the stretch's words on."""
    from datetime import UTC, datetime, timedelta

    def inbound(text: str, sent: datetime) -> Inbound:
        return Inbound(IncomingMessage("discord", "dm-ann", "7", "Ann", text, is_dm=True, sent_at=sent))

    llm = ScriptedProvider()
    llm.default = lambda r: Completion(" | ".join(str(m.content) for m in r.messages), usage=Usage(0, 1))
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=llm) as app:
        now = datetime.now(UTC)
        pause, secret = inbound("!memory pause", now - timedelta(seconds=2)), inbound("my secret is xyzzy", now)
        for event in ((pause, secret) if pause_first else (secret, pause)):
            await app.router.handle(event, Sink())
        shown = Sink()
        await app.router.handle(inbound("sent before the pause", now - timedelta(seconds=3)), shown)
        assert "xyzzy" in shown.messages[0] and shown.messages[0].startswith("🕶️")  # it read the stretch
        await _said(app, "!memory resume")
        rows = [str(r[0]) for r in await app.storage.db.fetch_all("SELECT text FROM messages")]
        assert rows == ["sent before the pause"], rows  # its own message stays (unanswered)


def _at(text: str, sent: datetime | None = None, key: str | None = None) -> Inbound:
    return Inbound(IncomingMessage("discord", "dm-ann", "7", "Ann", text, is_dm=True, sent_at=sent, message_key=key))


def _echo_all() -> ScriptedProvider:
    """A model whose answer repeats its whole conversation: what a reply read shows in it."""
    llm = ScriptedProvider()
    llm.default = lambda r: Completion(" | ".join(str(m.content) for m in r.messages), usage=Usage(0, 1))
    return llm


async def _texts(app: App) -> list[str]:
    return sorted(str(r[0]) for r in await app.storage.db.fetch_all("SELECT text FROM messages"))


@pytest.mark.parametrize("ahead", [0, 30])
async def test_a_reply_that_read_the_stretch_goes_whatever_the_clocks_or_deletions(tmp_path: Path, ahead: int) -> None:
    """The reply to a message from before the pause, whose history held the stretch's words: stored inside the
    stretch by the platform's clock too (30 s ahead of the bot's), and gone at resume even when the stretch
    message it read was deleted on the platform first (resume used to work it out again from what was left)."""
    from datetime import timedelta

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=_echo_all()) as app:
        now = datetime.now(UTC) + timedelta(seconds=ahead)  # the platform's clock
        await app.router.handle(_at("!memory pause", now - timedelta(seconds=2)), Sink())
        await app.router.handle(_at("my secret is xyzzy", now, key="discord-message:S"), Sink())
        shown = Sink()
        await app.router.handle(_at("sent before the pause", now - timedelta(seconds=3)), shown)
        assert "xyzzy" in shown.messages[0] and shown.messages[0].startswith("🕶️")
        assert await app.core.withdraw("discord-message:S", "discord:7")
        await app.router.handle(_at("!memory resume", now + timedelta(seconds=1)), Sink())
        assert await _texts(app) == ["sent before the pause"]


async def test_answers_written_as_a_pause_begins_stay_outside_it_and_taint_nothing(tmp_path: Path) -> None:
    """Two messages, then `!memory pause` while the first answer is written: that answer goes with its message,
    outside the stretch, so the second one (whose history holds it) is no 🕶️ reply, and a resume while the
    second is written keeps both exchanges whole."""
    class Gated(ScriptedProvider):
        def __init__(self) -> None:
            super().__init__()
            self.gates, self.asked = [asyncio.Event(), asyncio.Event()], [asyncio.Event(), asyncio.Event()]

        async def _next(self, request: LLMRequest) -> Completion:
            n = len(self.requests)
            if n < 2:
                self.asked[n].set()
                await self.gates[n].wait()
            return await super()._next(request)

    llm = Gated()
    async with App(parse_config({"storage": {"url": db_url_for(tmp_path)}}), llm=llm) as app:
        first = asyncio.create_task(app.router.handle(_at("what is a good tea?"), Sink()))
        await asyncio.wait_for(llm.asked[0].wait(), 10)
        shown = Sink()
        second = asyncio.create_task(app.router.handle(_at("and a good coffee?"), shown))
        await asyncio.sleep(0.05)
        await app.router.handle(_at("!memory pause"), Sink())
        llm.gates[0].set()
        await first
        await asyncio.wait_for(llm.asked[1].wait(), 10)
        await app.router.handle(_at("!memory resume"), Sink())
        llm.gates[1].set()
        await second
        assert not shown.messages[0].startswith("🕶️"), shown.messages
        assert await _texts(app) == ["and a good coffee?", "echo: and a good coffee?", "echo: what is a good tea?",
                                     "what is a good tea?"]


async def test_a_message_sent_in_a_stretch_and_stored_after_its_end_goes_too(tmp_path: Path) -> None:
    """A privacy auditor's finding: a message sent while paused but still on its way when `!memory resume` was
    handled (Matrix handles each event as a task; a busy bot gets to it late) was stored after the stretch's end
    deleted the rest, outside any stretch: kept for good, in summaries, files and search. The ended stretch is
    remembered a while: such a message is answered as in it and goes; one sent after the resume stays."""
    from datetime import UTC, datetime, timedelta

    from bot.llm.errors import LLMServerError
    from bot.storage.incognito import ENDED_KEPT_SECONDS

    def inbound(text: str, sent: datetime) -> Inbound:
        return Inbound(IncomingMessage("discord", "dm-ann", "7", "Ann", text, is_dm=True, sent_at=sent))

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    llm = ScriptedProvider()
    async with App(config, llm=llm) as app:
        t0 = datetime.now(UTC) - timedelta(seconds=30)
        late, after = Sink(), Sink()
        await app.router.handle(inbound("!memory pause", t0), Sink())
        resumed = Sink()
        await app.router.handle(inbound("!memory resume", t0 + timedelta(seconds=20)), resumed)
        assert "0 messages from that stretch are deleted" in resumed.public[0].text, resumed.public[0].text
        await app.router.handle(inbound("my secret zanzibarquux", t0 + timedelta(seconds=10)), late)
        await app.router.handle(inbound("said after the resume", t0 + timedelta(seconds=25)), after)
        assert late.messages[0].startswith("🕶️ echo: my secret") and not after.messages[0].startswith("🕶️")
        rows = [str(r[0]) for r in await app.storage.db.fetch_all("SELECT text FROM messages")]
        assert sorted(rows) == ["echo: said after the resume", "said after the resume"], rows
        assert not any("zanzibarquux" in t for t in app.core._last_text.values())

        # A late message whose reply failed goes at once too.
        llm.enqueue(LLMServerError("down"))
        await app.router.handle(inbound("my other secret plughxyzzy", t0 + timedelta(seconds=15)), Sink())
        rows = [str(r[0]) for r in await app.storage.db.fetch_all("SELECT text FROM messages")]
        assert not any("plughxyzzy" in t for t in rows), rows
        # One stored by a process that stopped before its reply: kept out of every prompt (Ann's own too, whose
        # reply is kept), summaries and cortex updates, until the periodic check deletes it.
        user, channel = await app.storage.get_user("discord:7"), await app.storage.get_channel("discord:dm-ann")
        assert user is not None and channel is not None
        await app.storage.add_message(channel.id, user.id, "Cora", "user", "Ann", "stranded quuxfrob", 3,
                                      t0 + timedelta(seconds=12))
        visible = [m.text for m in await app.storage.messages_between(channel.id, 0, 2**40, 100)]
        assert "said after the resume" in visible and not any("quuxfrob" in t for t in visible)  # (summaries)
        history = [m.text for m, _ in await app.cortex.store.pair_messages(user.id, "Cora", 100)]
        assert history and not any("quuxfrob" in t for t in history)  # (cortex updates)
        window = [m.text for m in await app.storage.recent_messages(channel.id, 20, viewer=(user.id, "Cora"))]
        assert "said after the resume" in window and not any("quuxfrob" in t for t in window)  # (her next prompt)
        await app._end_incognito()  # (the periodic check: the stretch ended moments ago, it is still kept)
        assert any("quuxfrob" in str(r[0]) for r in await app.storage.db.fetch_all("SELECT text FROM messages"))
        ago = ENDED_KEPT_SECONDS + 60  # (the whole stretch, and the message in it, that long ago)
        await app.storage.db.write("UPDATE incognito_ended SET started_at = started_at - ?, ended_at = ended_at - ?",
                                   (ago, ago))
        await app.storage.db.write("UPDATE messages SET created_at = created_at - ? WHERE role = 'user'"
                                   " AND created_at < ?", (ago, (t0 + timedelta(seconds=20)).timestamp()))
        await app._end_incognito()
        rows = [str(r[0]) for r in await app.storage.db.fetch_all("SELECT text FROM messages")]
        assert sorted(rows) == ["echo: said after the resume", "said after the resume"], rows
        assert await app.storage.db.fetch_all("SELECT * FROM incognito_ended") == []
        await app.storage.scrub()
    if db_url_for(tmp_path).startswith("sqlite"):
        assert not any(w in _database_bytes(tmp_path) for w in (b"zanzibarquux", b"plughxyzzy", b"quuxfrob"))


async def test_a_late_message_after_pause_forget_me_and_resume_goes_too(tmp_path: Path) -> None:
    """A review's finding: resuming after a forget-me dropped the key-only user row the pause had kept, and with it
    any record of the stretch: the late message made a new user and was kept, outside any stretch."""
    from datetime import timedelta

    inbound = _sent
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=ScriptedProvider()) as app:
        t0 = datetime.now(UTC) - timedelta(seconds=30)
        await app.router.handle(inbound("!memory pause", t0), Sink())
        await app.router.handle(inbound("!memory forget-me confirm", t0 + timedelta(seconds=5)), Sink())
        await app.router.handle(inbound("!memory resume", t0 + timedelta(seconds=20)), Sink())
        assert await app.storage.get_user("discord:7") is None  # (the key kept for the pause went)
        late = Sink()
        await app.router.handle(inbound("my secret zanzibarquux", t0 + timedelta(seconds=10)), late)
        assert late.messages[0].startswith("🕶️")
        assert await app.storage.db.fetch_all("SELECT text FROM messages") == []


async def test_a_name_said_in_the_stretch_after_a_forget_me_goes_at_the_resume(tmp_path: Path) -> None:
    """Pause, forget-me, a message, resume: the message wrote the person's name into the key-only row the pause
    had kept, which then stayed (its name and id) with nothing else of them stored."""
    from datetime import timedelta

    def inbound(text: str, sent: datetime) -> Inbound:
        return _sent(text, sent, name="Annabellez")

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=ScriptedProvider()) as app:
        t0 = datetime.now(UTC) - timedelta(seconds=30)
        await app.router.handle(inbound("!memory pause", t0), Sink())
        await app.router.handle(inbound("!memory forget-me confirm", t0 + timedelta(seconds=5)), Sink())
        await app.router.handle(inbound("my secret zanzibarquux", t0 + timedelta(seconds=10)), Sink())
        assert (await app.storage.get_user("discord:7")).display_name == "Annabellez"  # type: ignore[union-attr]
        await app.router.handle(inbound("!memory resume", t0 + timedelta(seconds=20)), Sink())
        assert await app.storage.get_user("discord:7") is None
        assert await app.storage.db.fetch_all("SELECT text FROM messages") == []
        await app.storage.scrub()
    if db_url_for(tmp_path).startswith("sqlite"):
        assert b"Annabellez" not in _database_bytes(tmp_path)


async def test_a_late_message_whose_reply_is_cancelled_goes_too(tmp_path: Path) -> None:
    """A review's finding: a late message of an ended stretch went at once only when its reply failed with a model
    error; a reply cancelled (Ctrl-C in the terminal, a platform task stopped) left it for the periodic check."""
    from datetime import UTC, datetime, timedelta

    def inbound(text: str, sent: datetime) -> Inbound:
        return Inbound(IncomingMessage("discord", "dm-ann", "7", "Ann", text, is_dm=True, sent_at=sent))

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    llm = HeldProvider()
    llm.enqueue("ok")  # (the pause's and resume's turns take no model call: the late message's is the first)
    async with App(config, llm=llm) as app:
        t0 = datetime.now(UTC) - timedelta(seconds=30)
        await app.router.handle(inbound("!memory pause", t0), Sink())
        await app.router.handle(inbound("!memory resume", t0 + timedelta(seconds=20)), Sink())
        reply = asyncio.create_task(app.router.handle(inbound("my secret zanzibarquux", t0 + timedelta(seconds=10)),
                                                      Sink()))
        await asyncio.wait_for(llm.waiting.wait(), 10)
        reply.cancel()
        await asyncio.gather(reply, return_exceptions=True)
        assert await app.storage.db.fetch_all("SELECT text FROM messages") == []


SECRET = "zanzibarquux"


def _sent(text: str, sent: datetime, key: str | None = None, name: str = "Ann") -> Inbound:
    return Inbound(IncomingMessage("discord", "dm-ann", "7", name, text, is_dm=True, sent_at=sent, message_key=key))


async def test_a_summary_made_before_the_pause_arrived_goes_with_the_messages_it_took(tmp_path: Path) -> None:
    """Messages sent just after the pause but handled before it are the stretch's (see the test above), but a
    summary written of them before the pause arrived kept their words after the resume deleted them."""
    from datetime import timedelta

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000},
                           "history": {"history_tokens": 60, "min_exchanges": 0, "summary_trigger": 2}})
    llm = ScriptedProvider()
    app = await App(config, llm=llm).start(workers=False)
    try:
        await app.router.handle(_sent("an ordinary start", datetime.now(UTC)), Sink())
        await asyncio.sleep(0.05)  # (its reply stored before the pause was sent)
        paused_at = datetime.now(UTC)
        for i in range(6):
            await app.router.handle(_sent(f"my secret {SECRET} number {i} " * 3,
                                          paused_at + timedelta(seconds=0.1 + i * 0.01)), Sink())
        channel = await app.storage.get_channel("discord:dm-ann")
        assert channel is not None
        llm.enqueue(f"Ann told her secret {SECRET}.")
        queued = await app.storage.db.fetch_one("SELECT id FROM jobs WHERE key = ?", (f"channel:{channel.id}",))
        assert queued is not None  # (the messages asked for a summary)
        job = await app.storage.get_job(int(queued[0]))
        assert job is not None
        await app.summaries.run_job(job)
        summary = await app.storage.latest_summary(channel.id)
        assert summary is not None and SECRET in summary.text  # (written before the pause reached the bot)
        paused = Sink()
        await app.router.handle(_sent("!memory pause", paused_at), paused)
        assert "That includes 6 messages sent after the pause that I had already answered" in paused.public[0].text
        assert await app.storage.latest_summary(channel.id) is None  # (written again without them)
        ended = Sink()
        await app.router.handle(_sent("!memory resume", datetime.now(UTC)), ended)
        assert "12 messages from that stretch are deleted" in ended.public[0].text
        assert [m.text for m in await app.storage.messages_between(channel.id, 0, 2**40, 100)] == [
            "an ordinary start", "echo: an ordinary start"]
    finally:
        await app.stop()


async def test_an_item_remembered_from_a_message_the_stretch_took_goes_with_it(tmp_path: Path) -> None:
    """The reply to a message sent just after the pause (handled before it) remembered it as an item: the
    resume deleted the message, and the item went on into every later prompt."""
    import json
    from datetime import timedelta

    from bot.llm.base import ToolCall

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    llm = ScriptedProvider()
    arguments = {"content": f"Ann's PIN is {SECRET}"}
    llm.enqueue(Completion("", (ToolCall("t1", "remember", arguments, json.dumps(arguments)),), Usage(0, 10),
                           stop_reason="tool_use"), "Noted.")
    app = await App(config, llm=llm).start(workers=False)
    try:
        paused_at = datetime.now(UTC) - timedelta(seconds=5)
        await app.router.handle(_sent(f"remember my PIN {SECRET}", paused_at + timedelta(seconds=1),
                                      "discord-message:1"), Sink())
        items = "SELECT content FROM memory_items"
        assert [str(r[0]) for r in await app.storage.db.fetch_all(items)] == [f"Ann's PIN is {SECRET}"]
        await app.router.handle(_sent("!memory pause", paused_at), Sink())
        assert await app.storage.db.fetch_all(items) == []
        await app.router.handle(_sent("!memory resume", datetime.now(UTC)), Sink())
        assert await app.storage.db.fetch_all("SELECT text FROM messages") == []
    finally:
        await app.stop()


async def test_the_end_of_a_stretch_deletes_the_items_remembered_from_its_messages(tmp_path: Path) -> None:
    """An item filed under a message of the stretch (made while the pause was on its way, by a reply in flight)
    was left when the resume deleted the message; a correction it made is undone with it."""
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    async with App(config, llm=ScriptedProvider()) as app:
        await app.router.handle(_sent("!memory pause", datetime.now(UTC)), Sink())
        await app.router.handle(_sent(f"my PIN is {SECRET}", datetime.now(UTC), "discord-message:2"), Sink())
        user = await app.storage.get_user("discord:7")
        assert user is not None
        pair = await app.storage.cortex.ensure_pair(user.id, app.personas.names()[0])
        old = await app.cortex.memory.remember(pair.id, "Ann's PIN is 1234")
        await app.cortex.memory.remember(pair.id, f"Ann's PIN is {SECRET}", supersedes=old.id,
                                         source_ref="discord-message:2")
        await app.router.handle(_sent("!memory resume", datetime.now(UTC)), Sink())
        rows = await app.storage.db.fetch_all("SELECT content, superseded_by FROM memory_items")
        assert [(str(r[0]), r[1]) for r in rows] == [("Ann's PIN is 1234", None)]


async def test_a_summary_written_while_the_pause_arrived_is_dropped(storage: Storage) -> None:
    """A summary run that read messages before the pause reached the bot stored its summary after: the pause had
    made them the stretch's, and the summary with their words outlived the stretch."""
    from datetime import timedelta

    from bot.storage.base import SummarySources

    ann = await storage.upsert_user("discord:ann", "Ann")
    channel = await storage.upsert_channel("discord:dm", "dm", is_dm=True)
    now = datetime.now(UTC)
    before = await storage.add_message(channel.id, ann.id, "Cora", "user", "Ann", "hello", 1,
                                       created_at=now - timedelta(seconds=60))
    secret = await storage.add_message(channel.id, ann.id, "Cora", "user", "Ann", f"my PIN is {SECRET}", 1,
                                       created_at=now - timedelta(seconds=10))
    made_from = SummarySources(None, (before.id, secret.id))  # (read; the model is writing)
    assert (await storage.start_incognito(ann.id, "Cora", now - timedelta(seconds=30)))[1] == 1
    written = await storage.add_summary(channel.id, f"Ann's PIN is {SECRET}", before.id, secret.id, 5, "m",
                                        made_from=made_from)
    assert written is None
    await storage.end_incognito(ann.id, "Cora")
    assert await storage.latest_summary(channel.id) is None


async def test_a_message_embedded_before_the_pause_arrived_is_not_found_by_meaning(tmp_path: Path) -> None:
    """A message sent just after the pause but handled (and embedded) before it arrived belongs to the stretch:
    the word search left it out, but its vector stayed and the search by meaning fetched it, while the pause's
    answer said nothing reaches "search by meaning" (also in group replies where shared memory is used)."""
    from datetime import timedelta

    from cortex.memory.embedders import HashEmbedder

    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "cortex": {"context_limit": 1000}})
    app = await App(config, llm=ScriptedProvider(), embedder=HashEmbedder()).start(workers=False)
    try:
        paused_at = datetime.now(UTC) - timedelta(seconds=5)
        await app.router.handle(_sent(f"my lab result code is {SECRET}", paused_at + timedelta(seconds=1)), Sink())
        await app.cortex.embeddings.backfill()
        assert (await app.storage.db.fetch_one("SELECT count(*) FROM message_vectors"))[0] == 2
        user = await app.storage.upsert_user("discord:7", "Ann")
        _, pair = await app.cortex.store.pair_for("discord:7", "Ann", "Cora")

        async def found() -> list[str]:
            hits = await app.cortex.memory.search(pair.id, f"lab result code {SECRET}", user_id=user.id,
                                                  persona="Cora", patient=True)
            return [h.text for h in hits if SECRET in h.text]

        assert await found()  # (and the vectors are in this process's cache now)
        paused = Sink()
        await app.router.handle(_sent("!memory pause", paused_at), paused)
        assert "That includes 1 message sent after the pause" in paused.public[0].text
        assert (await app.storage.db.fetch_one("SELECT count(*) FROM message_vectors"))[0] == 0
        await app.cortex.embeddings.backfill()  # (the backfill leaves the stretch alone)
        assert (await app.storage.db.fetch_one("SELECT count(*) FROM message_vectors"))[0] == 0
        assert await found() == []
    finally:
        await app.stop()
