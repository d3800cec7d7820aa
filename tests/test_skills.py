"""Skills in a reply, end to end: the real ``anthropic`` and ``openai`` SDKs against the fake LLM server
scripting tool calls in a streamed chat; built-in skills, an HTTP skill against a local server, an MCP
server over stdio; permissions, limits, the bounded loop, failures that still end in a reply, the
audit, ``!skills`` and forget-me."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, tzinfo
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from bot.app import App
from bot.commands import CommandContext
from bot.config import ConfigError, parse_config
from bot.policy import Inbound
from bot.ports import IncomingMessage
from cortex.export import export_data
from cortex.skills.toolbox import sanitised
from tests.engines import db_url_for
from tests.fakes.llm_server import FakeLLMServer, FakeResponse, RecordedRequest
from tests.test_router import Sink

KEY_ENV = "CB_SKILLS_TEST_KEY"
FAKE_MCP = Path(__file__).parent / "fakes" / "mcp_server.py"
RAW_MCP = Path(__file__).parent / "fakes" / "raw_mcp_server.py"  # hand-written; offers fs.delete as fs_delete
ANN_DM = CommandContext("console", "console:ann", "Ann", "console:dm-ann", "Cora", is_dm=True)


def _config(tmp_path: Path, server: FakeLLMServer, provider: str = "anthropic", **skills: Any) -> Any:
    url = server.anthropic_url if provider == "anthropic" else server.openai_url
    return parse_config({
        "storage": {"url": db_url_for(tmp_path)},
        "llm": {"provider": provider, "base_url": url, "api_key_env": KEY_ENV, "max_retries": 0, "model": "m"},
        "cortex": {"context_limit": 1000}, "skills": skills,
    })


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "test-key")


def _msg(text: str, *, user: str = "ann", server: str | None = None) -> IncomingMessage:
    if server is None:
        return IncomingMessage("console", f"dm-{user}", user, user.title(), text, is_dm=True)
    return IncomingMessage("console", "room", user, user.title(), text, server_id=server)


GROUPS = "; in group channels when a message says remember that, remember this …)"  # (!skills list's note)


def tool_names(request: RecordedRequest) -> set[str]:
    return {t.get("name") or t["function"]["name"] for t in request.body.get("tools", [])}


def replies(server: FakeLLMServer) -> list[RecordedRequest]:
    return [r for r in server.completion_requests if "current_time" in tool_names(r)]


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_remember_in_a_reply_is_searchable_in_the_same_conversation(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str) -> None:
    async with App(_config(tmp_path, fake_llm, provider)) as app:
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "remember", {"content": "Ann's cat is called Miso"})],
                                                 text="Sure."),
                         FakeResponse.text("Noted: Miso it is!"))
        statuses: list[str] = []
        stream = app.core.reply(_msg("remember that my cat is called Miso"))

        async def status(line: str) -> None:
            statuses.append(line)

        stream.on_status = status
        assert await stream.text() == "Sure.\n\nNoted: Miso it is!"
        assert statuses == ["noting that…"]
        first, second = replies(fake_llm)[-2:]
        assert {"remember", "search_memory", "current_time"} <= tool_names(first)
        assert not tool_names(first) & {"read_soul", "edit_soul", "edit_guidelines"}  # Ann is no admin
        assert "remembered as item #" in str(second.body["messages"])
        found = (await app.commands.dispatch("!memory search Miso", ANN_DM)).text
        assert "Ann's cat is called Miso" in found
        audit = await app.storage.skills.recent("console:ann")
        assert [(a.skill, a.ok, a.triggered_by) for a in audit] == [("remember", True, "model")]
        stored = await app.storage.recent_messages((await app.storage.get_channel("console:dm-ann")).id, 5)
        assert [m.text for m in stored if m.role == "assistant"] == ["Sure.\n\nNoted: Miso it is!"]
        # the same words again (told twice): one item, and the model hears which one says them
        fake_llm.enqueue(FakeResponse.tool_calls([("c2", "remember", {"content": "Ann's cat is called Miso"})]),
                         FakeResponse.text("I knew."))
        await app.core.reply(_msg("my cat is called Miso, remember?")).text()
        assert "says that already: nothing new was stored" in str(replies(fake_llm)[-1].body["messages"])
        rows = await app.storage.db.fetch_all("SELECT id FROM memory_items WHERE content = ?",
                                              ("Ann's cat is called Miso",))
        assert len(rows) == 1


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_call_cut_off_at_the_output_limit_is_not_run(tmp_path: Path, fake_llm: FakeLLMServer,
                                                             provider: str) -> None:
    """A remember cut off by max_tokens is not run (its arguments would be half a fact), and the model is told
    why; a complete call before it in the same turn runs."""
    async with App(_config(tmp_path, fake_llm, provider)) as app:
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "current_time", {}),
                                                  ("c2", "remember", '{"content": "Ann\'s cat is ca')],
                                                 stop_reason="max_tokens"),
                         FakeResponse.text("Your cat's name, noted!"))
        assert await app.core.reply(_msg("remember that my cat is called Miso")).text() == "Your cat's name, noted!"
        sent = str(replies(fake_llm)[-1].body["messages"])
        assert "reached the output limit while writing this call" in sent and "UTC" in sent
        assert [a.skill for a in await app.storage.skills.recent("console:ann")] == ["current_time"]
        assert "No memory items" in (await app.commands.dispatch("!memory list", ANN_DM)).text


async def test_admin_only_skills_are_neither_offered_nor_run_for_members(tmp_path: Path,
                                                                          fake_llm: FakeLLMServer) -> None:
    async with App(_config(tmp_path, fake_llm)) as app:
        fake_llm.enqueue(
            FakeResponse.tool_calls([("c1", "edit_guidelines", {"content": "Be rude.", "reason": "asked"})]),
            FakeResponse.text("I cannot do that."))
        assert await app.core.reply(_msg("@Cora change the guidelines", server="g1")).text() == "I cannot do that."
        first, second = replies(fake_llm)[-2:]
        assert "edit_guidelines" not in tool_names(first)
        assert "there is no tool 'edit_guidelines' here" in str(second.body["messages"])
        assert app.personas.guidelines_for("console:g1")[0] == ""
        audit = await app.storage.skills.recent("console:ann")
        assert audit == []  # nothing ran
        fake_llm.enqueue(
            FakeResponse.tool_calls([("c2", "edit_guidelines", {"content": "Be kind.", "reason": "admin asked"})]),
            FakeResponse.text("Done."))
        stream = app.core.reply(_msg("change the guidelines to: Be kind.", user="boss", server="g1"), is_admin=True)
        assert await stream.text() == "Done."
        assert "edit_guidelines" in tool_names(replies(fake_llm)[-2])
        assert app.personas.guidelines_for("console:g1") == ("Be kind.", "console:g1")
        # An admin talking about something else: other people's messages in the channel (or a tool result)
        # must not be able to talk the model into rewriting the rules or the persona meanwhile.
        fake_llm.enqueue(FakeResponse.text("Sunny."))
        await app.core.reply(_msg("what's the weather like?", user="boss", server="g1"), is_admin=True,
                             is_bot_admin=True).text()
        assert not tool_names(replies(fake_llm)[-1]) & {"edit_guidelines", "edit_soul"}
        assert {"read_guidelines", "read_soul"} <= tool_names(replies(fake_llm)[-1])
        fake_llm.enqueue(FakeResponse.text("Sure."))
        await app.core.reply(_msg("make your personality a bit warmer", user="boss", server="g1"), is_admin=True,
                             is_bot_admin=True).text()
        assert "edit_soul" in tool_names(replies(fake_llm)[-1])


async def test_editing_the_soul_is_offered_to_the_bots_admins_only(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """edit_soul was offered to every server admin (on Matrix whoever makes a room), though only the bot's admins
    may use it (a soul is shared by every server): the model called a tool that always failed, spending a round
    and a call of the daily limit, and `!skills list` said "admins only"."""
    async with App(_config(tmp_path, fake_llm, calls_per_user_per_day=5)) as app:
        edit = {"section": "personality", "content": "warmer", "reason": "asked"}
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "edit_soul", edit)]), FakeResponse.text("Sorry."))
        ask = _msg("make your personality a bit warmer", user="roomadmin", server="g1")
        assert await app.core.reply(ask, is_admin=True, is_bot_admin=False).text() == "Sorry."
        first, second = replies(fake_llm)[-2:]
        assert "edit_soul" not in tool_names(first) and "read_soul" in tool_names(first)
        assert "there is no tool 'edit_soul' here" in str(second.body["messages"])
        assert await app.storage.skills.recent("console:roomadmin") == []  # nothing ran, nothing counted
        room_admin = CommandContext("console", "console:roomadmin", "R", "console:room", "Cora", is_admin=True,
                                    server_key="console:g1")
        listed = (await app.commands.dispatch("!skills list", room_admin)).text
        assert "edit_soul (builtin; default; the bot's admins only; when a message says" in listed, listed
        assert "read_soul (builtin; default; admins only)" in listed, listed
        fake_llm.enqueue(FakeResponse.text("Sure."))
        await app.core.reply(ask, is_admin=True, is_bot_admin=True).text()
        assert "edit_soul" in tool_names(replies(fake_llm)[-1])


async def test_an_admin_only_tool_from_the_config_is_for_the_bots_admins_only(
        tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """A configured tool reaches the operator's own systems (the README's example: a file server): "admin
    only" offered it to every server admin, and on Matrix whoever makes a room is one."""
    mcp = [{"name": "files", "command": [sys.executable, str(FAKE_MCP)], "tools": ["add"], "admin_only": True}]
    async with App(_config(tmp_path, fake_llm, provider="openai", mcp=mcp)) as app:
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "add", {"a": 2, "b": 3})]), FakeResponse.text("No."))
        room_admin = app.core.reply(_msg("what is 2 + 3?", server="g1"), is_admin=True)
        assert await room_admin.text() == "No."
        first, second = replies(fake_llm)[-2:]
        assert "add" not in tool_names(first) and "current_time" in tool_names(first)
        assert "there is no tool 'add' here" in str(second.body["messages"])
        fake_llm.enqueue(FakeResponse.tool_calls([("c2", "add", {"a": 2, "b": 3})]), FakeResponse.text("Five."))
        operator = app.core.reply(_msg("what is 2 + 3?", user="boss", server="g1"), is_admin=True, is_bot_admin=True)
        assert await operator.text() == "Five."
        assert "add" in tool_names(replies(fake_llm)[-2])
        listed = (await app.commands.dispatch("!skills", CommandContext(
            "console", "console:boss", "Boss", "console:room", "Cora", server_key="console:g1", is_admin=True,
            is_bot_admin=True))).text
        assert "the bot's admins only" in listed


async def test_limits_rounds_and_bad_calls_still_end_in_a_reply(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    async with App(_config(tmp_path, fake_llm, calls_per_user_per_day=1, max_rounds=2)) as app:
        fake_llm.enqueue(
            FakeResponse.tool_calls([("c1", "current_time", {}), ("c2", "current_time", {"timezone": "Mars/Base"}),
                                     ("c3", "search_memory", "{not json")]),
            FakeResponse.text("It is late."))
        assert await app.core.reply(_msg("what time is it?")).text() == "It is late."
        second = replies(fake_llm)[-1]
        text = str(second.body["messages"])
        assert "current_time was used 1 times for this person today" in text
        assert "needs a JSON object" in text
        assert second.body["tool_choice"] == {"type": "none"}  # the last round must answer in text
        audit = await app.storage.skills.recent("console:ann")
        assert sorted((a.skill, a.ok) for a in audit) == [("current_time", False), ("current_time", True),
                                                          ("search_memory", False)]


async def test_a_server_that_never_stops_calling_tools_gets_a_clear_answer(tmp_path: Path,
                                                                          fake_llm: FakeLLMServer) -> None:
    """Some compatible servers ignore tool_choice "none": the last round called tools again, and the user read
    that the answer "could not be read"; every round is still counted."""
    async with App(_config(tmp_path, fake_llm, provider="openai", max_rounds=2)) as app:
        fake_llm.responder = lambda request: FakeResponse.tool_calls([("c", "current_time", {})])
        sink = Sink()
        await app.router.handle(Inbound(_msg("what time is it?")), sink)
        said = " ".join([*sink.messages, *(m.text for m in (*sink.public, *sink.private))])
        assert "kept calling tools and wrote no answer" in said
        calls = await app.storage.list_llm_calls()
        assert calls[0]["error"] == "LLMNoAnswer" and calls[0]["input_tokens"] > 0
        assert len(replies(fake_llm)) == 2


@pytest_asyncio.fixture
async def slow_site() -> AsyncIterator[str]:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("wait", "0")))
        return web.json_response({"data": {"answer": 42}})

    async def odd(request: web.Request) -> web.Response:  # valid JSON whose string escapes a lone surrogate
        return web.Response(body=b'{"data": "caf\\ud800e and \\u0000 nul"}', content_type="application/json")

    application = web.Application()
    application.router.add_get("/answer", slow)
    application.router.add_get("/odd", odd)
    runner = web.AppRunner(application)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_an_http_skill_answers_and_a_timeout_becomes_a_tool_error(tmp_path: Path, fake_llm: FakeLLMServer,
                                                                        slow_site: str) -> None:
    http = [{"name": "lookup", "description": "Look it up.", "url": slow_site + "/answer", "timeout_seconds": 0.5,
             "result_path": "data.answer",
             "parameters": {"type": "object", "properties": {"wait": {"type": "number"}}}}]
    async with App(_config(tmp_path, fake_llm, http=http)) as app:
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "lookup", {"wait": 0})]), FakeResponse.text("42."),
                         FakeResponse.tool_calls([("c2", "lookup", {"wait": 3})]), FakeResponse.text("No luck."))
        assert await app.core.reply(_msg("look up the answer")).text() == "42."
        assert "{'type': 'tool_result', 'tool_use_id': 'c1', 'content': '42'}" in str(
            replies(fake_llm)[-1].body["messages"])
        assert await app.core.reply(_msg("and again, slowly")).text() == "No luck."
        assert "timed out after 0.5 s" in str(replies(fake_llm)[-1].body["messages"])
        audit = await app.storage.skills.recent("console:ann")
        assert [(a.skill, a.ok) for a in audit] == [("lookup", False), ("lookup", True)]


def _lookup_once_a_day(slow_site: str, wait: float
                       ) -> tuple[list[dict[str, Any]], Callable[[RecordedRequest], FakeResponse]]:
    """An HTTP skill ``lookup`` (its site answers after ``wait`` s) and a model that calls it, then says "Done."."""
    http = [{"name": "lookup", "description": "Look it up.", "url": slow_site + "/answer", "result_path": "data.answer",
             "parameters": {"type": "object", "properties": {"wait": {"type": "number"}}}}]

    def respond(request: RecordedRequest) -> FakeResponse:
        last = request.body["messages"][-1]
        if isinstance(last["content"], list) and any(b.get("type") == "tool_result" for b in last["content"]):
            return FakeResponse.text("Done.")
        return FakeResponse.tool_calls([("c", "lookup", {"wait": wait})])
    return http, respond


def _refusals(fake_llm: FakeLLMServer) -> int:
    return len([r for r in replies(fake_llm) if "lookup was used 1 times for this person today" in str(r.body)])


@pytest.mark.both_engines
async def test_the_daily_limit_holds_for_calls_made_at_once(tmp_path: Path, fake_llm: FakeLLMServer,
                                                             slow_site: str) -> None:
    """The limit was checked before a call ran and counted once it had: three replies at once (three chats of
    one user) each found no call yet and all ran a skill allowed once a day. Each call now counts first."""
    http, respond = _lookup_once_a_day(slow_site, 0.5)
    async with App(_config(tmp_path, fake_llm, http=http, calls_per_user_per_day=1)) as app:
        fake_llm.responder = respond
        chats = [IncomingMessage("console", f"dm-ann-{n}", "ann", "Ann", "look it up", is_dm=True) for n in range(3)]
        assert await asyncio.gather(*(app.core.reply(chat).text() for chat in chats)) == ["Done."] * 3
        audit = await app.storage.skills.recent("console:ann")
        assert sorted((a.skill, a.ok) for a in audit) == [("lookup", False), ("lookup", False), ("lookup", True)]
        assert _refusals(fake_llm) == 2


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_tool_result_with_a_lone_surrogate_still_ends_in_a_reply(
        tmp_path: Path, fake_llm: FakeLLMServer, slow_site: str, provider: str) -> None:
    """An outside API answering a lone surrogate (a JSON escape): building the next request failed with
    UnicodeEncodeError and the whole reply with it, reported as the model's "unreadable response"."""
    http = [{"name": "lookup", "description": "Look it up.", "url": slow_site + "/odd", "result_path": "data"}]
    async with App(_config(tmp_path, fake_llm, provider, http=http)) as app:
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "lookup", {})]), FakeResponse.text("Done."))
        assert await app.core.reply(_msg("look up the answer")).text() == "Done."
        sent = str(replies(fake_llm)[-1].body["messages"])
        assert "caf\ufffde and  nul" in sent
        assert [(a.skill, a.ok) for a in await app.storage.skills.recent("console:ann")] == [("lookup", True)]
    from bot.llm.base import ChatMessage

    assert ChatMessage("tool", "x\ud800\x00y").content == "x\ufffdy"  # whatever else fills a request


async def test_an_mcp_servers_tools_are_offered_and_called(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    mcp = [{"name": "calc", "command": [sys.executable, str(FAKE_MCP)], "tools": ["add"]}]
    async with App(_config(tmp_path, fake_llm, provider="openai", mcp=mcp)) as app:
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "add", {"a": 2, "b": 3})]), FakeResponse.text("Five."))
        assert await app.core.reply(_msg("what is 2 + 3?")).text() == "Five."
        first, second = replies(fake_llm)[-2:]
        assert "add" in tool_names(first) and "echo" not in tool_names(first)
        tool_message = [m for m in second.body["messages"] if m["role"] == "tool"]
        assert tool_message and tool_message[0]["content"].strip() == "5"


async def test_an_mcp_tools_calls_are_counted_under_server_and_tool(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """The audit and the daily limit kept an MCP tool's calls under its offered name, which changes when
    another server offers a tool of the same name ("add" becomes "calc_add"): the day's count restarted."""
    from bot.storage.skills import SkillExecution

    mcp = [{"name": "calc", "command": [sys.executable, str(FAKE_MCP)], "tools": ["add"]}]
    async with App(_config(tmp_path, fake_llm, provider="openai", mcp=mcp, calls_per_user_per_day=2)) as app:
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "add", {"a": 2, "b": 3})]), FakeResponse.text("Five."))
        assert await app.core.reply(_msg("what is 2 + 3?")).text() == "Five."
        assert [(a.skill, a.ok) for a in await app.storage.skills.recent("console:ann")] == [("calc/add", True)]
        # a call made while the tool was offered as "calc_add" (another server had an "add" then)
        await app.storage.skills.record(SkillExecution("calc/add", "Cora", "console:ann", "console:dm-ann", "", "{}",
                                                       True, "", 1, "model", time.time()))
        fake_llm.enqueue(FakeResponse.tool_calls([("c2", "add", {"a": 1, "b": 1})]), FakeResponse.text("Two."))
        assert await app.core.reply(_msg("and 1 + 1?")).text() == "Two."
        tool_message = [m for m in replies(fake_llm)[-1].body["messages"] if m["role"] == "tool"][-1]
        assert "add was used 2 times for this person today" in tool_message["content"]


async def test_an_mcp_tool_is_switched_by_the_name_skills_list_shows(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """The server files offers fs.delete, which the model APIs take only as fs_delete and `!skills list` shows so;
    `disabled = ["files/fs_delete"]`, as the README says (server/tool), was accepted and left it on: it ran.
    Switches were kept under the server's own spelling alone; the command took the offered name alone."""
    mcp = [{"name": "files", "command": [sys.executable, str(RAW_MCP)]}]
    root = CommandContext("console", "console:root", "Root", "console:dm-root", "Cora", is_admin=True,
                          is_bot_admin=True, is_dm=True)
    async with App(_config(tmp_path, fake_llm, provider="openai", mcp=mcp, disabled=["files/fs_delete"])) as app:
        async def listed() -> str:
            [line] = [x for x in (await app.commands.dispatch("!skills list", root)).text.splitlines() if "fs" in x]
            return line

        assert await listed() == "⛔ fs_delete (mcp files/fs_delete; config (disabled)): Delete a file."
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "fs_delete", {})]), FakeResponse.text("Could not."))
        await app.core.reply(_msg("delete it")).text()
        assert "fs_delete" not in tool_names(replies(fake_llm)[-2]) and "ok" in tool_names(replies(fake_llm)[-2])
        assert await app.storage.skills.recent("console:ann") == []  # it did not run
        for spelling, now in (("files/fs_delete", "on"), ("files/fs.delete", "off"), ("fs_delete", "on")):
            verb = "enable" if now == "on" else "disable"
            said = (await app.commands.dispatch(f"!skills {verb} {spelling} --everywhere", root)).text
            assert said.startswith(f"{spelling} is now {now} for Cora everywhere"), said
        assert await listed() == "✅ fs_delete (mcp files/fs_delete; bot-wide): Delete a file."
    async with App(_config(tmp_path / "raw", fake_llm, provider="openai", mcp=mcp, disabled=["files/fs.delete"])
                   ) as app:  # the server's own spelling still works
        fake_llm.enqueue(FakeResponse.text("Hi."))
        await app.core.reply(_msg("hi")).text()
        assert "fs_delete" not in tool_names(replies(fake_llm)[-1]) and "ok" in tool_names(replies(fake_llm)[-1])


async def test_a_channels_switch_holds_in_its_threads(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """A skill switched off for a channel was offered again in any thread of it: a member opened one."""
    async with App(_config(tmp_path, fake_llm)) as app:
        admin = CommandContext("console", "console:boss", "Boss", "console:room", "Cora", is_admin=True,
                               server_key="console:g1")
        assert "off" in (await app.commands.dispatch("!skills disable current_time --channel", admin)).text
        typo = (await app.commands.dispatch("!skills disable current_tim --channel", admin)).text
        assert "unknown skill `current_tim` (did you mean current_time?)" in typo
        fake_llm.enqueue(FakeResponse.text("Hi."), FakeResponse.text("Hello."))
        await app.core.reply(_msg("hi", server="g1")).text()
        offered = tool_names(fake_llm.completion_requests[-1])
        assert "current_time" not in offered and "search_memory" in offered
        thread = IncomingMessage("console", "thread9", "ann", "Ann", "hi", server_id="g1", parent_channel_id="room")
        await app.core.reply(thread).text()
        offered = tool_names(fake_llm.completion_requests[-1])
        assert "current_time" not in offered and "search_memory" in offered


async def test_a_skill_the_config_turns_off_is_switched_on_by_the_bots_admins_only(
        tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """`[skills] disabled` only set a default: a server admin (on Matrix, whoever makes a room) switched such a
    skill on with !skills enable, and the model was offered it in their room."""
    async with App(_config(tmp_path, fake_llm, disabled=["search_memory"])) as app:
        admin = CommandContext("console", "console:boss", "Boss", "console:room", "Cora", is_admin=True,
                               server_key="console:g1")
        for line in ("!skills enable search_memory", "!skills enable search_memory --channel"):
            refused = (await app.commands.dispatch(line, admin)).text
            assert "search_memory is off in the bot's config ([skills] disabled names it): only the bot's admins" \
                in refused
        info = next(s.info for s in app.skills.tools.all() if s.info.name == "search_memory")
        await app.skills.tools.policy.set("Cora", "server:console:g1", info, True)  # (stored by an older release)

        async def offered_in_g1() -> set[str]:
            fake_llm.enqueue(FakeResponse.text("Hi."))
            await app.core.reply(_msg("hi", server="g1")).text()
            return tool_names(fake_llm.completion_requests[-1])

        assert "search_memory" not in await offered_in_g1() and "current_time" in await offered_in_g1()
        root = CommandContext("console", "console:root", "Root", "console:dm-root", "Cora", is_admin=True,
                              is_bot_admin=True, is_dm=True)
        assert "search_memory is now on for Cora everywhere" in (
            await app.commands.dispatch("!skills enable search_memory --everywhere", root)).text
        assert "search_memory" in await offered_in_g1()
        assert "now off" in (await app.commands.dispatch("!skills disable search_memory", admin)).text
        assert "search_memory" not in await offered_in_g1()  # a server may still switch it off


async def test_in_a_group_the_persona_remembers_only_what_the_speaker_asks_it_to(
        tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """A room's guidelines (on Matrix, whoever makes a room writes them) could have the persona call `remember`
    for everyone who spoke there: "hello everyone" left a shared item in the speaker's memory, which follows them
    into their DMs. In a group channel the skill is offered only when the speaker's message asks for it."""
    async with App(_config(tmp_path, fake_llm)) as app:
        fake_llm.enqueue(*(FakeResponse.text("Hi.") for _ in range(4)))
        offered = []
        fake_llm.enqueue(*(FakeResponse.text("Hi.") for _ in range(2)))
        for message in (_msg("hello everyone", server="g1"), _msg("Please remember that I like tea", server="g1"),
                        _msg("Vergiss nicht: ich mag Tee", server="g1"), _msg("hello"),
                        _msg("don\u2019t forget my tea", server="g1"), _msg("I remember the old days", server="g1")):
            await app.core.reply(message).text()
            offered.append("remember" in tool_names(fake_llm.completion_requests[-1]))
        assert offered == [False, True, True, True, True, False]  # (a DM: always; a phone's apostrophe counts)
        listing = (await app.commands.dispatch("!skills list", CommandContext(
            "console", "console:boss", "Boss", "console:room", "Cora", is_admin=True, server_key="console:g1"))).text
        assert "in group channels when a message says remember that" in listing
        [line] = [x for x in listing.splitlines() if x.startswith("✅ remember")]  # a long description: cut at a
        assert line.endswith(" …") and len(line.split("): ", 1)[1]) <= 120, line  # word, and marked as cut


async def test_what_the_persona_remembers_where_dm_memory_was_in_the_prompt_stays_private(
        tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """In a group channel whose server lets DM memory into the prompt (``use_in_groups``), the model wrote what it
    remembered from that prompt as a shared item: "Ann is away on Friday for her cardiologist appointment", taken
    from her DMs, then entered the prompts of every group channel she spoke in, where DM memory is kept out. It is
    private there, as the cortex update's items are, and search_memory finds it there."""
    async with App(_config(tmp_path, fake_llm)) as app:
        root = CommandContext("console", "console:root", "Root", "console:room", "Cora", is_admin=True,
                              is_bot_admin=True, server_key="console:g1")
        assert "on" in (await app.commands.dispatch("!cortex settings use_in_groups on", root)).text
        await app.commands.dispatch("!memory remember I see a cardiologist about my heart", ANN_DM)
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "remember", {
            "content": "Ann is away on Friday for her cardiologist appointment"})]), FakeResponse.text("Noted."),
            FakeResponse.tool_calls([("c2", "search_memory", {"query": "Friday"})]), FakeResponse.text("Friday."))
        await app.core.reply(_msg("remember that I am away on Friday", server="g1")).text()
        await app.core.reply(_msg("when am I away? remember that?", server="g1")).text()
        assert "away on Friday for her cardiologist" in str(replies(fake_llm)[-1].body["messages"])
        listed = (await app.commands.dispatch("!memory list", ANN_DM)).text
        assert "away on Friday" in listed and "(shared) Ann is away" not in listed, listed
        fake_llm.enqueue(FakeResponse.tool_calls([("c3", "remember", {"content": "Ann likes tea"})]),
                         FakeResponse.text("Tea!"), FakeResponse.text("Hi."))
        await app.core.reply(_msg("remember that I like tea", server="g2")).text()  # (DM memory kept out there)
        assert "(shared) Ann likes tea" in (await app.commands.dispatch("!memory list", ANN_DM)).text
        await app.core.reply(_msg("am I away on Friday?", server="g2")).text()
        assert "cardiologist" not in str(replies(fake_llm)[-1].body)


async def test_skills_commands_switch_per_server_and_forget_me_removes_the_audit(
        tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    async with App(_config(tmp_path, fake_llm)) as app:
        admin = CommandContext("console", "console:boss", "Boss", "console:room", "Cora", is_admin=True,
                               server_key="console:g1")
        member = CommandContext("console", "console:ann", "Ann", "console:room", "Cora", server_key="console:g1")
        listing = (await app.commands.dispatch("!skills list", admin)).text
        assert "✅ remember (builtin; default" + GROUPS in listing
        assert (await app.commands.dispatch("!skills disable remember", member)).text == \
            "!skills disable is for admins only."
        assert "remember is now off for Cora in this server" in (
            await app.commands.dispatch("!skills disable remember", admin)).text
        assert "⛔ remember (builtin; this server" + GROUPS in (await app.commands.dispatch("!skills list", admin)).text
        fake_llm.enqueue(FakeResponse.text("Hi."), FakeResponse.text("Hello."))
        await app.core.reply(_msg("hi", server="g1")).text()
        assert "remember" not in tool_names(replies(fake_llm)[-1])
        await app.core.reply(_msg("hi")).text()  # a DM is not that server
        assert "remember" in tool_names(replies(fake_llm)[-1])
        assert "everywhere" in (await app.commands.dispatch("!skills enable remember --everywhere", admin)).text \
            and "bot's admins" in (await app.commands.dispatch("!skills enable remember --everywhere", admin)).text
        both = (await app.commands.dispatch("!skills enable remember --channel --everywhere", admin)).text
        assert "choose one of --channel and --everywhere" in both
        assert "which skill?" in (await app.commands.dispatch("!skills enable", admin)).text
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "current_time", {})]), FakeResponse.text("Noon."))
        await app.core.reply(_msg("time?")).text()
        assert "bot's admins only" in (await app.commands.dispatch("!skills stats", admin)).text  # bot-wide
        root = CommandContext("console", "console:root", "Root", "console:dm-root", "Cora", is_admin=True,
                              is_bot_admin=True, is_dm=True)
        stats = await app.commands.dispatch("!skills stats", root)
        assert "current_time: 1 calls, 0 failed" in stats.text
        assert stats.private  # (as !cortex stats: a skill's last error may quote what a DM's call carried)
        exported = await export_data(app.cortex.store, await app.storage.get_user("console:ann"))
        calls = [(c["skill"], c["ok"], c["arguments"]) for c in exported["skill_calls"]]
        assert calls == [("current_time", True, "{}")]
        assert "current_time: 1 calls" in (await app.commands.dispatch("!cortex stats", root)).text
        await app.commands.dispatch("!memory forget-me", ANN_DM)
        await app.commands.dispatch("!memory forget-me confirm", ANN_DM)
        assert await app.storage.skills.recent("console:ann") == []


async def test_a_switch_can_be_reset_and_a_bot_wide_one_names_what_still_overrides_it(
        tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """Once a server had switched a skill, nobody could make it follow the bot-wide value again, and a
    bot admin's "off everywhere" said so while that server kept it on."""
    async with App(_config(tmp_path, fake_llm)) as app:
        admin = CommandContext("console", "console:boss", "Boss", "console:room", "Cora", is_admin=True,
                               server_key="console:g1")
        root = CommandContext("console", "console:root", "Root", "console:room", "Cora", is_admin=True,
                              is_bot_admin=True, server_key="console:g1")

        async def say(line: str, who: CommandContext = admin) -> str:
            return (await app.commands.dispatch(line, who)).text

        await say("!skills disable remember")
        await say("!skills enable remember")
        everywhere = await say("!skills disable remember --everywhere", root)
        assert "off for Cora everywhere" in everywhere and "server:console:g1" in everywhere
        assert "!skills reset remember" in everywhere
        assert "✅ remember (builtin; this server" + GROUPS in await say("!skills list")
        assert await say("!skills reset remember") == (
            "remember has no switch of its own for Cora in this server any more; here it is off (bot-wide).")
        assert "⛔ remember (builtin; bot-wide" + GROUPS in await say("!skills list")
        assert "had no switch of its own" in await say("!skills reset remember")
        assert "no switch of its own for Cora everywhere any more; here it is on (default)" in await say(
            "!skills reset remember --everywhere", root)
        assert "bot's admins" in await say("!skills reset remember --everywhere")
        assert "!skills reset is for admins only." == await say(
            "!skills reset remember", CommandContext("console", "console:ann", "Ann", "console:room", "Cora",
                                                     server_key="console:g1"))
        fake_llm.enqueue(FakeResponse.text("Hi."))
        await app.core.reply(_msg("hi, remember that I like tea", server="g1")).text()  # (a group: when asked)
        assert "remember" in tool_names(replies(fake_llm)[-1])  # back to the default: offered again


async def test_an_incognito_stretch_offers_no_memory_writes(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    async with App(_config(tmp_path, fake_llm)) as app:
        assert (await app.commands.dispatch("!memory pause", ANN_DM)).text.startswith("Incognito with Cora since")
        fake_llm.enqueue(FakeResponse.text("Hi."))
        await app.core.reply(_msg("remember that I like plums")).text()
        offered = tool_names(replies(fake_llm)[-1])
        assert "remember" not in offered and "search_memory" in offered
        # nor an admin's soul and guidelines tools (a privacy auditor's finding: paused words outlived the stretch)
        ask = _msg("make your personality and the guidelines more formal")
        fake_llm.enqueue(FakeResponse.text("Hi."))
        await app.core.reply(ask, is_admin=True, is_bot_admin=True).text()
        offered = tool_names(replies(fake_llm)[-1])
        assert not {"edit_soul", "edit_guidelines"} & set(offered) and "read_soul" in offered, offered
        await app.commands.dispatch("!memory resume", ANN_DM)
        fake_llm.enqueue(FakeResponse.text("Hi."))
        await app.core.reply(ask, is_admin=True, is_bot_admin=True).text()
        assert {"edit_soul", "edit_guidelines"} <= set(tool_names(replies(fake_llm)[-1]))


async def test_a_missing_secret_of_an_http_skill_stops_the_start_with_one_clear_line(
        tmp_path: Path, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CB_SKILLS_MISSING_KEY", raising=False)
    http = [{"name": "weather", "description": "Weather.", "url": "https://example.invalid/{city}",
             "headers_env": {"X-Api-Key": "CB_SKILLS_MISSING_KEY"}}]
    with pytest.raises(ConfigError, match=r"\[\[skills.http\]\] 'weather': .*CB_SKILLS_MISSING_KEY") as caught:
        await App(_config(tmp_path, fake_llm, http=http)).start()
    assert str(caught.value).count("[[skills.http]]") == 1


async def test_a_missing_secret_of_an_mcp_server_stops_the_start_with_one_clear_line(
        tmp_path: Path, fake_llm: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """As for an HTTP skill: the server started without its secret (a warning in the log) and failed every call."""
    monkeypatch.delenv("CB_SKILLS_MISSING_KEY", raising=False)
    mcp = [{"name": "db", "command": ["true"], "env_from": {"PGPASSWORD": "CB_SKILLS_MISSING_KEY"}}]
    with pytest.raises(ConfigError, match=r"^\[\[skills.mcp\]\] 'db': environment variable CB_SKILLS_MISSING_KEY "
                       r"\(for env_from PGPASSWORD\) is not set$"):
        await App(_config(tmp_path, fake_llm, mcp=mcp)).start()
    http = [{"name": "weather", "description": "the weather", "url": "https://example.org/w",
             "headers_env": {"X-Key": "CB_SKILLS_MISSING_KEY"}}]
    async with App(_config(tmp_path / "off", fake_llm, enabled=False, mcp=mcp, http=http)) as app:  # skills off:
        assert app.skills.mcp is None and app.skills.http == []  # nothing built, no secret asked for


def test_the_audit_hides_a_secret_and_the_credential_inside_it() -> None:
    recorded = sanitised({"q": "use abcdefghij please", "n": 3}, ("Bearer abcdefghij",))
    assert recorded == '{"q": "use *** please", "n": 3}'



async def test_the_configs_built_in_names_are_the_built_in_skills(tmp_path: Path, fake_llm: FakeLLMServer,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """And a tool of an MCP server named like one of them is not offered, which the log says once."""
    from bot.config import BUILTIN_SKILLS
    from cortex.skills.base import SkillInfo
    from cortex.skills.toolbox import SkillTools

    async with App(_config(tmp_path, fake_llm)) as app:
        builtins = [s for s in app.skills.tools.all() if s.info.origin == "builtin"]
        assert {s.info.name for s in builtins} == set(BUILTIN_SKILLS)

        class Clash:
            info = SkillInfo("current_time", "d", {}, "mcp", server="clock", tool="current_time")

        tools = SkillTools(app.config.skills, app.storage, [lambda: builtins, lambda: [Clash()]])
        with caplog.at_level("WARNING", logger="cortex.skills.toolbox"):
            for _ in range(3):
                assert [s.info.origin for s in tools.all() if s.info.name == "current_time"] == ["builtin"]
        warned = [r.getMessage() for r in caplog.records if "not offered" in r.getMessage()]
        assert warned == ["skill current_time (mcp clock) is not offered: a builtin skill has that name"]


async def test_an_unreachable_mcp_server_is_named_to_admins_and_why_only_to_the_bots_admins(tmp_path: Path) -> None:
    """`!skills list` left a server that cannot start out (its tools seemed never configured); when it came
    to name it, a room's admin would have read the operator's paths and URLs in the reason."""
    from tests.fakes.provider import ScriptedProvider

    hidden = tmp_path / "operator-only" / "bin" / "mcp-srv"
    config = parse_config({"storage": {"url": db_url_for(tmp_path)}, "memory": {"embedder": "none"},
                           "skills": {"mcp": [{"name": "files", "command": [str(hidden)]}]}})
    async with App(config, llm=ScriptedProvider()) as app:
        room_admin = CommandContext("discord", "discord:5", "Eve", "discord:chan", "Cora", is_admin=True,
                                    is_bot_admin=False, server_key="discord:guild")
        bot_admin = CommandContext("discord", "discord:1", "Root", "discord:dm-1", "Cora", is_admin=True,
                                   is_bot_admin=True, is_dm=True)
        shown = (await app.commands.dispatch("!skills list", room_admin)).text
        assert "⚠️ MCP server files is not reachable; its tools come back once it answers" in shown
        assert "operator-only" not in shown
        assert str(hidden) in (await app.commands.dispatch("!skills list", bot_admin)).text


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_server_offering_hundreds_of_tools_cannot_crowd_out_the_reply(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str, caplog: pytest.LogCaptureFixture) -> None:
    """Every offered tool goes into every model call: 600 of them (OpenAI takes 128; ~600,000 characters of
    definitions overflow a context) made every reply fail. The built-ins stay; the flood is cut, and logged.
    One server's tools are taken up to 256 (thousands cost every reply the time to weigh them)."""
    from cortex.skills.mcp import MAX_SERVER_TOOLS

    mcp = [{"name": "flood", "command": [sys.executable, str(FAKE_MCP), "--tools", "600"]}]
    with caplog.at_level("WARNING", logger="cortex.skills.mcp"):
        async with App(_config(tmp_path, fake_llm, provider=provider, mcp=mcp)) as app:
            flood = [t for t in app.skills.tools.all() if t.info.server == "flood"]
            assert len(flood) == MAX_SERVER_TOOLS == 256
            assert any("offers 6" in r.getMessage() and "the first 256 are taken" in r.getMessage()
                       for r in caplog.records)
            fake_llm.enqueue(FakeResponse.text("Hello."))
            with caplog.at_level("WARNING", logger="cortex.skills.toolbox"):
                assert await app.core.reply(_msg("hi")).text() == "Hello."
            tools = replies(fake_llm)[-1].body["tools"]
            assert len(tools) <= 128 and len(json.dumps(tools)) <= 250_000
            assert {"remember", "search_memory", "current_time", "add"} <= tool_names(replies(fake_llm)[-1])
            assert any("(mcp flood) is not offered" in r.getMessage() for r in caplog.records)
            assert not any(t.info.name >= "tool_0256" for t in flood)  # (the rest of the list was never taken)


@pytest.mark.both_engines
async def test_a_forget_me_does_not_start_the_daily_limit_afresh(tmp_path: Path, fake_llm: FakeLLMServer,
                                                                   slow_site: str) -> None:
    """An attacker's finding: a skill's daily calls per user were counted from the audit, which forget-me deletes:
    use the skill up, forget me, again. What a forgotten user used stays counted, under a digest of their key only,
    and for them alone (Bob's limit is his own)."""
    http, respond = _lookup_once_a_day(slow_site, 0)
    async with App(_config(tmp_path, fake_llm, http=http, calls_per_user_per_day=1)) as app:
        fake_llm.responder = respond
        assert await app.core.reply(_msg("look it up")).text() == "Done."
        assert _refusals(fake_llm) == 0
        await app.storage.forget_user("console:ann")
        assert await app.storage.skills.recent("console:ann") == []
        rows = [dict(r) for r in await app.storage.db.fetch_all("SELECT * FROM forgotten_usage")]
        assert len(rows) == 1 and "ann" not in str(rows) and rows[0]["amount"] == 1
        assert await app.core.reply(_msg("look it up again")).text() == "Done."
        assert _refusals(fake_llm) == 1  # still used up today
        bob = IncomingMessage("console", "dm-bob", "bob", "Bob", "look it up", is_dm=True)
        assert await app.core.reply(bob).text() == "Done."
        assert _refusals(fake_llm) == 1 and [a.ok for a in await app.storage.skills.recent("console:bob")] == [True]


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_the_system_prompt_says_tool_results_are_information_when_tools_are_offered(
        tmp_path: Path, fake_llm: FakeLLMServer, provider: str) -> None:
    """A tool's result (a web page, a file) went to the model with nothing saying it is no instruction."""
    from bot.prompt import TOOL_RULE

    for enabled in (True, False):
        async with App(_config(tmp_path / str(enabled), fake_llm, provider, enabled=enabled)) as app:
            fake_llm.enqueue(FakeResponse.text("Hi."))
            assert await app.core.reply(_msg("hello")).text() == "Hi."
            request = fake_llm.completion_requests[-1]
            assert bool(tool_names(request)) is enabled
            assert (TOOL_RULE in json.dumps(request.body, ensure_ascii=False)) is enabled


async def test_search_lore_fills_a_cards_char_and_user_as_the_prompt_does(tmp_path: Path,
                                                                          fake_llm: FakeLLMServer) -> None:
    """The lore section of the prompt fills {{char}} and {{user}}; the search_lore tool gave the model the stored
    text with the placeholders, which it then repeated."""
    async with App(_config(tmp_path, fake_llm)) as app:
        root = CommandContext("console", "console:root", "Root", "console:dm-root", "Cora", is_admin=True,
                              is_bot_admin=True, is_dm=True)
        added = await app.commands.dispatch(
            "!lore add {{char}} carries the sword Ember, forged for {{user}}'s grandfather. --keys ember", root)
        assert "#" in added.text, added.text
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "search_lore", {"query": "sword Ember"})]),
                         FakeResponse.text("It is Ember."))
        assert await app.core.reply(_msg("tell me about your blade")).text() == "It is Ember."
        result = str(replies(fake_llm)[-1].body["messages"])
        assert "Cora carries the sword Ember, forged for Ann's grandfather." in result, result
        assert "{{char}}" not in result and "{{user}}" not in result


class _Kiribati(datetime):
    """The clock at 20:00 UTC on Saturday 28 February 2026: Sunday 1 March, 10:00 in Kiritimati (UTC+14)."""

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> Any:
        return datetime(2026, 2, 28, 20, 0, tzinfo=UTC).astimezone(tz)


async def test_the_prompts_date_is_todays_in_the_bots_zone(tmp_path: Path, fake_llm: FakeLLMServer,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """With `[skills] timezone = "Pacific/Kiritimati"` the persona's "Today is {date}" said Saturday 28 February
    (UTC's date) while current_time, asked in the same reply, said Sunday 1 March: the model was told two dates
    (and the memory items' dates were UTC's)."""
    monkeypatch.setattr("bot.conversation.datetime", _Kiribati)
    async with App(_config(tmp_path, fake_llm, timezone="Pacific/Kiritimati")) as app:
        # A pinned item remembered a minute earlier is dated in that zone too: not "yesterday" beside "today".
        app.cortex.memory.clock = lambda: _Kiribati.now().timestamp() - 60
        await app.commands.dispatch("!memory remember I moved to Kiribati --pin", ANN_DM)
        fake_llm.enqueue(FakeResponse.tool_calls([("c1", "current_time", {})]), FakeResponse.text("Sunday!"))
        assert await app.core.reply(_msg("what day is it?")).text() == "Sunday!"
        first, second = replies(fake_llm)[-2:]
        assert "Today is Sunday, 01 March 2026." in str(first.body["system"])
        assert "I moved to Kiribati (fact, 2026-03-01, pinned)" in str(first.body["system"])
        assert "Sunday, 01 March 2026, 10:00 (Pacific/Kiritimati, UTC+1400)" in str(second.body["messages"])
