"""The shared platform path: policy, commands, privacy, rate limit, personas, streaming, failures."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from bot.app import App
from bot.commands import CommandReply
from bot.config import parse_config
from bot.llm.errors import LLMRateLimited
from bot.policy import Inbound
from bot.ports import IncomingMessage
from tests.fakes.provider import ScriptedProvider


class Sink:
    limit = 2000

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.public: list[CommandReply] = []
        self.private: list[CommandReply] = []
        self.typing_shown = 0

    async def send(self, text: str) -> int:
        self.messages.append(text)
        return len(self.messages) - 1

    async def edit(self, handle: int, text: str) -> None:
        self.messages[handle] = text

    @asynccontextmanager
    async def typing(self) -> Any:
        self.typing_shown += 1
        yield

    async def send_reply(self, reply: CommandReply) -> None:
        self.public.append(reply)

    async def send_private(self, reply: CommandReply) -> None:
        self.private.append(reply)


def _config(tmp_path: Path, rate: int = 100, **access: Any):
    return parse_config({
        "storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"},
        "chat": {"rate_limit_per_minute": rate, "edit_interval_seconds": 0.2},
        "access": access,
        "cortex": {"context_limit": 1000},
        "personas": [{"name": "Cora", "identity": "You are {char_name}."},
                     {"name": "Max", "identity": "You are {char_name}."}],
    })


def inbound(text: str, *, user: str = "1", dm: bool = False, mention: bool = False, **kw: Any) -> Inbound:
    message = IncomingMessage("discord", "dm1" if dm else "chan1", user, f"user{user}", text, is_dm=dm,
                              server_id=None if dm else "guild1", mentions_bot=mention)
    return Inbound(message, **kw)


async def test_addressing_rules(tmp_path: Path) -> None:
    async with App(_config(tmp_path, always_answer_channels=["discord:202"]), llm=ScriptedProvider()) as app:
        cases = [
            (inbound("hi", dm=True), True),
            (inbound("hi"), False),
            (inbound("hi", mention=True), True),
            (inbound("hi", replied_to_bot=True), True),
            (inbound("hi", mention=True, is_self=True), False),
            (inbound("hi", mention=True, author_is_bot=True), False),
        ]
        always = IncomingMessage("discord", "202", "1", "u", "hello", server_id="guild1")
        cases.append((Inbound(always), True))
        for item, answers in cases:
            sink = Sink()
            await app.router.handle(item, sink)
            assert bool(sink.messages) == answers, item


async def test_allow_and_deny_lists(tmp_path: Path) -> None:
    config = _config(tmp_path, deny_users=["discord:2"], allow_bots=["discord:9"], allow_roles=["discord:501"])
    async with App(config, llm=ScriptedProvider()) as app:
        for item, answers in [
            (inbound("hi", user="2", mention=True, roles=("discord:501",)), False),  # denied user
            (inbound("hi", user="9", mention=True, author_is_bot=True, roles=("discord:501",)), True),
            (inbound("hi", mention=True), False),  # lacks the allowed role
            (inbound("hi", mention=True, roles=("discord:501",)), True),
            (inbound("hi", dm=True), True),  # roles do not apply in DMs
        ]:
            sink = Sink()
            await app.router.handle(item, sink)
            assert bool(sink.messages) == answers, item
    async with App(_config(tmp_path, dms=False), llm=ScriptedProvider()) as app:
        sink = Sink()
        await app.router.handle(inbound("hi", dm=True), sink)
        assert sink.messages == []


async def test_memory_commands_in_a_channel_answer_privately(tmp_path: Path) -> None:
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        sink = Sink()
        await app.router.handle(inbound("!memory show"), sink)  # commands need no mention
        assert sink.public == [] and len(sink.private) == 1 and "memory.md" in sink.private[0].text
        dm = Sink()
        await app.router.handle(inbound("!memory show", dm=True), dm)
        assert dm.private == [] and "memory.md" in dm.public[0].text
        admin_only = Sink()
        await app.router.handle(inbound("!cortex settings"), admin_only)
        assert "for admins only" in admin_only.public[0].text
        admin = Sink()
        await app.router.handle(inbound("!cortex settings", is_admin=True), admin)
        assert "context_limit" in admin.public[0].text


async def test_commands_have_a_rate_limit_and_a_flood_gets_one_notice(tmp_path: Path) -> None:
    """Commands skipped the limit: thirty "!memory <60,000 characters>" got thirty long public replies.
    Now a user's commands are limited per minute like their messages, a flood is told to wait once, and
    its echoes are short code spans (no links, no markup)."""
    config = _config(tmp_path, rate=3)
    config.chat.command_rate_limit_per_minute = 4
    async with App(config, llm=ScriptedProvider()) as app:
        sink = Sink()
        for _ in range(10):
            await app.router.handle(inbound("!memory [click](https://evil.example/login)" + "A" * 19_000), sink)
        answers, notices = sink.public[:4], sink.public[4:]
        assert all(a.text.startswith("Unknown command !memory `[click](https://evil.example/login)AAAA…`; !memory has:")
                   for a in answers), answers[0].text[:200]
        assert all(len(a.text) < 3_000 and "A" * 10 not in a.text for a in answers)
        assert len(notices) == 1 and "sending commands faster than I can answer" in notices[0].text
        chat = Sink()  # messages keep their own budget
        await app.router.handle(inbound("hello", dm=True), chat)
        assert chat.messages
        other = Sink()
        await app.router.handle(inbound("!help", user="2"), other)  # another user is not held up
        assert other.public[0].text.startswith("Commands:")
        console = Sink()  # the terminal's user runs the bot: no limit
        for _ in range(6):
            await app.router.handle(Inbound(IncomingMessage("console", "tty", "local", "You", "!help")), console)
        assert len(console.public) == 6 and all(r.text.startswith("Commands:") for r in console.public)


async def test_rate_limit_notice_and_llm_failure_message(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    async with App(_config(tmp_path, rate=3), llm=llm) as app:
        sinks = [Sink() for _ in range(4)]
        for i, sink in enumerate(sinks):
            await app.router.handle(inbound(f"message {i}", dm=True), sink)
        assert all(s.messages for s in sinks[:3])
        assert sinks[3].messages == [] and "faster than I can answer" in sinks[3].public[0].text
        assert "wait" in sinks[3].public[0].text
        llm.enqueue(LLMRateLimited("429"))
        failing = Sink()
        await app.router.handle(inbound("hello?", user="5", dm=True), failing)
        assert failing.messages == [] and "rate-limited" in failing.public[0].text
        channel = await app.storage.get_channel("discord:dm1")
        texts = [m.text for m in await app.storage.recent_messages(channel.id, 20)]
        assert "hello?" in texts  # the user's message was kept


async def test_streamed_reply_is_shown_with_typing(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    llm.enqueue("a fairly long answer " * 5)
    async with App(_config(tmp_path), llm=llm) as app:
        sink = Sink()
        await app.router.handle(inbound("tell me", dm=True), sink)
        assert sink.messages == [("a fairly long answer " * 5).strip()] and sink.typing_shown == 1


async def test_persona_per_channel_and_per_dm_user(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        sink = Sink()
        await app.router.handle(inbound("!persona Max"), sink)
        assert "Only admins" in sink.private[0].text and sink.public == []  # the refusal goes to the asker
        announced = Sink()
        await app.router.handle(inbound("!persona", is_admin=True), announced)
        assert "Here you talk to Cora" in announced.private[0].text and announced.public == []
        await app.router.handle(inbound("!persona list", is_admin=True), announced)  # the subcommand still works
        assert announced.public[-1].text.startswith("Personas:\n  Cora")
        picked = Sink()
        await app.router.handle(inbound("!persona Max", is_admin=True), picked)
        assert picked.public[0].text == "Max now answers in this channel."  # a pick is announced
        await app.router.handle(inbound("hi", mention=True), Sink())
        assert "You are Max" in llm.requests[-1].system
        dm = Sink()
        await app.router.handle(inbound("!persona max", dm=True), dm)
        assert "now talk to Max" in dm.public[0].text
        await app.router.handle(inbound("hi", dm=True), Sink())
        assert "You are Max" in llm.requests[-1].system
        await app.router.handle(inbound("hi", user="7", dm=True), Sink())
        assert "You are Cora" in llm.requests[-1].system  # another user's DM keeps the default
        bad = Sink()
        await app.router.handle(inbound("!persona Nobody", dm=True), bad)
        assert "unknown persona" in bad.public[0].text


async def test_dm_memory_stays_out_of_group_channels_unless_the_bots_admins_allow(tmp_path: Path) -> None:
    """A server admin (on Matrix: whoever makes a room) may not switch it on: their switch would decide where
    everyone else's private memory shows."""
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        await app.router.handle(inbound("!memory edit memory.md\n# Notes\n- my secret diagnosis\n", dm=True), Sink())
        await app.router.handle(inbound("hi", dm=True), Sink())
        assert "my secret diagnosis" in llm.requests[-1].system
        await app.router.handle(inbound("hi all", mention=True), Sink())
        assert "my secret diagnosis" not in llm.requests[-1].system
        refused = Sink()
        await app.router.handle(inbound("!cortex settings use_in_groups on", is_admin=True), refused)
        assert "only the bot's admins switch it on" in refused.public[0].text
        await app.router.handle(inbound("hi all again", mention=True), Sink())
        assert "my secret diagnosis" not in llm.requests[-1].system
        allow = Sink()
        await app.router.handle(inbound("!cortex settings use_in_groups on", is_admin=True, is_bot_admin=True), allow)
        assert "set to on for this server. Effective now: on (from this server)" in allow.public[0].text
        await app.router.handle(inbound("hi again", mention=True), Sink())
        assert "my secret diagnosis" in llm.requests[-1].system
        off = Sink()  # switching it off keeps things private: the server's admins may
        await app.router.handle(inbound("!cortex settings use_in_groups off", is_admin=True), off)
        assert "set to off for this server" in off.public[0].text
        await app.router.handle(inbound("hi once more", mention=True), Sink())
        assert "my secret diagnosis" not in llm.requests[-1].system
        # With it on for the persona everywhere, "back to the default" would switch it on here: not theirs either
        await app.router.handle(inbound("!cortex settings use_in_groups on --persona", is_admin=True,
                                        is_bot_admin=True), Sink())
        cleared = Sink()
        await app.router.handle(inbound("!cortex settings use_in_groups default", is_admin=True), cleared)
        assert "only the bot's admins switch it on" in cleared.public[0].text
        await app.router.handle(inbound("hi at last", mention=True), Sink())
        assert "my secret diagnosis" not in llm.requests[-1].system


class RecordingSink(Sink):
    """Remembers every text it was asked to show, in order (sends and edits)."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: list[str] = []

    async def send(self, text: str) -> int:
        self.shown.append(text)
        return await super().send(text)

    async def edit(self, handle: int, text: str) -> None:
        self.shown.append(text)
        await super().edit(handle, text)


def _slow_config(tmp_path: Path, streaming: bool = True):
    config = _config(tmp_path)
    chat = config.chat.model_copy(update={"still_working_seconds": 0.2, "streaming": streaming})
    return config.model_copy(update={"chat": chat})


async def test_a_slow_model_shows_still_working_then_the_reply_replaces_it(tmp_path: Path) -> None:
    for streaming in (True, False):
        llm = ScriptedProvider(delay=0.6)
        llm.enqueue("Here is my answer.")
        async with App(_slow_config(tmp_path / str(streaming), streaming), llm=llm) as app:
            sink = RecordingSink()
            await app.router.handle(inbound("hi", dm=True), sink)
        assert sink.shown[0] == "⏳ still working…"
        assert sink.messages == ["Here is my answer."]  # one message: the placeholder, edited
        assert sink.public == []


async def test_a_quick_model_never_shows_still_working(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    llm.enqueue("Quick.")
    async with App(_slow_config(tmp_path), llm=llm) as app:
        sink = RecordingSink()
        await app.router.handle(inbound("hi", dm=True), sink)
        await asyncio.sleep(0.3)  # past the delay: the cancelled timer posts nothing late
    assert sink.shown == ["Quick."] and sink.messages == ["Quick."]


async def test_an_error_after_still_working_takes_its_place(tmp_path: Path) -> None:
    llm = ScriptedProvider(delay=0.6)
    llm.enqueue(LLMRateLimited("429"))
    async with App(_slow_config(tmp_path), llm=llm) as app:
        sink = RecordingSink()
        await app.router.handle(inbound("hi", dm=True), sink)
    assert sink.shown[0] == "⏳ still working…"
    assert sink.messages == [f"⚠️ {LLMRateLimited('429').user_message}"] and sink.public == []


def test_matrix_server_lists_match_the_room_or_the_authors_homeserver() -> None:
    from bot.config import AccessConfig
    from bot.policy import refusal

    def matrix(sender: str, *, room: str = "!room:example.org", dm: bool = False) -> Inbound:
        return Inbound(IncomingMessage("matrix", room, sender, sender, "hi", is_dm=dm, mentions_bot=True,
                                       server_id=None if dm else room, author_home=sender.split(":", 1)[1]))

    by_home = AccessConfig(allow_servers=["matrix:example.org"], deny_servers=["matrix:evil.org"])
    assert refusal(matrix("@ann:example.org"), by_home, is_command=False) is None
    assert refusal(matrix("@eve:other.net"), by_home, is_command=False) == "server not allowed"
    assert refusal(matrix("@mal:evil.org", dm=True), by_home, is_command=False) == "denied server or role"
    by_room = AccessConfig(allow_servers=["matrix:!room:example.org"])
    assert refusal(matrix("@eve:other.net"), by_room, is_command=False) is None
    assert refusal(matrix("@eve:other.net", room="!elsewhere:example.org"), by_room, is_command=False) == (
        "server not allowed")


async def test_a_bare_mention_gets_a_greeting_with_a_way_on_and_stores_nothing(tmp_path: Path) -> None:
    llm = ScriptedProvider()
    async with App(_config(tmp_path), llm=llm) as app:
        in_channel, in_dm = Sink(), Sink()
        await app.router.handle(inbound("   ", mention=True), in_channel)  # "@Cora" alone, the mention stripped
        await app.router.handle(inbound("", dm=True), in_dm)  # a picture alone in a DM
        greeting = in_channel.public[0].text
        assert greeting.startswith("Hi, Cora here.") and "after the mention" in greeting and "!help" in greeting
        assert "after the mention" not in in_dm.public[0].text and "!help" in in_dm.public[0].text
        assert llm.requests == [] and await app.storage.get_channel("discord:chan1") is None


async def test_other_bots_commands_in_a_channel_get_no_answer(tmp_path: Path) -> None:
    """``!play`` in a channel is a music bot's: no "Unknown command" there. Asked of this bot (a DM, or
    with a mention) it still says what it knows; its own commands answer anywhere."""
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        sink = Sink()
        await app.router.handle(inbound("!play never gonna give you up"), sink)
        await app.router.handle(inbound("!"), sink)
        assert sink.public == [] and sink.private == [] and sink.messages == []
        await app.router.handle(inbound("!play it", mention=True), sink)
        await app.router.handle(inbound("!play it", dm=True), sink)
        assert [r.text for r in sink.public] == ["Unknown command `!play it`. Type !help."] * 2
        await app.router.handle(inbound("!HELP"), sink)
        await app.router.handle(inbound("!memory nonsense"), sink)
        assert sink.public[2].text.startswith("Commands:")
        assert "Unknown command !memory `nonsense`" in sink.public[3].text


def test_access_lists_need_ids_with_their_platform() -> None:
    """A bare id matches nobody: such a list would silently refuse (or let through) everyone."""
    from bot.config import AccessConfig

    for field, ids, says in [("allow_users", ["123456"], "write ids as platform:id"),
                             ("allow_channels", ["discord:general"], "a Discord id is a number"),
                             ("deny_users", ["slack:U1"], "write ids as platform:id"),
                             ("allow_servers", ["matrix: "], "write ids as platform:id")]:
        with pytest.raises(ValueError, match=says):
            AccessConfig(**{field: ids})
    ok = AccessConfig(allow_users=["discord:1", "matrix:@ann:example.org", "console:ann"],
                      allow_roles=["matrix:power:50"], allow_servers=["matrix:example.org"])
    assert ok.allow_users[2] == "console:ann"


async def test_an_unexpected_failure_gets_one_line_and_the_bot_goes_on(tmp_path: Path) -> None:
    """Not an outage of the model but a bug or a failing disk: the person is told in one line (before, the
    reply just stopped), and the next message is answered."""
    from bot.llm.base import Completion, LLMRequest

    def broken(request: LLMRequest) -> Completion:
        raise OSError("disk I/O error")

    llm = ScriptedProvider()
    llm.enqueue(broken)  # type: ignore[arg-type]
    async with App(_config(tmp_path), llm=llm) as app:
        sink = Sink()
        await app.router.handle(inbound("hi", dm=True), sink)
        assert [r.text for r in sink.public] == ["⚠️ Something went wrong on my side while answering (the details "
                                                 "are in the bot's log). Please try again in a moment."]
        sink = Sink()
        await app.router.handle(inbound("hi again", dm=True), sink)
        assert sink.messages == ["echo: hi again"]


async def test_a_threads_channel_lists_are_its_parent_channels(tmp_path: Path) -> None:
    """A thread or forum post of a denied channel was answered (its own id is on no list), one of an
    allowed channel refused, and "always answer" did not carry over."""
    def in_thread(text: str, parent: str, *, mention: bool = False) -> Inbound:
        message = IncomingMessage("discord", "309", "1", "user1", text, server_id="guild1",
                                  mentions_bot=mention, parent_channel_id=parent)
        return Inbound(message)

    async with App(_config(tmp_path, deny_channels=["discord:301"]), llm=ScriptedProvider()) as app:
        for line in ("@Cora hello", "!help"):
            sink = Sink()
            await app.router.handle(in_thread(line, "301", mention=True), sink)
            assert sink.messages == [] and sink.public == [], line
    async with App(_config(tmp_path / "b", allow_channels=["discord:302"],
                           always_answer_channels=["discord:302"]), llm=ScriptedProvider()) as app:
        sink = Sink()
        await app.router.handle(in_thread("hello without a mention", "302"), sink)
        assert sink.messages  # allowed, and answered without a mention like its channel
        other = Sink()
        await app.router.handle(in_thread("@Cora hi", "303", mention=True), other)
        assert other.messages == [] and other.public == []


async def test_a_database_held_by_another_process_is_said_as_such_to_the_person_and_in_one_log_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A write lock held elsewhere (a sqlite3 shell with a transaction open) gave "Something went wrong" and a
    driver's traceback naming neither the file nor what may hold it; commands said "(OperationalError)"."""
    import sqlite3

    import bot.storage.sqlite
    from bot.commands import CommandContext
    from bot.router import DATABASE_UNAVAILABLE

    monkeypatch.setattr(bot.storage.sqlite, "BUSY_TIMEOUT_MS", 200)
    ann = CommandContext("console", "console:ann", "Ann", "console:dm", "Cora", is_dm=True)
    hello = Inbound(IncomingMessage("console", "dm", "ann", "Ann", "hello", is_dm=True))
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        holder = sqlite3.connect(tmp_path / "bot.db", isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            sink = Sink()
            await app.router.handle(hello, sink)
            assert [r.text for r in sink.public] == [f"⚠️ {DATABASE_UNAVAILABLE}"]
            answer = (await app.commands.dispatch("!memory show memory", ann)).text
            assert "the bot's database cannot be used right now" in answer and "OperationalError" not in answer
        finally:
            holder.rollback()
            holder.close()
        logged = [r for r in caplog.records if "cannot be used right now" in r.getMessage()]
        assert len(logged) == 2 and all(r.exc_info is None for r in logged)
        assert f"the database sqlite:///{tmp_path / 'bot.db'} cannot be used right now: another process holds its " \
               "write lock" in logged[0].getMessage()
        sink = Sink()
        await app.router.handle(hello, sink)  # the lock released: the bot answers again
        assert sink.messages and not sink.public


async def test_the_label_of_a_speakers_turns_is_not_the_name_they_are_called_by(tmp_path: Path) -> None:
    """A group's turns are labelled with the author's user name or id ("Alice (@mallory)"): that label became
    their stored name, so their memory file began "# My memories of Alice (@mallory)", and a message made again
    from one (a reaction's command) was labelled twice."""
    from dataclasses import replace

    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        said = IncomingMessage("discord", "chan1", "7", "Alice", "hi all", server_id="guild1", mentions_bot=True,
                               author_handle="mallory")
        assert said.author_name == "Alice (@mallory)" and replace(said, text="again").author_name == said.author_name
        await app.router.handle(Inbound(said), Sink())
        user = await app.storage.get_user("discord:7")
        assert user is not None and user.display_name == "Alice"
        channel = await app.storage.get_channel("discord:chan1")
        assert channel is not None
        [stored] = [m for m in await app.storage.recent_messages(channel.id, 5) if m.role == "user"]
        assert stored.author_name == "Alice (@mallory)"  # (the turn's label, in the prompt and the summary)
        sink = Sink()
        await app.router.handle(Inbound(replace(said, text="!memory show memory")), sink)
        assert "# My memories of Alice\n" in sink.private[0].text, sink.private[0].text
