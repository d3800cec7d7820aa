"""Several processes on one database, as each of them sees it: heartbeats and `cortexbot status`,
periodic upkeep once per period, one process per Matrix account, admin changes reaching every process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from adapters.matrix import MatrixAdapter
from bot.app import App
from bot.commands import CommandContext
from bot.config import parse_config
from bot.fleet import LockHeld
from bot.scheduler import Scheduler
from cortex.memory.embedders import HashEmbedder
from tests.engines import db_url_for
from tests.fakes.llm_server import FakeLLMServer
from tests.fakes.provider import ScriptedProvider
from tests.test_cli import cortexbot, write_config

pytestmark = pytest.mark.both_engines


def _config(tmp_path: Path):  # type: ignore[no-untyped-def]
    return parse_config({"storage": {"url": db_url_for(tmp_path)}, "memory": {"embedder": "none"}})


async def test_two_processes_share_one_lock_and_periodic_runs(tmp_path: Path) -> None:
    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider()) as one, App(config, llm=ScriptedProvider()) as two:
        await one.fleet.hold("matrix:@bot:example.org", "the Matrix account @bot:example.org")
        held = f"already served by another running process \\({one.fleet.process_id}\\)"
        with pytest.raises(LockHeld, match=held):
            await two.fleet.hold("matrix:@bot:example.org", "the Matrix account @bot:example.org")
        assert await one.fleet.claim_period("probe", 60) and not await two.fleet.claim_period("probe", 60)
        assert not await one.fleet.claim_period("probe", 60)  # once per period, whoever asks
        await one.stop()  # a clean stop releases the claim: another process may take the account now
        await two.fleet.hold("matrix:@bot:example.org", "the Matrix account @bot:example.org")
        assert {p.id for p in await two.fleet.live()} == {two.fleet.process_id}


async def test_a_second_process_on_one_matrix_account_refuses_before_logging_in(tmp_path: Path) -> None:
    config = parse_config({
        "storage": {"url": db_url_for(tmp_path)}, "memory": {"embedder": "none"},
        "matrix": {"enabled": True, "homeserver": "http://127.0.0.1:9", "user_id": "@cortex:localhost",
                   "password_env": "CB_MATRIX_PW", "store_path": str(tmp_path / "matrix")},
    })
    async with App(config, llm=ScriptedProvider()) as one, App(config, llm=ScriptedProvider()) as two:
        await one.fleet.hold("matrix:@cortex:localhost", "the Matrix account @cortex:localhost")
        adapter = MatrixAdapter(two, config.matrix, env={"CB_MATRIX_PW": "x"})
        try:
            with pytest.raises(LockHeld, match="the Matrix account @cortex:localhost is already served"):
                await adapter.run()  # refused before any request to the (unreachable) homeserver
        finally:
            await adapter.close()


async def test_a_process_that_lost_its_claim_is_told_so_and_stops_renewing(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A process stalled longer than the claim's time: another took the Matrix account, and the first went on
    serving it (an ERROR every few seconds), so every message was answered twice."""
    import time

    import bot.fleet as fleet_module

    monkeypatch.setattr(fleet_module, "LOCK_TTL_SECONDS", 0.9)
    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider()) as one, App(config, llm=ScriptedProvider()) as two:
        lost: list[str] = []
        await one.fleet.hold("matrix:@bot:example.org", "the Matrix account @bot:example.org", on_lost=lost.append)
        time.sleep(1.2)  # noqa: ASYNC251  (one's event loop stalls past the claim's time: the case itself)
        await two.fleet.hold("matrix:@bot:example.org", "the Matrix account @bot:example.org")
        for _ in range(40):
            if lost:
                break
            await asyncio.sleep(0.1)
        assert len(lost) == 1 and f"lost to {two.fleet.process_id}" in lost[0], lost
        await asyncio.sleep(0.8)
        assert len(lost) == 1  # (said once; the renewal stopped, and two keeps the account)
        row = await two.storage.db.fetch_one("SELECT owner FROM instance_locks WHERE name = 'matrix:@bot:example.org'")
        assert row is not None and row[0] == two.fleet.process_id


async def test_a_process_alone_on_its_account_goes_on_through_a_database_outage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Renewals failing for the claim's whole time (the database down a minute) counted as a lost claim, and a
    process alone on the account stopped serving it (with Discord and the web page, as the process ends). Only a
    claim the database names another holder of is lost."""
    import bot.fleet as fleet_module

    monkeypatch.setattr(fleet_module, "LOCK_TTL_SECONDS", 0.6)
    async with App(_config(tmp_path), llm=ScriptedProvider()) as app:
        lost: list[str] = []
        await app.fleet.hold("matrix:@bot:example.org", "the Matrix account @bot:example.org", on_lost=lost.append)
        real = app.storage.fleet.acquire_lock
        down = True

        async def outage(name: str, owner: str, ttl: float) -> str | None:
            if down:
                raise ConnectionRefusedError("[Errno 111] Connect call failed")
            return await real(name, owner, ttl)

        monkeypatch.setattr(app.storage.fleet, "acquire_lock", outage)
        await asyncio.sleep(1.0)  # (longer than the claim's time)
        down = False
        await asyncio.sleep(0.6)
        assert lost == []
        row = await app.storage.db.fetch_one("SELECT owner FROM instance_locks WHERE name = 'matrix:@bot:example.org'")
        assert row is not None and row[0] == app.fleet.process_id


async def test_a_matrix_adapter_whose_claim_was_lost_stops_with_one_line(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters.matrix import MatrixError

    config = parse_config({
        "storage": {"url": db_url_for(tmp_path)}, "memory": {"embedder": "none"},
        "matrix": {"enabled": True, "homeserver": "http://127.0.0.1:9", "user_id": "@cortex:localhost",
                   "password_env": "CB_MATRIX_PW", "store_path": str(tmp_path / "matrix")},
    })
    async with App(config, llm=ScriptedProvider()) as app:
        adapter = MatrixAdapter(app, config.matrix, env={"CB_MATRIX_PW": "x"})
        try:
            adapter._account_lost("the claim on the Matrix account @cortex:localhost was lost to host-b:2:ab")
            with pytest.raises(MatrixError, match="lost to host-b:2:ab; this process stopped serving it"):
                await adapter.run()
        finally:
            await adapter.close()


async def test_a_gated_scheduler_runs_a_job_in_one_process_per_period(tmp_path: Path) -> None:
    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider()) as one, App(config, llm=ScriptedProvider()) as two:
        runs: list[str] = []
        schedulers = []
        for name, app in (("one", one), ("two", two)):
            scheduler = Scheduler(gate=app.fleet.claim_period)

            async def job(name: str = name) -> None:
                runs.append(name)

            scheduler.every(1.0, "fleet-probe", job, first_after=0.0)
            scheduler.start()
            schedulers.append(scheduler)
        await asyncio.sleep(3.5)
        for scheduler in schedulers:
            await scheduler.aclose()
        assert 3 <= len(runs) <= 5  # about one per second between both, never one per process
        skipped = sum(s.jobs["fleet-probe"].elsewhere for s in schedulers)
        described = " ".join(s.jobs["fleet-probe"].describe() for s in schedulers)
        assert skipped >= 2 and "run by another process" in described


async def test_admin_changes_reach_the_other_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cortex.settings as settings_module

    monkeypatch.setattr(settings_module, "CACHE_SECONDS", 0.0)
    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider(), embedder=HashEmbedder()) as one, \
            App(config, llm=ScriptedProvider(), embedder=HashEmbedder()) as two:
        admin = CommandContext("console", "console:root", "Root", "console:room", "Cora", is_dm=True, is_admin=True,
                               is_bot_admin=True)
        reply = await one.commands.dispatch("!cortex weights vector=0.9 text=0.05", admin)
        assert "0.9" in reply.text
        await two.cortex.memory_admin.load()  # what its reload job does every few seconds
        assert two.cortex.memory.weights.vector == 0.9 and two.cortex.memory.weights.text == 0.05
        await one.commands.dispatch("!cortex settings cooldown_seconds 7", admin)
        assert (await two.cortex.resolver.effective("Cora")).settings.cooldown_seconds == 7
        await one.commands.dispatch("!cortex weights default", admin)
        await two.cortex.memory_admin.load()
        assert two.cortex.memory.weights.vector == config.memory.weight_vector


@pytest.mark.slow
def test_status_lists_live_processes_and_the_queue(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    config = write_config(tmp_path, fake_llm)

    async def alive() -> None:
        from bot.config import load_config

        async with App(load_config(config), llm=ScriptedProvider()) as app:
            app.fleet.info = {"adapters": ["discord"], "discord_shards": "0, 1 of 4", "web": "http://127.0.0.1:8080"}
            await app.fleet.heartbeat()
            await app.storage.enqueue_job("probe", "k", {}, 1)
            result = await asyncio.to_thread(cortexbot, "--config", str(config), "status")
            assert result.returncode == 0, result.stderr
            assert "1 live process(es)" in result.stdout and app.fleet.process_id in result.stdout
            assert "0, 1 of 4" in result.stdout and "1 queued" in result.stdout
            assert "web page: http://127.0.0.1:8080" in result.stdout  # (a process serving the page says so)
        result = cortexbot("--config", str(config), "status")
        assert "0 live process(es)" in result.stdout  # a clean stop leaves the fleet

    asyncio.run(alive())


def test_status_leaves_out_a_process_of_this_machine_that_was_killed(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """A chat killed with kill -9 stayed a "live process" in status (and in doctor) until its heartbeat aged out,
    "up" still counting; copy-data already told such a pid from a live one."""
    import socket
    import subprocess
    import sys
    import time

    from bot.config import load_config

    config = write_config(tmp_path, fake_llm)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)

    async def beats() -> None:
        async with App(load_config(config), llm=ScriptedProvider()) as app:
            await app.fleet.heartbeat()  # (this one lives: the test's own process)
            await app.storage.fleet.heartbeat("killed-one", socket.gethostname(), dead_pid, {"adapters": ["terminal"]},
                                              time.time() - 30)
            await app.storage.fleet.heartbeat("elsewhere", "another-host", dead_pid, {}, time.time() - 30)
            result = await asyncio.to_thread(cortexbot, "--config", str(config), "status")
            assert result.returncode == 0, result.stderr
            assert "2 live process(es)" in result.stdout and "killed-one" not in result.stdout, result.stdout
            assert app.fleet.process_id in result.stdout and "elsewhere" in result.stdout  # (another machine's: kept)

    asyncio.run(beats())


@pytest.mark.slow
def test_status_shows_a_terminal_chat_at_once(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """A chat's process beat first with no adapters and said what it is only at its next beat."""
    import os
    import subprocess
    import time

    from tests.test_cli import API_KEY, BIN

    config = write_config(tmp_path, fake_llm)
    env = {**os.environ, "CB_TEST_API_KEY": API_KEY, "OPENBLAS_NUM_THREADS": "1"}
    chat = subprocess.Popen([str(BIN / "cortexbot"), "--config", str(config), "chat", "--user", "ann"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            result = cortexbot("--config", str(config), "status")
            if "1 live process(es)" in result.stdout or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "1 live process(es)" in result.stdout, result.stdout + result.stderr
        assert "terminal" in result.stdout and "workers only" not in result.stdout, result.stdout
    finally:
        chat.communicate(b"", timeout=60)
    assert chat.returncode == 0


async def test_a_user_forgotten_by_another_process_can_talk_again_at_once(tmp_path: Path) -> None:
    from bot.ports import IncomingMessage

    config = _config(tmp_path)
    async with App(config, llm=ScriptedProvider()) as one, App(config, llm=ScriptedProvider()) as two:
        def hello(text: str) -> IncomingMessage:
            return IncomingMessage("console", "dm-ann", "ann", "Ann", text, is_dm=True)

        await one.core.reply(hello("my cat is called Pixel")).text()  # "one" now has Ann cached
        ann = CommandContext("console", "console:ann", "Ann", "console:dm-ann", "Cora", is_dm=True)
        assert "Done" in (await two.commands.dispatch("!memory forget-me confirm", ann)).text
        await one.core.reply(hello("hello again")).text()  # no stale user id: stored for a new Ann
        user = await two.storage.get_user("console:ann")
        assert user is not None
        texts = [m.text for m, _channel in await two.storage.cortex.pair_messages(user.id, "Cora", 10)]
        assert [t for t in texts if "Pixel" in t] == [] and "hello again" in texts
