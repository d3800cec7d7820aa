"""``/healthz`` and ``/metrics`` on the real bot: what an orchestrator and Prometheus read, that metrics
move with real replies, carry no user text or ids, can be switched off or served on their own port."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import aiohttp
import pytest

from adapters.web import health
from bot.ports import IncomingMessage
from tests.web_support import free_port, running_bot


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CB_WEB_TEST_KEY", "test-key")
    monkeypatch.setattr(health, "GAUGE_SECONDS", 0.0)  # every scrape reads the database (one test says otherwise)


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus' text format (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "") + r" (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return await response.text()


async def test_metrics_count_replies_and_tokens_and_show_no_user_text(tmp_path: Path) -> None:
    secret = "Ann's secret pancake recipe"
    async with running_bot(tmp_path) as bot:
        before = await scrape(bot.url)
        bot.app.llm.enqueue("Lovely, tell me more.")  # type: ignore[attr-defined]
        message = IncomingMessage("discord", "dm-ann", "4242", "Ann", secret, is_dm=True)
        assert await bot.app.core.reply(message, "Cora").text() == "Lovely, tell me more."
        await bot.app.cortex.memory.remember((await bot.app.cortex.store.pair_for("discord:4242", "Ann", "Cora"))[1].id,
                                             "Ann bakes on Sundays")
        after = await scrape(bot.url)
    assert sample(after, "cortexbot_replies_total") == sample(before, "cortexbot_replies_total") + 1
    calls = ("cortexbot_llm_calls_total", {"purpose": "reply", "outcome": "ok"})
    assert sample(after, calls[0], **calls[1]) == sample(before, calls[0], **calls[1]) + 1
    tokens = ("cortexbot_llm_tokens_total", {"purpose": "reply", "direction": "output"})
    assert sample(after, tokens[0], **tokens[1]) == sample(before, tokens[0], **tokens[1]) + 10
    assert sample(after, "cortexbot_reply_overhead_seconds_count") == sample(
        before, "cortexbot_reply_overhead_seconds_count") + 1
    assert sample(after, "cortexbot_history_window_utilisation_count") >= 1
    assert sample(after, "cortexbot_memory_items", state="active") == 1
    assert sample(after, "cortexbot_storage_up") == 1
    assert 'cortexbot_jobs{status="queued"}' in after
    for leak in ("pancake", "Sundays", "4242", "Ann", "dm-ann"):
        assert leak not in after


async def test_healthz_reports_database_adapters_and_queue(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot:
        async with aiohttp.ClientSession() as http, http.get(bot.url + "/healthz") as response:
            assert response.status == 200
            body = await response.json()
        assert body["status"] == "ok" and body["database"] is True
        assert body["adapters"] == {"discord": True}
        assert set(body["queue"]) == {"queued", "running", "failed"}
        bot.server.context.adapters["matrix"] = lambda: False
        async with aiohttp.ClientSession() as http, http.get(bot.url + "/healthz") as response:
            assert response.status == 200 and (await response.json())["status"] == "degraded"
        await bot.app.storage.close()  # the database goes away under a running server
        try:
            async with aiohttp.ClientSession() as http, http.get(bot.url + "/healthz") as response:
                assert response.status == 503
                assert (await response.json())["database"] is False
            async with aiohttp.ClientSession() as http, http.get(bot.url + "/metrics") as response:
                assert response.status == 200
                assert sample(await response.text(), "cortexbot_storage_up") == 0
        finally:
            await bot.app.storage.db.open()  # type: ignore[attr-defined]  # back, so the bot stops cleanly


async def test_metrics_can_be_switched_off_or_served_on_their_own_port(tmp_path: Path) -> None:
    async with running_bot(tmp_path, metrics=False) as bot:
        async with aiohttp.ClientSession() as http, http.get(bot.url + "/metrics") as response:
            assert response.status == 404
    port = free_port()
    async with running_bot(tmp_path / "own", metrics_port=port) as bot:
        assert bot.server.metrics_url == f"http://127.0.0.1:{port}"
        assert "cortexbot_replies_total" in await scrape(bot.server.metrics_url)
        async with aiohttp.ClientSession() as http, http.get(bot.url + "/metrics") as response:
            assert response.status == 404  # not on the page's port any more
        async with aiohttp.ClientSession() as http, http.get(bot.server.metrics_url + "/api/me") as response:
            assert response.status == 404  # the metrics port serves nothing else
        async with aiohttp.ClientSession() as http, http.get(bot.server.metrics_url + "/nowhere") as response:
            # plain text: the site's error page would link to a page (and a stylesheet) this port does not have
            assert response.status == 404 and await response.text() == "404: Not Found"


async def test_a_taken_port_is_one_clear_error(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot:
        from adapters.web import WebServer

        second = WebServer(bot.app)
        with pytest.raises(RuntimeError, match=r"cannot listen on 127\.0\.0\.1:\d+.*\[web\] host/port"):
            await second.start()


async def test_a_taken_metrics_port_names_the_metrics_keys(tmp_path: Path) -> None:
    """A taken metrics_port said "the web page cannot listen on …: change [web] host/port", which are free."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError) as refused:
            async with running_bot(tmp_path, metrics_port=port):
                pass
    message = str(refused.value)
    assert f"/metrics cannot listen on 127.0.0.1:{port}" in message and "[web] metrics_host/metrics_port" in message
    assert "[web] host/port" not in message and "\n" not in message


async def test_scrapes_in_quick_succession_read_the_database_once(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health, "GAUGE_SECONDS", 3600.0)
    async with running_bot(tmp_path) as bot:
        reads = 0
        queue = bot.app.storage.health.queue

        async def counted() -> object:
            nonlocal reads
            reads += 1
            return await queue()

        monkeypatch.setattr(bot.app.storage.health, "queue", counted)
        first = await scrape(bot.url)
        texts = await asyncio.gather(*(scrape(bot.url) for _ in range(20)))
        assert reads == 1  # anyone hammering /metrics makes the bot count once per GAUGE_SECONDS
        assert all(sample(t, "cortexbot_storage_up") == 1 for t in (first, *texts))
        pings = 0
        ping = bot.app.storage.health.ping

        async def counted_ping() -> None:
            nonlocal pings
            pings += 1
            await ping()

        monkeypatch.setattr(bot.app.storage.health, "ping", counted_ping)
        healthz_reads = reads
        for _ in range(5):
            async with aiohttp.ClientSession() as http, http.get(bot.url + "/healthz") as response:
                assert response.status == 200 and (await response.json())["queue"]["queued"] >= 0
        assert pings == 5 and reads == healthz_reads + 1  # the database is pinged each time, counted once
