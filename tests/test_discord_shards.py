"""Discord sharding: the config checks, the sync rule, and a fleet of two real `cortexbot run` processes
(shard 0 and shard 1 of 2, one SQLite file) against the fake Discord of ``tests/fakes/discord_server.py``
and the fake LLM server. Each process gets its own token value so the fake can tell them apart."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import discord
import pytest
import yarl

from adapters.discord import API_BASE_ENV, GATEWAY_ENV, build_client, redirect_for_tests, syncs_commands
from bot.config import ConfigError, DiscordConfig, parse_config
from tests.fakes.discord_server import FakeDiscord, shard_for
from tests.fakes.llm_server import FakeLLMServer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BIN = Path(sys.executable).parent
API_KEY = "sk-test-shards"
TOKENS = {0: "token-of-the-shard-0-process", 1: "token-of-the-shard-1-process"}
SKIP_LOG = "not syncing slash commands"
STOPPED_BY_SIGNAL = 0  # bot/cli.py (_run_async): a SIGTERM'd run prints "stopped." and exits 0, as systemd expects


# -- config and rule (fast, in-process) ----------------------------------------------------------


@pytest.mark.parametrize(("discord_section", "expected"), [
    ({"shard_ids": [0]}, "[discord] key 'shard_ids': needs shard_count"),
    ({"shard_count": 2, "shard_ids": [0, 2, -1]}, "[-1, 2] are outside 0 … 1"),
    ({"shard_count": 2, "shard_ids": [1, 1]}, "lists [1] more than once"),
    ({"shard_count": 2, "shard_ids": []}, "[discord] key 'shard_ids': is empty"),
    ({"shard_count": 0}, "[discord] key 'shard_count': Input should be greater than or equal to 1"),
    ({"shard_count": 10_001}, "[discord] key 'shard_count': Input should be less than or equal to 10000"),
    ({"shard_count": 2, "shard_ids": ["one"]}, "[discord] key 'shard_ids.0'"),
])
def test_bad_shard_settings_are_named_with_the_fix(discord_section: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"discord": discord_section}, source="config.toml")
    assert expected in str(info.value)


def test_shard_settings_parse() -> None:
    assert parse_config({}).discord.shard_count is None and parse_config({}).discord.shard_ids is None
    config = parse_config({"discord": {"shard_count": 4, "shard_ids": [3, 1]}}).discord
    assert (config.shard_count, config.shard_ids) == (4, [3, 1])
    assert parse_config({"discord": {"shard_count": 4}}).discord.shard_ids is None


@pytest.mark.parametrize(("count", "ids", "syncs"), [
    (None, None, True), (2, None, True), (2, [0], True), (4, [2, 0], True), (2, [1], False), (4, [1, 2, 3], False),
])
def test_only_the_process_with_shard_0_syncs(count: int | None, ids: list[int] | None, syncs: bool) -> None:
    assert syncs_commands(DiscordConfig(shard_count=count, shard_ids=ids)) is syncs


def test_the_client_is_auto_sharded_only_with_a_shard_count() -> None:
    intents = discord.Intents.default()
    plain = build_client(DiscordConfig(), intents)
    assert type(plain) is discord.Client
    sharded = build_client(DiscordConfig(shard_count=3, shard_ids=[2]), intents)
    assert isinstance(sharded, discord.AutoShardedClient)
    assert (sharded.shard_count, sharded.shard_ids) == (3, [2])
    every = build_client(DiscordConfig(shard_count=3), intents)
    assert isinstance(every, discord.AutoShardedClient) and every.shard_ids is None


async def test_the_test_hook_redirects_only_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discord.http.Route, "BASE", discord.http.Route.BASE)  # restored afterwards
    monkeypatch.setattr(discord.gateway.DiscordWebSocket, "DEFAULT_GATEWAY",
                        discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY)
    assert not await redirect_for_tests({}, "token")
    assert discord.http.Route.BASE == "https://discord.com/api/v10"
    assert await redirect_for_tests({API_BASE_ENV: "http://127.0.0.1:1/api/v10/", GATEWAY_ENV: "ws://127.0.0.1:1/gw"},
                                    "token")
    assert discord.http.Route.BASE == "http://127.0.0.1:1/api/v10"
    assert discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY == yarl.URL("ws://127.0.0.1:1/gw")
    with FakeDiscord() as fake:  # without the gateway variable: the server's GET /gateway/bot names it
        assert await redirect_for_tests({API_BASE_ENV: fake.api_base}, "token")
    assert discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY == yarl.URL(fake.gateway_url)
    assert [(r.method, r.path, r.token) for r in fake.requests] == [("GET", "/gateway/bot", "token")]


async def test_the_fake_routes_dms_to_shard_0_and_guild_events_by_guild_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake itself: two in-process auto-sharded clients, each given its events only."""
    with FakeDiscord(shard_count=2) as fake:
        guild_id = next(g << 22 for g in range(1, 100) if shard_for(g << 22, 2) == 1)
        fake.add_guild(guild_id)
        monkeypatch.setattr(discord.http.Route, "BASE", fake.api_base)
        monkeypatch.setattr(discord.gateway.DiscordWebSocket, "DEFAULT_GATEWAY", yarl.URL(fake.gateway_url))
        received: dict[int, list[str]] = {0: [], 1: []}
        clients = [_recording_client(shard, received[shard]) for shard in (0, 1)]
        runs = [asyncio.create_task(c.start(f"token-{i}")) for i, c in enumerate(clients)]
        try:
            await asyncio.wait_for(asyncio.gather(*(c.wait_until_ready() for c in clients)), 10)
            assert [g.id for g in clients[1].guilds] == [guild_id] and not clients[0].guilds
            assert fake.dispatch_message("in private").shard_id == 0
            assert fake.dispatch_message("in the server", guild_id=guild_id).shard_id == 1
            for _ in range(100):
                if received[0] and received[1]:
                    break
                await asyncio.sleep(0.02)
            assert received == {0: ["in private"], 1: ["in the server"]}
        finally:
            for client in clients:
                await client.close()
            await asyncio.gather(*runs)
    assert [d.close_code for d in fake.disconnects] == [1000, 1000]


async def test_the_web_pages_directory_asks_discord_about_guilds_of_other_shards(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The web page runs in one process of a fleet, whose client holds only its own shards' guilds: admins of a
    guild on another process's shard got 403 on its pages. Now such a guild and its member are asked from Discord
    (the real discord.py against the fake REST API), the guild once for several lookups."""
    from adapters.admin_directory import DiscordAdminDirectory

    with FakeDiscord(shard_count=2) as fake:
        elsewhere = next(g << 22 for g in range(1, 100) if shard_for(g << 22, 2) == 1)
        here = next(g << 22 for g in range(1, 100) if shard_for(g << 22, 2) == 0)
        fake.add_guild(elsewhere, moderators=(501,), members=(502,))
        async with _shard_zero(fake, monkeypatch) as client:
            assert client.get_guild(elsewhere) is None  # not this process's shard
            directory = DiscordAdminDirectory(client, DiscordConfig(shard_count=2, shard_ids=[0]))
            assert await directory.is_admin("discord:501", f"discord:{elsewhere}")  # Manage Server by a role
            assert not await directory.is_admin("discord:502", f"discord:{elsewhere}")  # a member, no role
            assert not await directory.is_admin("discord:503", f"discord:{elsewhere}")  # not a member
            assert not await directory.is_admin("discord:501", f"discord:{elsewhere + (2 << 22)}")  # bot not in it
            assert not await directory.is_admin("discord:501", f"discord:{here}")  # own shard: the cache says no
            asked = [r.path for r in fake.requests if r.path.startswith("/guilds/")]
            assert asked.count(f"/guilds/{elsewhere}") == 1 and f"/guilds/{here}" not in asked, asked


async def test_made_up_guilds_of_other_shards_are_asked_from_discord_only_so_often(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Any logged-in user could name a new made-up guild id of another shard on every request, and each cost a
    REST call on the bot's token (whose rate limit every shard sends messages with): a user has a few lookups a
    minute, everyone together more; answers kept cost none."""
    from adapters.admin_directory import DiscordAdminDirectory
    from bot.ports import LookupsSpent

    with FakeDiscord(shard_count=2) as fake:
        others = [g << 22 for g in range(1, 200) if shard_for(g << 22, 2) == 1]
        real, made_up = others[0], others[1:]
        fake.add_guild(real, moderators=(501,))
        async with _shard_zero(fake, monkeypatch) as client:
            directory = DiscordAdminDirectory(client, DiscordConfig(shard_count=2, shard_ids=[0]),
                                              guild_lookups=(3, 5))

            def asked() -> int:
                return len([r for r in fake.requests if r.path.startswith("/guilds/") and "/members/" not in r.path])

            assert await directory.is_admin("discord:501", f"discord:{real}")
            for guild in made_up[:3]:
                assert not await directory.is_admin("discord:666", f"discord:{guild}")
            for guild in made_up[3:6]:  # neither yes nor no: not asked (the web page answers 429, not 403)
                with pytest.raises(LookupsSpent):
                    await directory.is_admin("discord:666", f"discord:{guild}")
            assert asked() == 1 + 3  # the attacker's fourth to sixth were not asked
            assert await directory.is_admin("discord:501", f"discord:{real}")  # kept: still answered
            assert not await directory.is_admin("discord:777", f"discord:{made_up[6]}")
            with pytest.raises(LookupsSpent):
                await directory.is_admin("discord:778", f"discord:{made_up[7]}")
            assert asked() == 5  # five in all this minute
            assert await directory.is_admin("discord:501", f"discord:{real}")  # a kept answer costs nothing


@asynccontextmanager
async def _shard_zero(fake: FakeDiscord, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[discord.AutoShardedClient]:
    """The real discord.py as the process of shard 0 (of the fake's), connected to the fake and ready."""
    monkeypatch.setattr(discord.http.Route, "BASE", fake.api_base)
    monkeypatch.setattr(discord.gateway.DiscordWebSocket, "DEFAULT_GATEWAY", yarl.URL(fake.gateway_url))
    client = _recording_client(0, [])
    run = asyncio.create_task(client.start("token-0"))
    try:
        await asyncio.wait_for(client.wait_until_ready(), 10)
        yield client
    finally:
        await client.close()
        await run


def _recording_client(shard: int, into: list[str]) -> discord.AutoShardedClient:
    intents = discord.Intents.default()
    intents.message_content = True
    client = discord.AutoShardedClient(intents=intents, shard_count=2, shard_ids=[shard], guild_ready_timeout=0.05)

    async def on_message(message: discord.Message) -> None:
        into.append(message.content)

    client.event(on_message)
    return client


# -- a fleet of two processes ---------------------------------------------------------------------


@dataclass
class BotProcess:
    shard_id: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def token(self) -> str:
        return TOKENS[self.shard_id]

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr():
            assert self.proc.poll() is None, f"shard {self.shard_id} process exited:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"no {text!r} from shard {self.shard_id} within {timeout} s"
            time.sleep(0.05)


def write_shard_config(tmp_path: Path, llm: FakeLLMServer, shard_id: int) -> Path:
    path = tmp_path / f"shard-{shard_id}.toml"
    path.write_text("\n".join([
        "[storage]", f'url = "sqlite:///{tmp_path / "bot.db"}"',
        "[llm]", 'provider = "anthropic"', 'model = "test-model"', f'base_url = "{llm.anthropic_url}"',
        'api_key_env = "CB_TEST_API_KEY"', "max_retries = 0",
        "[memory]", 'embedder = "none"',
        "[chat]", "streaming = false",
        "[jobs]", "poll_seconds = 0.1", "shutdown_grace_seconds = 2",
        "[discord]", "enabled = true", "shard_count = 2", f"shard_ids = [{shard_id}]",
    ]) + "\n")
    return path


def start_bot(tmp_path: Path, llm: FakeLLMServer, fake: FakeDiscord, shard_id: int) -> BotProcess:
    env = {**os.environ, "CB_TEST_API_KEY": API_KEY, "OPENBLAS_NUM_THREADS": "1",
           "DISCORD_TOKEN": TOKENS[shard_id], API_BASE_ENV: fake.api_base}
    env.pop(GATEWAY_ENV, None)
    if shard_id == 0:  # the other process finds the gateway through GET /gateway/bot
        env[GATEWAY_ENV] = fake.gateway_url
    log = tmp_path / f"shard-{shard_id}.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            [str(BIN / "cortexbot"), "--config", str(write_shard_config(tmp_path, llm, shard_id)), "run"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, env=env,
        )
    return BotProcess(shard_id, proc, log)


@pytest.fixture
def fleet(tmp_path: Path, fake_llm: FakeLLMServer) -> Iterator[tuple[FakeDiscord, list[BotProcess]]]:
    with FakeDiscord(shard_count=2) as fake:
        bots = [start_bot(tmp_path, fake_llm, fake, shard) for shard in (0, 1)]
        try:
            yield fake, bots
        finally:
            for bot in bots:
                if bot.proc.poll() is None:
                    bot.proc.kill()
                    bot.proc.wait(10)


@pytest.mark.slow
def test_two_processes_split_the_shards_and_one_syncs(
    tmp_path: Path, fake_llm: FakeLLMServer, fleet: tuple[FakeDiscord, list[BotProcess]]
) -> None:
    fake, bots = fleet
    fake.wait_until(lambda f: len(f.identifies) >= 2, timeout=30)
    assert sorted((i.token, i.shard) for i in fake.identifies) == [(TOKENS[0], (0, 2)), (TOKENS[1], (1, 2))]

    # Both are ready (on_ready): shard 0's process synced, shard 1's says it skips.
    fake.wait_until(lambda f: f.command_syncs, timeout=20)
    bots[1].wait_for_log(SKIP_LOG, timeout=20)
    assert SKIP_LOG not in bots[0].stderr()

    sent = fake.dispatch_message("hello from a DM")
    assert (sent.shard_id, sent.token) == (0, TOKENS[0])
    fake.wait_until(lambda f: f.messages_in(sent.channel_id), timeout=20)
    replies = fake.messages_in(sent.channel_id)
    assert [(m.token, m.content) for m in replies] == [(TOKENS[0], "echo: hello from a DM")]
    assert [r.last_user_text() for r in fake_llm.completion_requests] == ["hello from a DM"]

    syncs = fake.command_syncs
    assert [(s.token, s.guild_id) for s in syncs] == [(TOKENS[0], None)]
    assert {"memory", "cortex", "help"} <= set(syncs[0].names)
    assert not [r for r in fake.requests if r.token == TOKENS[1] and "/commands" in r.path]

    with sqlite3.connect(tmp_path / "bot.db") as db:  # both share the database; shard 0 wrote the exchange
        texts = [row[0] for row in db.execute("SELECT text FROM messages ORDER BY id")]
    assert texts == ["hello from a DM", "echo: hello from a DM"]

    for bot in bots:
        bot.proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    codes = [bot.proc.wait(timeout=20) for bot in bots]
    assert time.monotonic() - started < 20
    for bot in bots:
        assert "Traceback" not in bot.stderr() and bot.stderr().endswith("stopped.\n"), bot.stderr()
    assert codes == [STOPPED_BY_SIGNAL] * 2, [bot.stderr()[-2000:] for bot in bots]
    assert sorted((d.identify.token, d.close_code) for d in fake.disconnects) == [(TOKENS[0], 1000), (TOKENS[1], 1000)]


@pytest.mark.slow
def test_a_bot_started_before_discord_is_reachable_waits_for_it(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """Started at boot before the network was up, `cortexbot run` ended at once ("Cannot connect to host
    discord.com"): discord.py reconnects a gateway that drops, but not its first login. It now tries again."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    unreachable = FakeDiscord(port=port, shard_count=2)  # (not started yet: only its addresses)
    bot = start_bot(tmp_path, fake_llm, unreachable, 0)
    try:
        bot.wait_for_log("Discord: cannot reach", timeout=30)
        time.sleep(1.5)  # (a try or two more, still nothing there)
        assert bot.proc.poll() is None, bot.stderr()
        with FakeDiscord(port=port, shard_count=2) as fake:
            fake.wait_until(lambda f: len(f.identifies) >= 1, timeout=60)
            assert [(i.token, i.shard) for i in fake.identifies] == [(TOKENS[0], (0, 2))]
            bot.wait_for_log("answers again; logging in", timeout=5)
            bot.proc.send_signal(signal.SIGTERM)
            assert bot.proc.wait(timeout=20) == STOPPED_BY_SIGNAL, bot.stderr()
        assert bot.stderr().count("Discord: cannot reach") == 1 and "Traceback" not in bot.stderr()
    finally:
        if bot.proc.poll() is None:
            bot.proc.kill()
            bot.proc.wait(10)


async def test_doctor_asks_discord_whether_it_takes_the_bot_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """doctor said "✓ Discord: bot token read" for any token in the variable, one Discord rejects too."""
    from adapters.credentials import discord_login

    config = DiscordConfig(enabled=True, token_env="CB_TEST_DISCORD_TOKEN")
    with FakeDiscord() as fake:
        env = {API_BASE_ENV: fake.api_base}
        monkeypatch.setenv("CB_TEST_DISCORD_TOKEN", "a-good-token")
        assert await discord_login(config, env) == (True, "bot token from $CB_TEST_DISCORD_TOKEN signs in as cortex "
                                                          "(id 900000000000000002)")
        fake.rejected_tokens.add("a-reset-token")
        monkeypatch.setenv("CB_TEST_DISCORD_TOKEN", "a-reset-token")
        ok, said = await discord_login(config, env)
        assert not ok and said.startswith("Discord rejected the bot token in $CB_TEST_DISCORD_TOKEN")
        monkeypatch.setenv("CB_TEST_DISCORD_TOKEN", "")
        ok, said = await discord_login(config, env)
        assert not ok and said.startswith("[discord] is enabled but $CB_TEST_DISCORD_TOKEN holds no bot token: set it")
        monkeypatch.setenv("CB_TEST_DISCORD_TOKEN", "a-good-token")
        unreachable = fake.api_base
    ok, said = await discord_login(config, {API_BASE_ENV: unreachable})  # (the fake has stopped)
    assert not ok and said.startswith(f"cannot reach {unreachable} (") and "waits until it can" in said


async def test_a_bot_token_ending_in_a_line_break_is_taken_and_one_with_a_break_inside_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A DISCORD_TOKEN with a line break inside (two secrets pasted into one) ended doctor with a traceback
    ("Forbidden control character detected in headers"); one ending in a break (`echo` into a secret) is meant."""
    from adapters.credentials import discord_login

    config = DiscordConfig(enabled=True, token_env="CB_TEST_DISCORD_TOKEN")
    with FakeDiscord() as fake:
        env = {API_BASE_ENV: fake.api_base}
        monkeypatch.setenv("CB_TEST_DISCORD_TOKEN", "a-good-token\n")
        assert (await discord_login(config, env))[0]
        monkeypatch.setenv("CB_TEST_DISCORD_TOKEN", "a-good\n-token")
        assert await discord_login(config, env) == (
            False, "environment variable CB_TEST_DISCORD_TOKEN holds a line break or another control character "
                   "inside its secret: put the secret alone in it")


@asynccontextmanager
async def _serving(path: str, handler: Any) -> AsyncIterator[str]:
    """An HTTP server on loopback answering GET ``path`` with ``handler``: its base URL."""
    from aiohttp import web

    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("body", ["<html>Sign in to the Wi-Fi</html>", "[1, 2]", "{}"])
async def test_doctor_names_a_check_answered_by_something_other_than_discord(
        monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """A page that is not Discord's answer (a captive portal's, a proxy's) was called "cannot reach", or, as
    JSON but no object, ended doctor with a traceback."""
    from aiohttp import web

    from adapters.credentials import discord_login

    async def me(request: web.Request) -> web.Response:
        return web.Response(text=body, content_type="text/html" if body.startswith("<") else "application/json")

    monkeypatch.setenv("CB_TEST_DISCORD_TOKEN", "a-good-token")
    async with _serving("/users/@me", me) as base:
        ok, said = await discord_login(DiscordConfig(enabled=True, token_env="CB_TEST_DISCORD_TOKEN"),
                                       {API_BASE_ENV: base})
    assert not ok and said == f"{base} answered the bot token's check with something other than Discord's answer " \
                              "(a proxy in between?)"


async def test_discord_in_an_outage_is_waited_for_like_one_out_of_reach(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A 5xx at start (Discord's outage) ended the start as the login met it; it is waited for, said once."""
    from aiohttp import web

    import adapters.discord as discord_adapter

    monkeypatch.setattr(discord_adapter, "CONNECT_RETRY_FIRST", 0.05)
    answers = [503, 502, 200]
    asked: list[str] = []

    async def gateway(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"url": "ws://127.0.0.1:1"}, status=answers.pop(0) if answers else 200)

    async with _serving("/api/v10/gateway", gateway) as base:
        await asyncio.wait_for(discord_adapter.reachable(f"{base}/api/v10"), 10)
    assert asked == ["/api/v10/gateway"] * 3
    said = [r.getMessage() for r in caplog.records if r.name == "adapters.discord"]
    assert len([m for m in said if "cannot reach" in m and "(HTTP 503)" in m]) == 1 and "answers again" in said[-1]
