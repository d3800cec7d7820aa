"""The Host header against DNS rebinding, on the real bot: a page the attacker's name points at the bot's
address is refused (421) on every path, the names the page is served under keep working, and a server
listening on every address with no name configured is not checked but says so once."""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.web_support import Bot, free_port, running_bot

EVIL = "evil.example:8080"
PAGES = ("/", "/static/app.js", "/login/sometoken", "/nowhere", "/healthz")


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CB_WEB_TEST_KEY", "test-key")


def local(bot: Bot) -> str:
    """The page's address on loopback (the server may listen on every address)."""
    return f"http://127.0.0.1:{urlsplit(bot.url).port}"


async def answer(url: str, host: str | None = None, method: str = "GET",
                 data: dict[str, str] | None = None) -> tuple[int, str, str]:
    """(status, content type, text) of one request to ``url`` with ``host`` in its Host header (None: the
    client's own, the address's host and port)."""
    headers = {"Host": host} if host is not None else {}
    async with aiohttp.ClientSession() as http, http.request(method, url, headers=headers, data=data,
                                                             allow_redirects=False) as response:
        return response.status, response.content_type, await response.text()


def host_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "adapters.web.hosts" and r.levelno >= logging.WARNING]


async def test_a_request_under_another_name_is_a_421_on_every_path(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:  # (with a valid session cookie, too)
        for path in ("/api/me", "/api/me/items", "/api/admin/overview", "/api/nowhere"):
            async with ann.http.get(path, headers={"Host": EVIL}) as response:
                assert response.status == 421, path
                assert "Host header" in (await response.json())["error"], path
        for path in (*PAGES, "/metrics"):
            status, kind, text = await answer(bot.url + path, EVIL)
            assert status == 421 and kind == "text/html" and "Host header" in text, (path, status, text)
        async with ann.http.post("/api/logout", headers={"Host": EVIL, "X-CSRF-Token": ann.csrf}) as response:
            assert response.status == 421
        assert (await ann.call("GET", "/api/me"))[0] == 200  # still logged in
        _, token = await bot.link("bob")
        assert (await answer(bot.url + "/login", EVIL, "POST", data={"token": token}))[0] == 421
        assert (await answer(bot.url + "/login", None, "POST", data={"token": token}))[0] == 303  # link unused


async def test_the_loopback_names_keep_working_with_any_port_case_and_trailing_dot(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot:
        port = urlsplit(bot.url).port
        for host in (None, f"127.0.0.1:{port}", "LocalHost", "localhost.:1", "[::1]:8080", "127.0.0.1"):
            for path in (*PAGES[:2], "/healthz", "/metrics", "/api/me"):
                status, _, text = await answer(bot.url + path, host)
                assert status == (401 if path == "/api/me" else 200), (host, path, status, text)
        for host in ("localhost.evil.example", "evil.example", "127.0.0.1.evil.example", "127.0.0.1:x", "[::2]"):
            assert (await answer(bot.url + "/healthz", host))[0] == 421, host


async def test_public_urls_host_is_accepted_even_on_every_address(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="adapters.web"):
        async with running_bot(tmp_path, host="0.0.0.0", public_url="https://bot.example.org") as bot:
            for host in ("bot.example.org", "Bot.Example.ORG.:443", "bot.example.org:8080"):
                assert (await answer(local(bot) + "/healthz", host))[0] == 200, host
            assert (await answer(local(bot) + "/healthz", EVIL))[0] == 421
            assert (await answer(local(bot) + "/healthz", "0.0.0.0"))[0] == 421  # a wildcard names no host
    assert not any("not checked" in w for w in host_warnings(caplog))


async def test_allowed_hosts_are_accepted_and_nothing_beside_them(tmp_path: Path) -> None:
    async with running_bot(tmp_path, allowed_hosts=["bot.lan", "192.168.1.5", "[fd00::5]"]) as bot:
        for host in ("bot.lan", "BOT.lan.:8080", "192.168.1.5:8080", "[FD00::5]:80"):
            assert (await answer(bot.url + "/healthz", host))[0] == 200, host
        for host in (EVIL, "bot.lan.evil.example", "evilbot.lan", "192.168.1.50", "[fd00::6]"):
            assert (await answer(bot.url + "/healthz", host))[0] == 421, host


async def test_a_refused_host_is_logged_once_short_and_escaped(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    hostile = "\u202eevil." + "x" * 300 + ".example"  # a right-to-left override and a long name
    with caplog.at_level(logging.DEBUG, logger="adapters.web"):
        async with running_bot(tmp_path) as bot:
            for _ in range(3):
                assert (await answer(bot.url + "/api/me", hostile))[0] == 421
    warnings = host_warnings(caplog)
    assert len(warnings) == 1 and "'\\u202eevil.xxx" in warnings[0] and "allowed_hosts" in warnings[0], warnings
    assert "\u202e" not in caplog.text and "x" * 100 not in caplog.text


async def test_every_address_and_no_name_is_not_checked_and_warns_once(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="adapters.web"):
        async with running_bot(tmp_path, host="0.0.0.0") as bot:
            for path in ("/healthz", "/api/me", "/"):
                assert (await answer(local(bot) + path, EVIL))[0] in (200, 401), path
    warnings = host_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "not checked" in warnings[0] and "public_url or allowed_hosts" in warnings[0], warnings


async def test_a_star_in_allowed_hosts_switches_the_check_off_without_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="adapters.web"):
        async with running_bot(tmp_path / "star", host="0.0.0.0", allowed_hosts=["*"]) as bot:
            assert (await answer(local(bot) + "/healthz", EVIL))[0] == 200
        async with running_bot(tmp_path / "loopback", allowed_hosts=["*"]) as bot:
            assert (await answer(bot.url + "/healthz", EVIL))[0] == 200
    assert host_warnings(caplog) == []


async def test_the_metrics_server_checks_the_host_with_its_own_name_added(tmp_path: Path) -> None:
    port = free_port()
    async with running_bot(tmp_path, metrics_host="127.0.0.2", metrics_port=port) as bot:
        metrics = bot.server.metrics_url + "/metrics"
        assert metrics == f"http://127.0.0.2:{port}/metrics"
        for host in (None, "127.0.0.2", "localhost", "127.0.0.1:9108"):
            assert (await answer(metrics, host))[0] == 200, host
        status, kind, text = await answer(metrics, EVIL)
        assert status == 421 and kind == "text/plain" and text.startswith("421: "), (status, text)
        assert (await answer(bot.url + "/healthz", "127.0.0.2"))[0] == 421  # the metrics server's name only


def test_an_ipv6_address_matches_however_it_is_written() -> None:
    """One IPv6 address has many spellings: a configured one matches the shortest, which browsers send."""
    from adapters.web.hosts import allowed_hosts, host_name
    from bot.config import WebConfig

    assert host_name("[2001:DB8:0:0::5]:8080") == host_name("[2001:db8::5]") == "[2001:db8::5]"
    assert host_name("2001:db8:0:0::5") == "[2001:db8::5]" and host_name("[not:an:address") is None
    names = allowed_hosts(WebConfig(host="2001:db8:0:0::5"), "2001:db8:0:0::5")
    assert names is not None and "[2001:db8::5]" in names
