"""MCP skills against a real MCP server (tests/fakes/mcp_server.py) over stdio and streamable HTTP."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

import cortex.skills.mcp as mcp_module
from bot.config import McpServerConfig
from cortex.skills.base import SkillContext, SkillResult
from cortex.skills.mcp import McpOptions, McpServer, McpSkills, McpTool
from cortex.skills.policy import Effective

pytestmark = pytest.mark.asyncio(loop_scope="module")

FAKE = Path(__file__).parent / "fakes" / "mcp_server.py"
RAW = Path(__file__).parent / "fakes" / "raw_mcp_server.py"  # a hand-written server that misbehaves
FAST = McpOptions(backoff_initial=0.2, backoff_max=1.0, connect_timeout=20.0)
SECRET = "s3cret-value-for-mcp"
CONTEXT = SkillContext(user_db_id=1, user_key="u", user_name="U", persona="p", channel_key="c", server_key=None,
                       is_dm=True, is_admin=False, now=datetime.now(UTC))


def stdio_config(name: str = "fake", **fields: Any) -> McpServerConfig:
    return McpServerConfig(name=name, command=[sys.executable, str(FAKE)], **fields)


def raw_config(name: str = "raw", **fields: Any) -> McpServerConfig:
    return McpServerConfig(name=name, command=[sys.executable, str(RAW)], **fields)


def by_name(tools: list[McpTool]) -> dict[str, McpTool]:
    return {tool.info.name: tool for tool in tools}


async def eventually(condition: Any, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def server_pid(server: McpServer) -> int:
    result = await server.call("pid", {})
    assert not result.is_error, result.content
    return int(result.content)


@pytest.fixture(scope="module")
def secret_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CORTEX_TEST_MCP_SECRET", SECRET)
        yield


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fake(secret_env: None) -> AsyncIterator[McpServer]:
    """One stdio server shared by the tests that do not break it."""
    config = stdio_config(timeout_seconds=1.0, env={"PLAIN": "plain"},
                          env_from={"TOKEN": "CORTEX_TEST_MCP_SECRET"}, admin_only=True, triggers=["math"])
    server = McpServer(config, FAST)
    await server.start()
    yield server
    await server.aclose()


async def test_stdio_round_trip(fake: McpServer) -> None:
    assert fake.up
    tools = by_name(fake.tools)
    assert {"add", "echo", "slow", "fail", "crash", "pid"} <= tools.keys()
    add = tools["add"]
    assert add.info.origin == "mcp" and add.info.server == "fake"
    assert add.info.description == "Add two integers."
    assert add.info.input_schema["required"] == ["a", "b"]
    assert add.info.admin_only and add.info.triggers == ("math",)
    assert await add.run({"a": 2, "b": 3}, CONTEXT) == SkillResult("5")
    assert await tools["echo"].run({"text": "hé ho"}, CONTEXT) == SkillResult("hé ho")


async def test_a_servers_tools_are_offered_within_bounds(fake: McpServer) -> None:
    """A server writes its tools' descriptions and schemas, and both go into every request: a long
    description is cut, a tool with a huge schema is not offered."""
    from cortex.skills.mcp import MAX_DESCRIPTION_CHARS

    tools = by_name(fake.tools)
    described = tools["rambling"].info.description
    assert len(described) == MAX_DESCRIPTION_CHARS + 1 and described.endswith("…")
    assert "sprawling" not in tools and "echo" in tools


async def test_env_and_env_from_reach_stdio_server(fake: McpServer) -> None:
    # The server has the secret (it answers exactly that value), but what it answers is redacted.
    assert (await fake.call("env", {"name": "TOKEN"})).content == "[redacted]"
    assert (await fake.call("env", {"name": "PLAIN"})).content == "plain"
    # The bot's own environment is not passed on wholesale.
    assert (await fake.call("env", {"name": "CORTEX_TEST_MCP_SECRET"})).content == "<unset>"


async def test_a_servers_secrets_never_come_back_from_it(fake: McpServer) -> None:
    """An MCP server may echo its own token (in a result or an error): that text goes to the model, the
    audit and the log, so every env_from / headers_env value is replaced; the tools' audits hide it too."""
    echoed = await fake.call("echo", {"text": f"your key is {SECRET}, and Bearer {SECRET}"})
    assert echoed == SkillResult("your key is [redacted], and Bearer [redacted]")
    refused = await fake.call("refuse_with", {"name": "TOKEN"})
    assert refused.is_error and "the token [redacted] was refused" in refused.content
    assert SECRET not in refused.content
    assert all(tool.info.secrets == (SECRET,) for tool in fake.tools)
    assert (await fake.call("env", {"name": "PLAIN"})).content == "plain"  # config values are not secrets


async def test_tool_error_is_an_error_result(fake: McpServer) -> None:
    result = await fake.call("fail", {})
    assert result.is_error
    assert "this tool always fails" in result.content
    unknown = await fake.call("no_such_tool", {})
    assert unknown.is_error


async def test_timeout_then_session_still_usable(fake: McpServer) -> None:
    started = time.monotonic()
    result = await fake.call("slow", {"seconds": 5})
    assert result.is_error and "did not answer within 1 s" in result.content
    assert time.monotonic() - started < 3
    assert fake.up
    assert await fake.call("add", {"a": 1, "b": 1}) == SkillResult("2")


async def test_non_text_parts_are_described(fake: McpServer) -> None:
    assert await fake.call("picture", {}) == SkillResult("a caption\n[image]")


async def test_tools_list_changed_lists_again(fake: McpServer) -> None:
    assert "extra" not in by_name(fake.tools)
    assert await fake.call("grow", {}) == SkillResult("grown")
    await eventually(lambda: "extra" in by_name(fake.tools), 10)
    assert await by_name(fake.tools)["extra"].run({}, CONTEXT) == SkillResult("extra!")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def wait_for_port(port: int, process: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + 20
    while True:
        assert process.returncode is None, "the HTTP server exited"
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            assert time.monotonic() < deadline, "the HTTP server did not listen in time"
            await asyncio.sleep(0.05)
            continue
        writer.close()
        await writer.wait_closed()
        return


class HttpServer:
    """The fake server over streamable HTTP, as a subprocess on a free port (restartable on that port)."""

    def __init__(self, *options: str) -> None:
        self.options = options
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(sys.executable, str(FAKE), "--http", str(self.port),
                                                              *self.options)
        await wait_for_port(self.port, self.process)

    async def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            await self.process.wait()
            self.process = None


@pytest_asyncio.fixture(loop_scope="module")
async def http_server() -> AsyncIterator[HttpServer]:
    server = HttpServer()
    try:
        await server.start()
        yield server
    finally:
        await server.stop()


async def test_http_round_trip(http_server: HttpServer, secret_env: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    config = McpServerConfig(name="web", url=http_server.url, headers_env={"X-Api-Key": "CORTEX_TEST_MCP_SECRET"})
    server = McpServer(config, FAST)
    try:
        await server.start()
        assert server.up
        tools = by_name(server.tools)
        assert await tools["add"].run({"a": 20, "b": 22}, CONTEXT) == SkillResult("42")
        assert (await server.call("fail", {})).is_error
        assert SECRET not in caplog.text  # the header's value is never logged
        # The header reached the server (it answers exactly its value), and the answer is redacted.
        assert await server.call("header", {"name": "x-api-key"}) == SkillResult("[redacted]")
        assert await server.call("header", {"name": "host"}) != SkillResult("[redacted]")
    finally:
        await server.aclose()


async def test_a_header_secret_mounted_with_a_line_break_still_connects_and_is_never_shown(
        http_server: HttpServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A secret from a file ends in a line break: the header was refused with its value quoted escaped (past the
    redaction of its raw value), in the "is down" warning every retry and in !skills list, and the server never
    connected. A line break inside the value is refused at start, naming the variable."""
    caplog.set_level(logging.INFO)  # (the SDK's DEBUG lines show what the server answered: held at INFO in a bot)
    monkeypatch.setenv("CB_TEST_MCP_FILE_KEY", "mcp-key-7f3a9c2e11d04b\n")
    config = McpServerConfig(name="web", url=http_server.url, headers_env={"X-Api-Key": "CB_TEST_MCP_FILE_KEY"})
    server = McpServer(config, FAST)
    try:
        await server.start()
        assert server.up and not server.last_error
        assert await server.call("header", {"name": "x-api-key"}) == SkillResult("[redacted]")
    finally:
        await server.aclose()
    assert "7f3a9c2e11d04b" not in caplog.text
    monkeypatch.setenv("CB_TEST_MCP_FILE_KEY", "mcp-key\nX-Other: 1")
    with pytest.raises(ValueError, match=r"CB_TEST_MCP_FILE_KEY \(for header X-Api-Key\) holds a line break") as bad:
        McpServer(config, FAST)
    assert "mcp-key" not in str(bad.value)


async def test_http_server_restart_reconnects(http_server: HttpServer) -> None:
    server = McpServer(McpServerConfig(name="web", url=http_server.url), FAST)
    try:
        await server.start()
        assert await server.call("add", {"a": 1, "b": 1}) == SkillResult("2")
        await http_server.stop()
        lost = await server.call("add", {"a": 1, "b": 1})
        assert lost == SkillResult("the web server is not reachable right now", is_error=True)
        assert not server.up
        await http_server.start()
        await eventually(lambda: server.up)
        assert await server.call("add", {"a": 2, "b": 2}) == SkillResult("4")
    finally:
        await server.aclose()


async def test_a_json_answer_past_the_cap_is_an_error_result_not_a_full_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server answering with one JSON body (not an event stream, whose events the SDK caps) is read only up
    to MAX_JSON_RESPONSE_BYTES: past it the call answers an error result, and the session goes on."""
    monkeypatch.setattr(mcp_module, "MAX_JSON_RESPONSE_BYTES", 1 << 20)
    http = HttpServer("--json")
    await http.start()
    server = McpServer(McpServerConfig(name="web", url=http.url), FAST)
    try:
        await server.start()
        assert await server.call("flood", {"size": 400_000}) == SkillResult("x" * 400_000)  # (twice: text, structure)
        flooded = await server.call("flood", {"size": 3_000_000})
        assert flooded.is_error and "larger than 1 MB" in flooded.content
        assert await server.call("add", {"a": 2, "b": 3}) == SkillResult("5")
        assert await server.call("header", {"name": "accept-encoding"}) == SkillResult("identity")  # (no gzip)
    finally:
        await server.aclose()
        await http.stop()


async def test_a_compressed_json_answer_is_refused_not_unpacked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap counted the bytes on the wire: a 194 KB gzip body unpacked to 200 MB past it. The client asks
    for plain bodies, and a JSON answer compressed anyway is refused before anything is unpacked; a plain one is
    read up to the cap (over a real HTTP connection on loopback)."""
    import gzip

    import httpx2
    from aiohttp import web

    monkeypatch.setattr(mcp_module, "MAX_JSON_RESPONSE_BYTES", 1 << 20)
    asked: list[str] = []
    body = b'{"jsonrpc": "2.0", "id": 1, "result": "' + b"x" * 3_000_000 + b'"}'

    async def answer(request: web.Request) -> web.Response:
        asked.append(request.headers.get("Accept-Encoding", ""))
        if request.path == "/gzip":
            return web.Response(body=gzip.compress(body), content_type="application/json",
                                headers={"Content-Encoding": "gzip"})
        return web.Response(body=body if request.path == "/big" else b'{"ok": 1}', content_type="application/json")

    app = web.Application()
    app.router.add_get("/{name}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with httpx2.AsyncClient(headers={"Accept-Encoding": "identity"},
                                      event_hooks={"response": [mcp_module.cap_json_answers]}) as client:
            assert (await client.get(f"{base}/small")).json() == {"ok": 1}
            for path, said in (("/gzip", "came compressed"), ("/big", "larger than 1 MB")):
                with pytest.raises(mcp_module.ResponseTooLarge, match=said):
                    await client.get(f"{base}{path}")
    finally:
        await runner.cleanup()
    assert asked == ["identity"] * 3


async def test_tools_filter_and_name_clash() -> None:
    skills = McpSkills([stdio_config("alpha", tools=["add", "echo"]), stdio_config("beta", tools=["add", "pid"])],
                       FAST)
    try:
        await skills.start()
        alpha, beta = skills.servers
        assert {tool.original_name for tool in alpha.tools} == {"add", "echo"}
        assert {tool.original_name for tool in beta.tools} == {"add", "pid"}
        offered = by_name(skills.skills())
        assert offered.keys() == {"alpha_add", "beta_add", "echo", "pid"}
        assert offered["alpha_add"].info.server == "alpha" and offered["beta_add"].info.server == "beta"
        assert await offered["alpha_add"].run({"a": 1, "b": 2}, CONTEXT) == SkillResult("3")
        assert await offered["beta_add"].run({"a": 3, "b": 4}, CONTEXT) == SkillResult("7")
        refused = await alpha.call("slow", {"seconds": 0})
        assert refused.is_error and "does not offer" in refused.content
    finally:
        await skills.aclose()


async def test_a_switch_stays_with_its_tool_when_another_server_offers_the_same_name(tmp_path: Path) -> None:
    """Switches were kept under the offered name: "extra" switched off became "alpha_extra" (on again)
    once a second server offered an "extra" too."""
    from bot.config import SkillsConfig
    from bot.storage import open_sqlite
    from cortex.skills.policy import SkillPolicy

    storage = await open_sqlite(tmp_path / "bot.db")
    await storage.migrate()
    skills = McpSkills([stdio_config("alpha", tools=["extra", "grow"]), stdio_config("beta", tools=["extra", "grow"])],
                       FAST)
    try:
        await skills.start()
        alpha, beta = skills.servers
        policy = SkillPolicy(SkillsConfig(), storage)
        off = SkillPolicy(SkillsConfig(disabled=["extra"]), storage)  # the operator's "off", by the offered name
        await alpha.call("grow", {})
        await eventually(lambda: "extra" in by_name(skills.skills()), 10)
        alone = by_name(skills.skills())["extra"].info
        assert alone.key == "alpha/extra"
        await policy.set("Cora", "*", alone, False)
        assert not (await policy.effective(alone, "Cora", None, "c")).enabled
        await beta.call("grow", {})
        await eventually(lambda: "beta_extra" in by_name(skills.skills()), 10)
        offered = by_name(skills.skills())
        assert (await policy.effective(offered["alpha_extra"].info, "Cora", None, "c")) == Effective(False, "bot-wide")
        assert (await policy.effective(offered["beta_extra"].info, "Cora", None, "c")) == Effective(True, "default")
        # (it stayed off when the clash renamed it: a second server's "extra" switched it on for everyone)
        assert not (await off.effective(offered["alpha_extra"].info, "Cora", None, "c")).enabled
        assert await off.locked("Cora", offered["alpha_extra"].info)
        assert await policy.set("Cora", "*", offered["alpha_extra"].info, None)  # reset finds it under either name
        assert (await policy.effective(offered["alpha_extra"].info, "Cora", None, "c")).source == "default"
    finally:
        await skills.aclose()
        await storage.close()


async def test_crash_then_restart() -> None:
    server = McpServer(stdio_config("crashy"), FAST)
    try:
        await server.start()
        first_pid = await server_pid(server)
        crashed = await server.call("crash", {})
        assert crashed == SkillResult("the crashy server is not reachable right now", is_error=True)
        down = await server.call("add", {"a": 1, "b": 2})
        assert down == SkillResult("the crashy server is not reachable right now", is_error=True)
        await eventually(lambda: server.up)
        assert await server.call("add", {"a": 1, "b": 2}) == SkillResult("3")
        assert await server_pid(server) != first_pid
        assert not alive(first_pid)
    finally:
        await server.aclose()


async def test_bad_command_does_not_block_others() -> None:
    bad = McpServerConfig(name="broken", command=["/nonexistent/mcp-server-binary"])
    skills = McpSkills([bad, stdio_config("good")], FAST)
    try:
        started = time.monotonic()
        await skills.start()
        assert time.monotonic() - started < 15
        broken, good = skills.servers
        assert good.up and not broken.up
        assert {tool.info.server for tool in skills.skills()} == {"good"}
        assert await good.call("add", {"a": 2, "b": 2}) == SkillResult("4")
        result = await broken.call("add", {"a": 2, "b": 2})
        assert result == SkillResult("the broken server is not reachable right now", is_error=True)
        await asyncio.sleep(0.5)  # a few retries in the background do not disturb the good server
        assert good.up and await good.call("echo", {"text": "still"}) == SkillResult("still")
    finally:
        await skills.aclose()


async def test_aclose_leaves_no_child_process() -> None:
    skills = McpSkills([stdio_config("one")], FAST)
    await skills.start()
    (server,) = skills.servers
    pid = await server_pid(server)
    assert alive(pid)
    await skills.aclose()
    assert not alive(pid)
    assert not server.up
    after = await server.call("add", {"a": 1, "b": 1})
    assert after.is_error and "not reachable" in after.content


RAW_SERVER = r"""
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    if msg["method"] == "initialize":
        result = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "raw", "version": "1"}}
    elif msg["method"] == "tools/list":
        result = {"tools": [{"name": "fine", "inputSchema": {"type": "object"}},
                            {"name": "odd", "inputSchema": {"type": "string"}}]}
    else:
        result = {}
    print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}), flush=True)
"""


async def test_a_tool_list_the_sdk_refuses_is_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """One tool with a schema that is no object makes the SDK refuse the whole list: the log says so in one
    line naming where, not with pydantic's page of text per retry."""
    caplog.set_level(logging.WARNING, logger="cortex.skills.mcp")
    server = McpServer(McpServerConfig(name="raw", command=[sys.executable, "-c", RAW_SERVER]), FAST)
    try:
        await server.start()
        await eventually(lambda: any("raw" in r.getMessage() for r in caplog.records))
        assert not server.up
        (record, *_) = [r for r in caplog.records if "raw" in r.getMessage()]
        message = record.getMessage()
        assert "\n" not in message and len(message) < 500, message
        assert "does not follow the protocol" in message and "tools.1.inputSchema" in message, message
    finally:
        await server.aclose()


async def test_a_tool_is_offered_only_with_an_object_schema_and_one_naming_no_type_becomes_one() -> None:
    """The model APIs take a tool's input schema only as an object's: a server's tool whose schema names no type
    (the SDK takes it) made every request it was offered in fail."""
    from mcp import types

    from cortex.skills.mcp import McpTool, schema_problem

    bare = types.Tool(name="bare", inputSchema={"properties": {"q": {"type": "string"}}})
    assert schema_problem(bare) is None and schema_problem(types.Tool(name="empty", inputSchema={})) is None
    assert schema_problem(types.Tool(name="listy", inputSchema={"type": "array"})) == (
        "its input schema describes no object")
    server = McpServer(McpServerConfig(name="srv", command=["true"]), FAST)
    assert McpTool(server, bare).info.input_schema == {"type": "object", "properties": {"q": {"type": "string"}}}


async def test_a_tool_whose_input_schema_is_no_valid_json_schema_is_not_offered(
        caplog: pytest.LogCaptureFixture) -> None:
    """A third-party server's tool with ``"type": "text"`` in its schema was offered as it is, and the provider
    refuses a whole request over one invalid schema (Anthropic: "JSON schema is invalid"): no reply at all while
    it was offered. Left out now, in one line naming it (HTTP skills' schemas are checked at start)."""
    caplog.set_level(logging.WARNING, logger="cortex.skills.mcp")
    server = McpServer(raw_config(), FAST)
    try:
        await server.start()
        assert "textual" not in by_name(server.tools) and "ok" in by_name(server.tools)
        assert "mcp server raw: its tool textual is not offered: its input schema is no valid JSON schema" \
            in caplog.text
    finally:
        await server.aclose()


async def test_a_secret_in_what_a_server_says_about_its_tools_is_redacted(
        secret_env: None, caplog: pytest.LogCaptureFixture) -> None:
    """A tool's description, title and input schema go to the model with every request and to `!skills list`:
    a server describing its database by a DSN from env_from showed its password there, redacted nowhere."""
    import json

    caplog.set_level(logging.WARNING, logger="cortex.skills.mcp")
    server = McpServer(raw_config(env_from={"DSN": "CORTEX_TEST_MCP_SECRET"}), FAST)
    try:
        await server.start()
        tools = by_name(server.tools)
        assert tools["query"].info.description == "Run a read-only SQL query against [redacted]."
        assert tools["query"].info.input_schema["properties"]["sql"]["description"] == "SQL for [redacted]"
        assert tools["lookup"].info.description == "Look a row up in [redacted]"
        assert SECRET not in json.dumps([tool.info.description for tool in server.tools])
        assert SECRET not in json.dumps([tool.info.input_schema for tool in server.tools])
        assert tools["ok"].info.description == "Answers fine."
        assert "the description of its tool query holds" in caplog.text and SECRET not in caplog.text
    finally:
        await server.aclose()


async def test_a_byte_that_is_no_utf8_is_replaced_and_the_next_call_answers_at_once() -> None:
    """One Latin-1 byte on a stdio server's output ended the SDK's strict decoding: that call and every later one
    waited out their timeouts (about 50 s in all) while the server still showed as up."""
    server = McpServer(raw_config(timeout_seconds=5.0), FAST)
    try:
        await server.start()
        started = time.monotonic()
        assert await server.call("latin1", {}) == SkillResult("caf\ufffd")
        assert await server.call("ok", {}) == SkillResult("fine")
        assert time.monotonic() - started < 3 and server.up
    finally:
        await server.aclose()


async def test_an_answer_the_sdk_cannot_read_fails_its_call_at_once() -> None:
    """An answer nested deeper than the SDK parses was dropped with a debug line: the call waited out its whole
    timeout and then said the tool did not answer. A line of log text on the server's output is no answer and
    fails nothing."""
    server = McpServer(raw_config(timeout_seconds=10.0), FAST)
    try:
        await server.start()
        started = time.monotonic()
        unread = await server.call("nested", {})
        assert unread.is_error and "the raw server's answer could not be read (" in unread.content, unread
        assert "recursion limit" in unread.content and time.monotonic() - started < 3
        started = time.monotonic()  # an answer the SDK parsed but refused (an error that is a bare string)
        refused = await server.call("strerror", {})
        assert refused.is_error and "answer could not be read (its error is a text, not an object with a code and " \
            "a message)" in refused.content, refused
        assert time.monotonic() - started < 3
        assert await server.call("chatty", {}) == SkillResult("chatted")
        # nor a JSON log record, nor a notification the SDK could not read: they answer no call
        assert await server.call("jsonlog", {}) == SkillResult("logged")
        assert await server.call("jsonlog_err", {}) == SkillResult("logged")  # (an id and an error, no "jsonrpc")
        assert await server.call("progress", {}) == SkillResult("notified")
        assert await server.call("ok", {}) == SkillResult("fine") and server.up
    finally:
        await server.aclose()


PINGING = McpOptions(backoff_initial=0.2, backoff_max=1.0, connect_timeout=1.5, health_interval=0.3)


async def test_a_long_call_is_not_cut_by_the_health_ping_and_a_hung_server_is_still_restarted(
        caplog: pytest.LogCaptureFixture) -> None:
    """A server doing one thing at a time answers no ping while it works: the ping's deadline passed, the
    connection was dropped with the call in flight ("not reachable right now"; with the defaults a 60-second call
    died at 50 s). No ping is judged while a call waits (its own deadline covers that time); a server that stops
    answering while the bot waits for nothing is still restarted."""
    caplog.set_level(logging.WARNING, logger="cortex.skills.mcp")
    server = McpServer(raw_config(timeout_seconds=5.0), PINGING)
    try:
        await server.start()
        first = await server_pid(server)
        assert await server.call("work", {"seconds": 2.5}) == SkillResult("worked")
        assert await server_pid(server) == first and "did not answer a ping" not in caplog.text
        assert await server.call("freeze", {"seconds": 30}) == SkillResult("frozen")
        await eventually(lambda: "mcp server raw did not answer a ping: TimeoutError" in caplog.text, 10)
        await eventually(lambda: server.up, 10)
        assert await server_pid(server) != first
    finally:
        await server.aclose()


async def test_a_hung_server_a_busy_bot_keeps_calling_is_restarted(caplog: pytest.LogCaptureFixture) -> None:
    """With no ping judged while a call waits, a hung server that was called more often than its calls' deadline
    (one call every 30 s with the defaults) was never restarted: every call waited out its deadline. Once a call's
    deadline passed unanswered, the ping is judged again, calls waiting or not."""
    caplog.set_level(logging.WARNING, logger="cortex.skills.mcp")
    server = McpServer(raw_config(timeout_seconds=1.0), PINGING)
    try:
        await server.start()
        first = await server_pid(server)
        assert await server.call("freeze", {"seconds": 60}) == SkillResult("frozen")  # hung from now on
        calls: list[asyncio.Future[SkillResult]] = []
        for _ in range(32):  # a call every 0.25 s, each waiting up to 1 s: one always waits
            calls.append(asyncio.ensure_future(server.call("ok", {})))
            await asyncio.sleep(0.25)
        results = await asyncio.gather(*calls)
        assert "mcp server raw did not answer a ping: TimeoutError" in caplog.text
        assert results.count(SkillResult("fine")) > 0 and await server_pid(server) != first
    finally:
        await server.aclose()


async def test_a_slow_server_that_answers_late_once_is_not_restarted_mid_call(
        caplog: pytest.LogCaptureFixture) -> None:
    """A call queued behind another on a server doing one thing at a time passed its deadline (its late answer is
    dropped), and the next ping was judged with a third call waiting: queued behind both, it timed out, and the
    server was restarted with that call (answerable in time) in flight. The server answered within a call's time:
    it is slow, not hung."""
    caplog.set_level(logging.WARNING, logger="cortex.skills.mcp")
    server = McpServer(raw_config(timeout_seconds=4.0), PINGING)
    try:
        await server.start()
        first = await server_pid(server)
        a = asyncio.ensure_future(server.call("work", {"seconds": 2.5}))
        await asyncio.sleep(0.1)
        late = await server.call("work", {"seconds": 2.5})  # behind a: answered at 5 s, its deadline at 4 s
        assert late.is_error and "did not answer within 4 s" in late.content, late
        assert await server.call("work", {"seconds": 1.0}) == SkillResult("worked")  # answered at 6 s
        assert await a == SkillResult("worked") and await server_pid(server) == first
        assert "did not answer a ping" not in caplog.text
    finally:
        await server.aclose()


async def test_a_ping_answered_with_an_error_is_an_answer(caplog: pytest.LogCaptureFixture) -> None:
    """A server answering ping with "Method not found" was restarted at every health ping ("did not answer a ping:
    MCP error -32601", though it answered), cutting the calls in flight: it is alive, and stays connected."""
    caplog.set_level(logging.WARNING, logger="cortex.skills.mcp")
    server = McpServer(raw_config(env={"PING": "unknown"}), PINGING)
    try:
        await server.start()
        first = await server_pid(server)
        await asyncio.sleep(1.5)  # five pings
        assert server.up and await server_pid(server) == first
        assert "did not answer a ping" not in caplog.text and "is down" not in caplog.text
    finally:
        await server.aclose()


async def test_a_stdio_answer_past_the_cap_fails_its_call_at_once_and_the_server_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    """A stdio server's answer was read whole, however large, by copying all of it again for every 64 KB: one of
    64 MB kept a core busy for minutes, every other call to that server waited behind it ("did not answer"), and an
    HTTP server's answer had a cap a stdio one had not. Past 8 MB the call fails now, saying so; the rest of that
    line is skipped, and the server answers the next call as before (no restart)."""
    caplog.set_level(logging.WARNING, logger="cortex.skills.mcp")
    server = McpServer(raw_config(timeout_seconds=30.0), FAST)
    try:
        await server.start()
        first = await server_pid(server)
        started = time.monotonic()
        under = await server.call("huge", {"mb": 7})
        assert not under.is_error and len(under.content) == 7 << 20
        over = await server.call("huge", {"mb": 40})
        assert over == SkillResult("the raw server's answer could not be read (the answer was larger than 8 MB)",
                                   is_error=True), over.content[:200]
        assert await server.call("ok", {}) == SkillResult("fine")
        assert time.monotonic() - started < 10, time.monotonic() - started
        assert server.up and await server_pid(server) == first and "is down" not in caplog.text
    finally:
        await server.aclose()


async def test_lines_are_cut_from_chunks_wherever_they_end_and_one_past_the_limit_is_dropped() -> None:
    from cortex.skills.stdio import LineReader

    lines = LineReader(limit=5)
    assert lines.feed(b"ab") == [] and lines.feed(b"c\nde") == [b"abc"] and lines.feed(b"\n\nfghij\n") == [
        b"de", b"", b"fghij"]  # (a line of the limit is read)
    assert lines.feed(b"klmnop\nq\n") == [None, b"q"]  # past the limit within one chunk
    assert lines.feed(b"rstu") == [] and lines.feed(b"vw") == [None]  # as soon as it passes it
    assert lines.feed(b"xyz" * 10) == [] and lines.feed(b"z\nok\n") == [b"ok"]  # its rest skipped, once


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_stdio_servers_stderr_is_logged_under_its_name_redacted_and_cut(
        secret_env: None, caplog: pytest.LogCaptureFixture) -> None:
    """A stdio server's stderr went into the bot's stderr as written, a token it printed included; each line is
    now logged under the server's name, its secrets redacted, at most 1,000 characters."""
    caplog.set_level(logging.WARNING, logger="cortex.skills.mcp")
    server = McpServer(raw_config(env_from={"TOKEN": "CORTEX_TEST_MCP_SECRET"}), FAST)
    try:
        await server.start()
        assert await server.call("leak", {}) == SkillResult("leaked")

        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.getMessage().startswith("mcp server raw says")]

        await eventually(lambda: len(said()) == 2, 5)
        assert said()[0] == "mcp server raw says: connecting to the upstream service with token=[redacted]"
        assert said()[1].endswith("x…") and len(said()[1]) < 1_100
        assert SECRET not in caplog.text
    finally:
        await server.aclose()


async def test_a_secret_a_stdio_server_prints_on_its_output_is_not_logged(
        secret_env: None, caplog: pytest.LogCaptureFixture) -> None:
    """A log line with the server's env_from token on its stdout, not its stderr: the SDK logged the line it could
    not read at ERROR with its traceback, where pydantic quotes the line, token and all. Its record says so in one
    line, without the traceback, and the call still answers."""
    caplog.set_level(logging.DEBUG)
    server = McpServer(raw_config(env_from={"TOKEN": "CORTEX_TEST_MCP_SECRET"}), FAST)
    try:
        await server.start()
        assert await server.call("tattle", {}) == SkillResult("tattled")
    finally:
        await server.aclose()
    assert SECRET not in caplog.text
    unread = [r for r in caplog.records if r.name == "mcp.client.stdio" and "Failed to parse" in r.getMessage()]
    assert unread and all(r.exc_info is None and "\n" not in r.getMessage() for r in unread), caplog.text


async def test_a_secret_an_http_server_sends_back_in_an_unreadable_answer_is_not_logged(
        secret_env: None, caplog: pytest.LogCaptureFixture) -> None:
    """An HTTP server answering with something that is no JSON-RPC, its headers_env key in it: the SDK logged
    "Error parsing JSON response" with pydantic's traceback quoting the answer, key and all (over a real
    connection on loopback)."""
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        return web.Response(text=f"upstream refused key={request.headers.get('X-Api-Key')}",
                            content_type="application/json")

    caplog.set_level(logging.DEBUG)
    app = web.Application()
    app.router.add_post("/mcp", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/mcp"
    server = McpServer(McpServerConfig(name="web", url=url, headers_env={"X-Api-Key": "CORTEX_TEST_MCP_SECRET"}),
                       FAST)
    try:
        await server.start()
        assert not server.up
        assert SECRET not in caplog.text
        unread = [r for r in caplog.records if r.name == "mcp.client.streamable_http" and "JSON" in r.getMessage()]
        assert unread and all(r.exc_info is None and "\n" not in r.getMessage() for r in unread), caplog.text
    finally:
        await server.aclose()
        await runner.cleanup()


async def test_a_failed_call_is_logged_by_its_kind_never_with_the_persons_words(
        caplog: pytest.LogCaptureFixture) -> None:
    """A call the SDK refused (a result failing the tool's output schema) was logged at WARNING with the SDK's
    text, which quotes the result, and the result quoted the argument: the person's words, in a log that outlives
    a forget-me and an incognito pause. The log names the kind now; the model is still told everything."""
    caplog.set_level(logging.INFO)
    words = "Lisbon, where I'm going for my HIV treatment next week"
    server = McpServer(raw_config(), FAST)
    try:
        await server.start()
        result = await server.call("forecast", {"city": words})
    finally:
        await server.aclose()
    assert result.is_error and words in result.content, result
    assert "mcp server raw: calling forecast failed (RuntimeError)" in caplog.text
    assert "Lisbon" not in caplog.text


async def test_a_restarted_stdio_server_leaves_no_descriptor_or_task_behind() -> None:
    """Each connection to a stdio server has a pipe for its stderr and a task reading it: a crash, a restart and
    the stop close and end them all, even when a child the server left behind holds the pipe open."""
    before, tasks = open_descriptors(), len(asyncio.all_tasks())
    server = McpServer(raw_config(), FAST)
    daemon = 0
    try:
        await server.start()
        assert await server.call("ok", {}) == SkillResult("fine")
        up = open_descriptors()
        for _ in range(3):
            assert (await server.call("crash", {})).is_error
            await eventually(lambda: server.up)
            assert await server.call("ok", {}) == SkillResult("fine")
        await eventually(lambda: open_descriptors() == up, 5)
        daemon = int((await server.call("daemon", {})).content)
    finally:
        await server.aclose()
    try:
        await eventually(lambda: open_descriptors() == before and len(asyncio.all_tasks()) == tasks, 5)
    finally:
        if daemon:
            os.kill(daemon, 9)


async def test_an_unset_secret_variable_of_a_server_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """An env_from (stdio) or headers_env (HTTP) variable that is unset was a warning in the log: the server
    started without its secret and failed every call, where an HTTP skill refuses to start."""
    monkeypatch.delenv("CB_TEST_MCP_UNSET", raising=False)
    monkeypatch.setenv("CB_TEST_MCP_EMPTY", "")
    with pytest.raises(ValueError, match=r"^\[\[skills.mcp\]\] 'db': environment variable CB_TEST_MCP_UNSET "
                       r"\(for env_from PGPASSWORD\) is not set$"):
        McpServer(stdio_config("db", env_from={"PGPASSWORD": "CB_TEST_MCP_UNSET"}), FAST)
    with pytest.raises(ValueError, match=r"'web': environment variable CB_TEST_MCP_EMPTY \(for header X-Key\)"):
        McpServer(McpServerConfig(name="web", url="http://127.0.0.1:9/mcp", headers_env={"X-Key": "CB_TEST_MCP_EMPTY"}))
    with pytest.raises(ValueError, match="CB_TEST_MCP_UNSET"):
        McpSkills([stdio_config("fine"), stdio_config("db", env_from={"PGPASSWORD": "CB_TEST_MCP_UNSET"})])
