"""The web page's hardening, on the real bot and its storage: corrections and forgets of one item racing
(exactly one lands, in the database's own check), files made from their templates once however many first
visits race, Discord's answers about non-members kept briefly (the bot's rate limit), undecodable CSRF
headers, security headers on aiohttp's own error pages, server keys the bot never reads, login tokens kept
out of the log, links in memory shown as text, and the [access] lists applied to web sessions."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import pytest
from aiohttp.http_exceptions import BadHttpMessage, BadStatusLine, InvalidHeader, InvalidURLError, LineTooLong

from adapters.admin_directory import DiscordAdminDirectory
from adapters.web import WebServer, api_me
from adapters.web import auth as auth_module
from adapters.web import server as server_module
from adapters.web.render import HtmlRenderer, markdown_html, side_by_side
from bot.app import App
from bot.config import DiscordConfig
from cortex.files import CortexFiles
from cortex.memory.embedders import HashEmbedder
from cortex.memory.store import MemoryConflict, MemoryError
from cortex.store import FILENAMES, CortexStore, FileVersion
from tests.fakes.provider import ScriptedProvider
from tests.test_web_admin import FakeGuild, member
from tests.web_support import Bot, Client, context, running_bot, web_config

FILES = "/api/me/personas/Cora/files"


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CB_WEB_TEST_KEY", "test-key")


async def ann_item(bot: Bot, text: str = "Ann lives in Bern") -> tuple[int, int]:
    """(Ann's pair with Cora, a new memory item of hers)."""
    _, pair = await bot.app.cortex.store.pair_for("discord:ann", "Ann", "Cora")
    return pair.id, (await bot.app.cortex.memory.remember(pair.id, text)).id


async def active_corrections(bot: Bot, pair_id: int, item_id: int) -> list[int]:
    items, _ = await bot.app.cortex.memory.list_items(pair_id, limit=100)
    return [i.id for i in items if i.supersedes == item_id]


# -- 1: one correction of an item, however many race -------------------------------------------------


@pytest.mark.both_engines
async def test_concurrent_corrections_of_one_item_land_once(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot:
        memory = bot.app.cortex.memory
        pair, old = await ann_item(bot)
        results = await asyncio.gather(
            *(memory.remember(pair, f"Ann lives in town {n}", supersedes=old) for n in range(6)),
            return_exceptions=True)
        landed = [r for r in results if not isinstance(r, BaseException)]
        assert len(landed) == 1, results
        assert all(isinstance(r, MemoryError) for r in results if isinstance(r, BaseException)), results
        assert await active_corrections(bot, pair, old) == [landed[0].id]
        assert (await memory.get(pair, old, count_access=False)).superseded_by == landed[0].id


@pytest.mark.both_engines
async def test_the_database_refuses_a_correction_of_an_item_no_longer_active(tmp_path: Path) -> None:
    """The check is in the transaction's UPDATE: a correction whose earlier look found the item active
    stores nothing once another correction or a forget got there first."""
    async with running_bot(tmp_path) as bot:
        memory, repo = bot.app.cortex.memory, bot.app.storage.memory
        pair, old = await ann_item(bot)
        fields = {"category": "fact", "content": "Ann lives in Basel", "source": "user"}
        assert await repo.add_item(pair, fields, old, 1.0) is not None
        assert await repo.add_item(pair, fields, old, 2.0) is None  # corrected meanwhile
        _, other = await ann_item(bot, "Ann plays chess")
        await memory.archive(pair, other, "forgotten by the user")
        assert await repo.add_item(pair, fields, other, 3.0) is None  # archived meanwhile
        items, total = await memory.list_items(pair, limit=100)
        assert total == 1 and [i.content for i in items] == ["Ann lives in Basel"]  # nothing else was stored


@pytest.mark.both_engines
async def test_a_forget_racing_a_correction_leaves_no_archived_item_with_an_active_correction(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot:
        memory = bot.app.cortex.memory
        pair, old = await ann_item(bot)
        results = await asyncio.gather(memory.archive(pair, old, "forgotten by the user"),
                                       memory.remember(pair, "Ann lives in Zurich", supersedes=old),
                                       return_exceptions=True)
        assert sum(isinstance(r, MemoryError) for r in results) == 1, results
        now = await memory.get(pair, old, count_access=False)
        assert (now.archived_at is None) != (now.superseded_by is None), now  # archived or corrected, not both
        with pytest.raises(MemoryError, match="corrected by|archived"):
            await memory.archive(pair, old, "again")


@pytest.mark.both_engines
async def test_concurrent_patches_of_one_item_answer_one_200_and_409s(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        pair, old = await ann_item(bot)
        answers = await asyncio.gather(*(ann.call("PATCH", f"/api/me/items/{old}", {"content": f"Ann in town {n}"})
                                         for n in range(4)))
        assert sorted(status for status, _ in answers) == [200, 409, 409, 409], answers
        assert len(await active_corrections(bot, pair, old)) == 1
        # A request that read the item before the correction landed meets the store's own check: a conflict
        # (409) too, as the one that met it inside the transaction, never a 422 depending on the timing.
        with pytest.raises(MemoryConflict, match="already corrected"):
            await bot.app.cortex.memory.remember(pair, "Ann in town later", supersedes=old)
        _, fresh = await ann_item(bot, "Ann plays chess")
        raced = await asyncio.gather(ann.call("POST", f"/api/me/items/{fresh}/forget"),
                                     ann.call("PATCH", f"/api/me/items/{fresh}", {"content": "Ann plays go"}))
        assert sorted(status for status, _ in raced) == [200, 409], raced  # forgotten or corrected, not both
        assert all("meanwhile" in body["error"] or "corrected by" in body["error"] or "archived" in body["error"]
                   for status, body in (*answers, *raced) if status == 409), (answers, raced)


# -- 2: files from their templates, once -------------------------------------------------------------


@pytest.mark.both_engines
async def test_concurrent_first_visits_make_each_file_once(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        answers = await asyncio.gather(*(ann.call("GET", FILES) for _ in range(8)))
        assert [status for status, _ in answers] == [200] * 8, answers
        _, pair = await bot.app.cortex.store.pair_for("discord:ann", "Ann", "Cora")
        for filename in FILENAMES:
            assert [v.version for v in await bot.app.cortex.store.versions(pair.id, filename)] == [1], filename


@pytest.mark.both_engines
async def test_concurrent_ensures_through_the_store_make_one_version_each(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot:
        _, pair = await bot.app.cortex.store.pair_for("discord:bob", "Bob", "Cora")
        made = await asyncio.gather(*(bot.app.cortex.files.ensure(pair, "English", "Bob") for _ in range(8)))
        assert all({f: v.version for f, v in files.items()} == dict.fromkeys(FILENAMES, 1) for files in made), made
        for filename in FILENAMES:
            assert len(await bot.app.cortex.store.versions(pair.id, filename)) == 1


class FirstEditMeanwhile(CortexStore):
    """The real store, with the user's first save landing just after a look found the files missing."""

    async def current_all(self, pair_id: int) -> dict[str, FileVersion]:
        found = await super().current_all(pair_id)
        await self.add_version(pair_id, "memory.md", "# Bob's own notes", "user", "edited by the user")
        return found


@pytest.mark.both_engines
async def test_a_template_never_lands_after_the_users_first_edit(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot:
        _, pair = await bot.app.cortex.store.pair_for("discord:bob", "Bob", "Cora")
        files = await CortexFiles(FirstEditMeanwhile(bot.app.storage), 8000).ensure(pair, "English", "Bob")
        assert (files["memory.md"].version, files["memory.md"].content) == (1, "# Bob's own notes")
        versions = await bot.app.cortex.store.versions(pair.id, "memory.md")
        assert [(v.version, v.author) for v in versions] == [(1, "user")]


# -- 3: Discord's answers about a server's members, kept briefly --------------------------------------


def books(**kept: float) -> tuple[DiscordAdminDirectory, FakeGuild]:
    """discord:1 "Books": discord:10 (cached) holds Manage Server, discord:11 is an administrator Discord
    has not sent the bot yet, discord:20 is no member."""
    guild = FakeGuild(1, "Books", [member(10, manage=True)], [member(11, administrator=True)])
    client = SimpleNamespace(guilds=[guild], get_guild=lambda gid: guild if gid == 1 else None)
    return DiscordAdminDirectory(client, DiscordConfig(), **kept), guild


async def test_a_non_members_requests_ask_discord_once(tmp_path: Path) -> None:
    directory, guild = books()
    async with running_bot(tmp_path, directories=[directory]) as bot, bot.client("20") as outsider:
        path = f"/api/admin/servers/{quote('discord:1', safe='')}/guidelines"
        for _ in range(5):
            assert (await outsider.call("GET", path))[0] == 403
        answers = await asyncio.gather(*(outsider.call("GET", path) for _ in range(5)))
        assert [status for status, _ in answers] == [403] * 5
        assert guild.fetched == [20]


async def test_kept_answers_are_asked_again_after_their_time() -> None:
    directory, guild = books(answer_seconds=0.2)
    assert await asyncio.gather(*(directory.is_admin("discord:11", "discord:1") for _ in range(4))) == [True] * 4
    assert not await directory.is_admin("discord:20", "discord:1")
    assert guild.fetched == [11, 20]
    del guild.remote[11]  # no longer a member: the kept yes holds only until its time is up
    assert await directory.is_admin("discord:11", "discord:1")
    await asyncio.sleep(0.25)
    assert not await directory.is_admin("discord:11", "discord:1")
    assert await directory.is_admin("discord:10", "discord:1")  # from the member cache, never fetched
    assert guild.fetched == [11, 20, 11]



def _member_payload(user_id: int, roles: list[int]) -> dict[str, Any]:
    return {"user": {"id": str(user_id), "username": "mal", "discriminator": "0", "avatar": None},
            "roles": [str(r) for r in roles], "joined_at": "2024-01-01T00:00:00+00:00", "deaf": False, "mute": False,
            "flags": 0}


async def test_a_member_cached_for_voice_is_asked_anew_without_the_members_intent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bot's own intents leave out the (privileged) members intent, so Discord sends no member updates; but
    discord.py still caches whoever is in a voice channel, with the roles they had when they joined it. A
    moderator demoted while in voice stayed an admin of the server on the web page for as long as they stayed."""
    import discord

    from adapters.discord import default_intents

    client = discord.Client(intents=default_intents())
    state = client._connection
    state.user = discord.ClientUser(state=state, data={"id": "1", "username": "bot", "discriminator": "0",
                                                       "avatar": None, "bot": True})
    role = {"color": 0, "hoist": False, "managed": False, "mentionable": False}
    guild = discord.Guild(state=state, data={"id": "100", "name": "Books", "owner_id": "9", "roles": [
        {"id": "100", "name": "@everyone", "permissions": "0", "position": 0, **role},
        {"id": "200", "name": "Mods", "permissions": str(discord.Permissions(manage_guild=True).value),
         "position": 1, **role}], "channels": [], "members": [], "emojis": [], "features": []})
    state._add_guild(guild)
    state.parse_voice_state_update({  # joins a voice channel as a moderator: cached with the Mods role
        "guild_id": "100", "channel_id": "300", "user_id": "42", "member": _member_payload(42, [200]),
        "session_id": "s", "deaf": False, "mute": False, "self_deaf": False, "self_mute": False, "suppress": False,
        "self_video": False, "request_to_speak_timestamp": None})
    assert guild.get_member(42) is not None

    async def fetch_member(self: Any, user_id: int) -> Any:  # what Discord says now: the Mods role is gone
        return discord.Member(data=_member_payload(user_id, []), guild=self, state=state)  # type: ignore[arg-type]

    monkeypatch.setattr(discord.Guild, "fetch_member", fetch_member)
    directory = DiscordAdminDirectory(client, DiscordConfig())
    assert not await directory.is_admin("discord:42", "discord:100")


# -- 4: an undecodable CSRF header --------------------------------------------------------------------


async def raw_request(url: str, head: bytes) -> bytes:
    """Send ``head`` (a request without a body) to the server as bytes; its answer's status line."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(head)
        await writer.drain()
        return await reader.readline()
    finally:
        writer.close()
        await writer.wait_closed()


async def test_a_csrf_header_that_is_not_utf8_is_a_403(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        session = next(c for c in ann.http.cookie_jar if c.key == "cortexbot_session").value
        host = urlsplit(bot.url).netloc.encode()
        for token in (b"\xff\xfe", ann.csrf.encode() + b"\xc3", b"\xed\xa0\x80"):
            head = (b"POST /api/logout HTTP/1.1\r\nHost: " + host + b"\r\nCookie: cortexbot_session="
                    + session.encode() + b"\r\nX-CSRF-Token: " + token + b"\r\nContent-Length: 0\r\n"
                    b"Connection: close\r\n\r\n")
            assert (await raw_request(bot.url, head)).startswith(b"HTTP/1.1 403"), token
        assert (await ann.call("GET", "/api/me"))[0] == 200  # still logged in


async def test_a_body_that_cannot_be_read_is_a_400_not_a_500(tmp_path: Path) -> None:
    """A multipart part without its colon, an unknown transfer encoding of a part, gzip that is not gzip:
    aiohttp raises while reading, and each was a 500 with a traceback in the log."""
    broken = b"--xx\r\nbroken\r\n\r\nv\r\n--xx--\r\n"
    odd_encoding = (b"--xx\r\nContent-Disposition: form-data; name=\"token\"\r\nContent-Transfer-Encoding: bogus"
                    b"\r\n\r\nv\r\n--xx--\r\n")
    multipart = {"Content-Type": "multipart/form-data; boundary=xx"}
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        for path, body, headers in (
                ("/login", broken, multipart), ("/login", odd_encoding, multipart),
                ("/login", b"token=abc", {"Content-Type": "application/x-www-form-urlencoded",
                                          "Content-Encoding": "gzip"}),
                ("/api/me/forget-me", b"{not gzip", {"Content-Type": "application/json", "Content-Encoding": "gzip",
                                                     "X-CSRF-Token": ann.csrf})):
            # (aiohttp closes such a connection after the answer: one connection per request)
            async with ann.http.post(path, data=body, headers=headers | {"Connection": "close"},
                                     allow_redirects=False) as response:
                assert response.status == 400, (path, headers, response.status, await response.text())
        assert (await ann.call("GET", "/api/me"))[0] == 200  # nothing happened: still there, still logged in


async def test_pages_outside_the_api_answer_errors_as_pages_with_a_way_back(tmp_path: Path) -> None:
    """A wrong address or method showed aiohttp's bare "404: Not Found"; a used login link had no way back
    to the page for someone still logged in."""
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        for method, path, status in (("GET", "/nonexistent", 404), ("GET", "/login", 405),
                                     ("POST", "/login/abc", 405), ("POST", "/login", 410)):
            async with ann.http.request(method, path, headers={"X-CSRF-Token": ann.csrf},
                                        data={"token": "used"} if path == "/login" else None) as response:
                body = await response.text()
                assert response.status == status and response.content_type == "text/html", (path, body)
                assert '<a href="/">Go to your page</a>' in body and "<script" not in body, path
                if status == 405:
                    assert response.headers.get("Allow"), path
        async with ann.http.get("/api/nowhere") as response:  # the API keeps answering in JSON
            assert response.status == 404 and (await response.json())["error"]


# -- 5: security headers on aiohttp's own error answers -----------------------------------------------


async def test_error_pages_carry_the_security_headers(tmp_path: Path) -> None:
    async with running_bot(tmp_path, max_body_kb=16) as bot, aiohttp.ClientSession(bot.url) as http:
        for method, path, body, status in (("GET", "/nowhere", None, 404), ("GET", "/static/x.js", None, 404),
                                           ("DELETE", "/login", None, 405), ("PUT", "/", None, 405),
                                           ("POST", "/login", {"token": "x" * 20_000}, 413)):
            async with http.request(method, path, data=body, allow_redirects=False) as response:
                assert response.status == status, (method, path, await response.text())
                assert "default-src 'self'" in response.headers.get("Content-Security-Policy", ""), path
                assert response.headers.get("X-Content-Type-Options") == "nosniff", path
                assert response.headers.get("X-Frame-Options") == "DENY", path
                assert response.headers.get("Referrer-Policy") == "same-origin", path
                if path.startswith("/login"):
                    assert response.headers.get("Cache-Control") == "no-store", path


# -- 6: only server keys the bot reads ---------------------------------------------------------------


def guidelines(server: str) -> str:
    return f"/api/admin/servers/{quote(server, safe='')}/guidelines"


async def test_guidelines_and_settings_only_under_server_keys_the_bot_reads(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("999") as admin:
        bot.server.context.auth.limiter.per_minute = 0  # 24 refused changes in a row: not the rate limit's test
        for key in ("discord:abc", "discord:\uff11", "foo:bar", "discord:01", "discord:", "discord:1.0",
                    "discord:123456789012345678901", "matrix:room:example.org", "matrix:!", "Discord:1",
                    "matrix:!room\u00e9:example.org", "console:room"):
            status, error = await admin.call("PUT", guidelines(key), {"text": "Be kind."})
            assert status == 400 and "no server key" in error["error"], (key, error)
            status, error = await admin.call("PUT", "/api/admin/settings", {
                "persona": "Cora", "server": key, "key": "context_limit", "value": "40"})
            assert status == 400, (key, error)
            assert (await admin.call("GET", f"/api/admin/settings?server={quote(key, safe='')}"))[0] == 400
        for key in ("discord:123456789012345678", "matrix:!room:example.org", "matrix:!abc_DEF-123"):
            status, saved = await admin.call("PUT", guidelines(key), {"text": "Be kind."})
            assert status == 200 and saved["server"] == key, (key, saved)


# -- 7: login tokens never in the log -----------------------------------------------------------------


async def test_a_failing_login_page_logs_no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    async with running_bot(tmp_path) as bot, aiohttp.ClientSession(bot.url) as http:
        link, token = await bot.link("ann")

        async def broken(_: str) -> bool:
            raise RuntimeError("the database went away")

        monkeypatch.setattr(bot.app.storage.web, "link_valid", broken)  # an unexpected failure, injected
        with caplog.at_level(logging.INFO, logger="adapters.web"):
            async with http.get(urlsplit(link).path) as response:
                assert response.status == 500
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "/login/<token>" in logged and token not in logged and token not in caplog.text, logged


async def test_a_malformed_request_logs_one_line_without_its_token(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp logged each request it could not parse at ERROR with a traceback quoting the line it failed on: a
    login link's token, or a header's value (a session cookie), with it, and ten lines per garbage request. Now
    one line at INFO saying what was wrong, nothing of the request quoted."""
    async with running_bot(tmp_path) as bot:
        link, token = await bot.link("ann")
        path = urlsplit(link).path.encode()
        host, port = urlsplit(bot.url).hostname, urlsplit(bot.url).port
        garbage = (b"GET " + path + b" HTTP/9.9\r\nHost: x\r\n\r\n",  # unsupported version
                   b"G@T " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # invalid method
                   b"GET " + path + b"\x01 HTTP/1.1\r\nHost: x\r\n\r\n",  # invalid character in the path
                   b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: " + token.encode() + b"\r\n\r\n")
        with caplog.at_level(logging.DEBUG, logger="aiohttp"):
            for raw in garbage:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(raw)
                assert (await asyncio.wait_for(reader.read(100), 10)).startswith(b"HTTP/1.0 400"), raw
                writer.close()
            await asyncio.sleep(0.1)
        served = [r for r in caplog.records if r.name == "aiohttp.server"]
        assert len(served) == len(garbage), [r.getMessage() for r in served]
        assert all(r.levelno == logging.INFO and r.exc_info is None for r in served)
        assert all(r.getMessage().startswith("malformed request") for r in served)
        assert token not in caplog.text and "/login" not in caplog.text, caplog.text
        assert "Invalid method" in caplog.text and "Content-Length" in caplog.text


async def test_a_line_too_long_logs_none_of_its_bytes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp's message for a line over 8190 bytes quotes its first 100 ("Got more than 8190 bytes when reading:
    b'…'"): a session cookie's value or a query string's went to the log with the one-line note."""
    secret = "S3cr3tSessionId0123456789"
    async with running_bot(tmp_path) as bot:
        host, port = urlsplit(bot.url).hostname, urlsplit(bot.url).port
        garbage = (f"GET /api/me HTTP/1.1\r\nHost: x\r\nCookie: cortexbot_session={secret}; other={'a' * 9000}"
                   f"\r\n\r\n".encode(),
                   f"GET /api/me?session={secret}&pad={'b' * 9000} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        with caplog.at_level(logging.DEBUG, logger="aiohttp"):
            for raw in garbage:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(raw)
                assert (await asyncio.wait_for(reader.read(100), 10)).startswith(b"HTTP/1.0 400"), raw[:60]
                writer.close()
            await asyncio.sleep(0.1)
        served = [r.getMessage() for r in caplog.records if r.name == "aiohttp.server"]
        assert len(served) == len(garbage) and all(m.startswith("malformed request") for m in served), served
        assert all("Got more than 8190 bytes" in m for m in served), served
        assert secret not in caplog.text and "aaaa" not in caplog.text and "bbbb" not in caplog.text, caplog.text


def test_a_malformed_requests_note_quotes_nothing_of_it() -> None:
    """However aiohttp quotes the request (bytes, a bytearray, a string, or the bare URL it could not read), the
    logged note keeps only its own words."""
    for exc, said in ((LineTooLong(b"Cookie: id=SECRET", 8190), "Got more than 8190 bytes when reading"),
                      (LineTooLong(bytearray(b"id=SECRET"), 8190), "Got more than 8190 bytes when reading"),
                      (InvalidHeader(b"SECRET"), "Invalid HTTP header"),
                      (BadStatusLine("GET /?id=SECRET HTTP/9"), "Bad status line"),
                      (BadHttpMessage("Duplicate 'SECRET' header found."), "Duplicate"),
                      (InvalidURLError("//host?id=SECRET"), "InvalidURLError"),
                      (BadHttpMessage("Invalid method encountered:\n\n  b'G@T /?id=SECRET'\n  ^"),
                       "Invalid method encountered")):
        assert server_module.malformed_detail(exc) == said, exc


# -- 8: links in memory are text ---------------------------------------------------------------------


def test_links_in_memory_are_shown_as_text_not_followed() -> None:
    for text, shown in (("[x](//evil.example/login)", "//evil.example/login"),
                        ("<https://evil.example/x>", "https://evil.example/x"),
                        ("[click](https://evil.example/a \"t\")", "https://evil.example/a"),
                        ("[a]: https://evil.example/ref\n\n[a]", "https://evil.example/ref"),
                        ("<ann@evil.example>", "ann@evil.example")):
        rendered = markdown_html(text)
        assert "<a" not in rendered and "href" not in rendered, rendered
        assert shown in rendered, rendered
    assert markdown_html("# Ann\n- likes *tea*") == "<h1>Ann</h1>\n<ul>\n<li>likes <em>tea</em></li>\n</ul>\n"


# -- 9: the [access] lists on the web -----------------------------------------------------------------


@asynccontextmanager
async def bot_with_access(tmp_path: Path, **access: list[str]) -> AsyncIterator[Bot]:
    """The bot restarted on the same database (sessions survive) with these ``[access]`` lists."""
    config = web_config(tmp_path)
    config = config.model_copy(update={"access": config.access.model_copy(update=access)})
    async with App(config, llm=ScriptedProvider(), embedder=HashEmbedder()) as app:
        server = WebServer(app)
        await server.start()
        try:
            yield Bot(app, server)
        finally:
            await server.stop()


async def session_of(bot: Bot, user: str) -> str:
    async with bot.client(user) as client:
        return next(c for c in client.http.cookie_jar if c.key == "cortexbot_session").value


async def call_as(bot: Bot, session: str, method: str, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession(bot.url, cookies={"cortexbot_session": session}) as http:
        client = Client(http, "", {})
        status, me = await client.call("GET", "/api/me")
        if method == "GET" or status != 200:
            return status, me
        client.csrf = me["csrf"]
        return await client.call(method, path)


async def stored_sessions(bot: Bot) -> list[str]:
    return sorted(str(r[0]) for r in await bot.app.storage.db.fetch_all("SELECT user_key FROM web_sessions"))


@pytest.mark.both_engines
async def test_a_denied_users_session_ends_when_the_page_starts(tmp_path: Path) -> None:
    """A session of a user the operator then denied was refused (403) but kept: lifting the deny later brought
    it back, for the rest of its 12 hours (up to 90 days), to whoever held the cookie, and the denied user
    could not end it (its logout was refused too)."""
    async with running_bot(tmp_path) as bot:
        sessions = {user: await session_of(bot, user) for user in ("ann", "bob", "carl")}
        _, unused = await bot.link("ann")
    async with bot_with_access(tmp_path, deny_users=["discord:ann"]) as bot:
        assert await stored_sessions(bot) == ["discord:bob", "discord:carl"]
        for method, path in (("GET", "/api/me"), ("GET", "/api/me/items"), ("GET", FILES)):
            assert (await call_as(bot, sessions["ann"], method, path))[0] == 401, path
        assert (await call_as(bot, sessions["bob"], "POST", "/api/logout"))[0] == 200
    async with bot_with_access(tmp_path, allow_users=["discord:ann"], deny_users=["discord:ann"]) as bot:
        assert await stored_sessions(bot) == []  # carl is not on the allow list; the deny list wins for ann
    async with bot_with_access(tmp_path) as bot:  # the lists lifted: nothing comes back
        for user in ("ann", "carl"):
            assert (await call_as(bot, sessions[user], "GET", "/api/me"))[0] == 401, user
        assert not await bot.app.storage.web.link_valid(unused)


@pytest.mark.both_engines
async def test_a_denied_users_session_opened_meanwhile_is_refused_and_ended(tmp_path: Path) -> None:
    """A link another process of the fleet handed out (its config lists nobody) opens a session here after
    the start: the first request is refused with the reason, and the session ends with it."""
    async with bot_with_access(tmp_path, deny_users=["discord:ann"], allow_users=["discord:ann", "discord:bob"]) as bot:
        for user, held in (("ann", "deny_users"), ("carl", "allow_users")):
            token = await bot.app.storage.web.create_link(f"discord:{user}", user.title(), 600)
            session, _ = await bot.app.storage.web.consume_link(token, 3600) or ("", None)
            status, error = await call_as(bot, session, "GET", "/api/me")
            assert status == 403 and held in error["error"] and "ended" in error["error"], (user, error)
            assert (await call_as(bot, session, "GET", "/api/me"))[0] == 401, user
        assert await stored_sessions(bot) == []


@pytest.mark.both_engines
async def test_a_denied_home_servers_matrix_user_is_refused_on_the_page(tmp_path: Path) -> None:
    """In chat, deny_servers holds a Matrix user's home server too (wherever they write); the page took only the
    user lists, so a session opened before the server was denied went on working."""
    async with running_bot(tmp_path) as bot:
        async with bot.client("@mallory:evil.org", platform="matrix") as mallory:
            session = next(c for c in mallory.http.cookie_jar if c.key == "cortexbot_session").value
        other = await session_of(bot, "ann")
    async with bot_with_access(tmp_path, deny_servers=["matrix:evil.org"]) as bot:
        assert await stored_sessions(bot) == ["discord:ann"]  # ended at the start
        assert (await call_as(bot, session, "GET", "/api/me"))[0] == 401
        token = await bot.app.storage.web.create_link("matrix:@mallory:evil.org", "Mallory", 600)  # (another process's)
        session, _ = await bot.app.storage.web.consume_link(token, 3600) or ("", None)
        status, error = await call_as(bot, session, "POST", "/api/me/personas/Cora/files/memory/reset")
        assert status == 403 and "deny_servers" in error["error"], error
        assert (await call_as(bot, other, "GET", "/api/me"))[0] == 200


async def console_login(bot: Bot, user: str) -> aiohttp.ClientSession:
    """A browser logged in through the link the terminal's ``!dashboard`` gives ``console:user``."""
    _, token = await bot.link(user, platform="console")
    http = aiohttp.ClientSession(bot.url, cookie_jar=aiohttp.CookieJar(unsafe=True))
    async with http.post("/login", data={"token": token}, allow_redirects=False) as response:
        assert response.status == 303, await response.text()
    return http


@pytest.mark.both_engines
async def test_a_console_user_the_access_lists_refuse_gets_no_page_and_no_admin_rights(tmp_path: Path) -> None:
    """README: a console:NAME entry counts on the web page. Every console: key got through, as a bot admin: a
    denied console:mallory read /api/admin/users. Only the terminal itself is exempt from the lists."""
    async with bot_with_access(tmp_path, deny_users=["console:mallory"], allow_users=["console:root"]) as bot:
        for user, held in (("mallory", "deny_users"), ("eve", "allow_users")):
            for path in ("/api/me", "/api/admin/users", "/api/admin/overview"):  # (a refusal ends the session)
                async with await console_login(bot, user) as http, http.get(path) as response:
                    error = await response.json()
                    assert response.status == 403 and held in error["error"], (user, path, error)
        async with await console_login(bot, "root") as http:  # the one the lists let in is still the bot's admin
            async with http.get("/api/me") as response:
                assert response.status == 200 and (await response.json())["is_bot_admin"] is True
            async with http.get("/api/admin/users") as response:
                assert response.status == 200, await response.text()
    config = web_config(tmp_path)
    config.access.deny_users = ["console:mallory"]
    assert not auth_module.is_bot_admin(config, "console:mallory") and auth_module.is_bot_admin(config, "console:ann")


async def test_a_forget_me_from_the_page_says_a_pause_goes_on(tmp_path: Path) -> None:
    """As in chat: the pause survives the forget-me, and the answer names the personas it runs with."""
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        assert "Incognito with Cora" in (await bot.app.commands.dispatch("!memory pause", context("ann"))).text
        status, body = await ann.call("POST", "/api/me/forget-me", {"confirm": "forget me"})
        assert status == 200 and body["still_incognito"] == ["Cora"]
        async with bot.client("ann") as again:  # logged in again: the files are made with her name
            status, me = await again.call("GET", "/api/me")
            assert status == 200 and me["user"]["name"] == "Ann", me
            status, memory = await again.call("GET", "/api/me/personas/Cora/files/memory")
            assert status == 200 and "My memories of Ann" in memory["content"], memory["content"]
    async with running_bot(tmp_path / "other") as bot, bot.client("bob") as bob:
        status, body = await bob.call("POST", "/api/me/forget-me", {"confirm": "forget me"})
        assert status == 200 and body["still_incognito"] == []


async def test_an_unexpected_failure_of_a_page_is_a_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 500 (or a 409 after a forget-me) outside the API came back as raw JSON in the browser."""
    async with running_bot(tmp_path) as bot, aiohttp.ClientSession(bot.url) as http:
        link, _ = await bot.link("ann")

        async def broken(_: str) -> bool:
            raise RuntimeError("the database went away")

        monkeypatch.setattr(bot.app.storage.web, "link_valid", broken)
        async with http.get(urlsplit(link).path) as response:
            body = await response.text()
            assert response.status == 500 and response.content_type == "text/html", body
            assert "Internal error" in body and '<a href="/">Go to your page</a>' in body
            assert '<link rel="icon" href="data:,">' in body  # (no request for /favicon.ico, answered 404)


async def test_changes_from_the_page_keep_the_command_rate_limit(tmp_path: Path) -> None:
    """600 saves of memory.md in under two seconds made 600 versions: the page skipped the limit chat
    commands keep."""
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        bot.app.config.chat.command_rate_limit_per_minute = 5
        bot.server.context.auth.limiter.per_minute = 5
        path = "/api/me/personas/Cora/files/memory.md"
        status, current = await ann.call("GET", path)
        version, statuses = current["version"], []
        for i in range(8):
            status, saved = await ann.call("PUT", path, {"content": f"# Notes\n- fact {i}\n", "version": version})
            statuses.append(status)
            version = saved["version"] if status == 200 else version
        assert statuses[:5] == [200] * 5 and statuses[5:] == [429] * 3
        status, error = await ann.call("PUT", path, {"content": "# Notes\n", "version": version})
        assert status == 429 and "too many changes or exports in a minute (at most 5)" in error["error"]
        assert (await bot.app.cortex.store.current((await _pair(bot, "ann")), "memory.md")).version == version
        status, _ = await ann.call("GET", path)
        assert status == 200  # reading is not limited


async def test_exports_from_the_page_keep_the_command_rate_limit(tmp_path: Path) -> None:
    """Each export zips everything a user has: a script fetching it in a loop kept the bot busy, where the
    chat's !memory export counts against the command limit."""
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann, bot.client("bob") as bob:
        bot.server.context.auth.limiter.per_minute = 3
        statuses = [(await ann.call("GET", "/api/me/export"))[0] for _ in range(5)]
        assert statuses == [200] * 3 + [429] * 2
        status, error = await ann.call("GET", "/api/me/export")
        assert status == 429 and "too many changes or exports in a minute (at most 3)" in error["error"]
        assert (await bob.call("GET", "/api/me/export"))[0] == 200  # the limit is each user's own
        assert (await ann.call("GET", "/api/me/items"))[0] == 200  # other reads are not limited


async def _pair(bot: Bot, user: str) -> int:
    account = await bot.app.storage.get_user(f"discord:{user}")
    assert account is not None
    return (await bot.app.cortex.store.count_messages(account.id, "Cora", 0)).id


async def test_a_long_history_is_listed_newest_first_without_its_contents(tmp_path: Path) -> None:
    import adapters.web.api_me as api_me

    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        status, _ = await ann.call("GET", "/api/me/personas/Cora/files/memory.md")  # makes the files
        user = await bot.app.storage.get_user("discord:ann")
        pair = await bot.app.cortex.store.count_messages(user.id, "Cora", 0)
        for i in range(12):
            await bot.app.cortex.files.edit(pair, "memory.md", f"# Notes\n- fact {i}\n")
        old, api_me.VERSIONS_LISTED = api_me.VERSIONS_LISTED, 5
        try:
            status, listed = await ann.call("GET", "/api/me/personas/Cora/files/memory.md/versions")
        finally:
            api_me.VERSIONS_LISTED = old
        assert status == 200 and listed["total"] == 13
        assert [v["version"] for v in listed["versions"]] == [13, 12, 11, 10, 9]
        assert listed["versions"][0]["chars"] == len("# Notes\n- fact 11\n") and "content" not in listed["versions"][0]
        status, activity = await ann.call("GET", "/api/me/personas/Cora/activity")
        assert [v["version"] for v in activity["files"]["memory.md"]] == list(range(1, 14))  # oldest first


async def test_a_server_the_directory_may_not_ask_about_now_answers_429_not_403(tmp_path: Path) -> None:
    """In a fleet, servers of other processes' shards are asked from Discord only so often: past that the
    answer is neither yes nor no, and a real admin was told they were none."""
    from bot.ports import LookupsSpent

    class Spent:
        platform = "discord"

        async def is_admin(self, user_key: str, server_key: str) -> bool:
            raise LookupsSpent(42.0)

        async def servers(self, user_key: str) -> list[Any]:
            return []

    async with running_bot(tmp_path, directories=[Spent()]) as bot, bot.client("20") as someone:
        status, error = await someone.call("GET", "/api/admin/servers/discord:4194304/guidelines")
        assert status == 429 and "try again in 42 s" in error["error"], error


async def test_a_lost_connection_to_discord_lists_no_servers_and_breaks_nothing(tmp_path: Path) -> None:
    """discord.py lets a reset connection through as an OSError: /api/me (which the page needs first) and
    the admin overview answered 500, so nobody could open their memory while Discord's network hiccuped."""
    directory, guild = books()

    async def reset(user_id: int) -> Any:
        guild.fetched.append(user_id)
        raise ConnectionResetError("Connection reset by peer")

    guild.fetch_member = reset  # type: ignore[method-assign]
    async with running_bot(tmp_path, directories=[directory]) as bot, bot.client("20") as someone:
        asked = len(guild.fetched)  # (logging in asked too)
        status, me = await someone.call("GET", "/api/me")
        assert status == 200 and me["admin_servers"] == [] and len(guild.fetched) == asked + 1
        status, overview = await someone.call("GET", "/api/admin/overview")
        assert status == 200 and overview["servers"] == []
        assert len(guild.fetched) == asked + 2  # a failed answer is not kept: asked again next time


async def test_a_files_html_is_rendered_off_the_event_loop_and_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Markdown is pure Python, about 7 µs a character, and a user's own file can be written to be slow to
    render (``_a`` repeated: 50-60 ms at the default cap, seconds at the largest one). The event loop also
    runs the chat adapters, so every route that shows a file's HTML renders it on a worker thread; and a
    text shown again (the same version, or a reset to the same template) is not rendered again."""
    loop_thread, threads = threading.get_ident(), []

    def recording(text: str) -> str:
        threads.append(threading.get_ident())
        return markdown_html(text)

    monkeypatch.setattr(server_module, "markdown_html", recording)
    path = "/api/me/personas/Cora/files/memory"
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        status, current = await ann.call("GET", path)  # the template: rendered
        assert status == 200 and len(threads) == 1
        status, saved = await ann.call("PUT", path, {"content": "_a" * 3000, "version": current["version"]})
        assert status == 200 and saved["html"].startswith("<p>_a_a") and saved["content"].startswith("_a_a")
        for method, route in (("GET", path), ("GET", f"{path}/versions/1"), ("GET", "/api/me/personas/Cora/files")):
            status, shown = await ann.call(method, route)
            assert status == 200, shown
        status, reset = await ann.call("POST", f"{path}/reset")
        assert status == 200 and reset["html"] == current["html"]
    # the template, the saved text, then soul.md and relationship.md; the rest was kept
    assert len(threads) == 4 and loop_thread not in threads


async def test_one_users_file_views_wait_for_each_other_not_for_everyone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script asking for many long files at once held both render threads, and every other user's views
    (and, through the lock the threads hold, the chat's replies) waited seconds: one user renders one file
    at a time, so another's view always finds a thread."""
    release, rendering, most = threading.Event(), [0], [0]
    lock = threading.Lock()

    def slow(text: str) -> str:
        if "slow" in text:
            with lock:
                rendering[0] += 1
                most[0] = max(most[0], rendering[0])
            release.wait(30)
            with lock:
                rendering[0] -= 1
        return markdown_html(text)

    monkeypatch.setattr(server_module, "markdown_html", slow)
    path = "/api/me/personas/Cora/files/memory"
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann, bot.client("bob") as bob:
        files, store = bot.app.cortex.files, bot.app.cortex.store
        _, pair = await store.pair_for("discord:ann", "Ann", "Cora")
        versions = []
        for i in range(3):
            saved = await files.edit(pair, "memory.md", f"slow {i}\n")
            assert saved is not None
            versions.append(saved.version)
        views = [asyncio.create_task(ann.call("GET", f"{path}/versions/{v}")) for v in versions]
        await asyncio.sleep(0.3)
        status, shown = await bob.call("GET", path)
        assert status == 200 and not any(v.done() for v in views), shown
        release.set()
        assert [(await v)[0] for v in views] == [200] * 3
    assert most[0] == 1


async def test_a_forget_me_from_the_chat_drops_the_pages_kept_html(tmp_path: Path) -> None:
    """The page keeps each file's HTML; a forget-me sent in a chat (not on the page) left it in memory, and a
    render running at that moment was kept after it."""
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        path = "/api/me/personas/Cora/files/memory"
        status, current = await ann.call("GET", path)
        assert status == 200
        saved = await ann.call("PUT", path, {"content": "# Ann's secret diary", "version": current["version"]})
        assert saved[0] == 200
        renderer = bot.server.context.renderer
        assert any("secret diary" in html for html in renderer._kept.values())
        reply = await bot.app.commands.dispatch("!memory forget-me confirm", context("ann"))
        assert "Deleted" in reply.text
        assert not any(owner == "discord:ann" for owner, _ in renderer._kept)
    release = threading.Event()

    def slow(text: str) -> str:
        release.wait(10)
        return markdown_html(text)

    renderer = HtmlRenderer(slow)
    rendering = asyncio.create_task(renderer.html("discord:bob", "# Bob's note"))
    await asyncio.sleep(0.1)
    renderer.forget("discord:bob")  # while it renders
    release.set()
    assert await rendering == "<h1>Bob's note</h1>\n"
    assert not renderer._kept  # (rendered before the forget-me: not kept after it)
    assert await renderer.html("discord:bob", "# Bob's note") and len(renderer._kept) == 1  # a new one is


async def test_views_from_the_page_keep_a_limit_of_their_own(tmp_path: Path) -> None:
    """File views, diffs and item searches cost the bot's CPU (HTML, a diff, embedding the words) and were
    not limited at all: a script at six views a second slowed every user's replies to seconds."""
    async with running_bot(tmp_path, views_per_minute=5) as bot, bot.client("ann") as ann, \
            bot.client("bob") as bob:
        path = "/api/me/personas/Cora/files/memory"
        status, current = await ann.call("GET", path)
        assert status == 200
        assert (await ann.call("PUT", path, {"content": "# Notes\n", "version": current["version"]}))[0] == 200
        for route in (f"{path}/versions/1", f"{path}/diff?from=1&to=2", "/api/me/items?query=tea",
                      "/api/me/personas/Cora/files"):
            assert (await ann.call("GET", route))[0] == 200, route
        status, error = await ann.call("GET", f"{path}/diff?from=1&to=2")
        assert status == 429 and "too many file views, diffs or searches in a minute (at most 5)" in error["error"]
        assert (await ann.call("GET", "/api/me/items?query=tea"))[0] == 429
        assert (await ann.call("GET", "/api/me/items"))[0] == 200  # a plain listing is no search
        assert (await ann.call("GET", f"{path}/versions"))[0] == 200  # nor is the list of versions
        assert (await bob.call("GET", path))[0] == 200  # the limit is each user's own


def test_a_diff_of_repeated_lines_is_bounded_and_exact() -> None:
    """`side_by_side` without difflib's junk heuristic took 13 s for 1,000 repeated lines and minutes for the
    4,000 a file within the cap holds, on a worker thread no request could stop; with it, 2 s where the new
    version has under 200 lines. Past DIFF_WORK pairs of equal lines, the changed middle is one block. Either way each
    side's lines come back whole and in order, and what both share at the ends is equal."""
    from cortex import diff

    cases = [("\n".join(["a"] * 4000), "\n".join(["a", "b"] * 2000)),
             ("a\n" * 3990, "a\nb\n" * 99 + "a"),
             ("top\n" + "x\n" * 300 + "bottom", "top\n" + "x\ny\n" * 200 + "bottom"),
             ("one\ntwo\nthree", "one\n2\nthree"), ("", "new"), ("old", "")]
    for old, new in cases:
        rows = side_by_side(old, new)
        assert [r["left"] for r in rows if r["left"] is not None] == old.splitlines()
        assert [r["right"] for r in rows if r["right"] is not None] == new.splitlines()
        assert {r["op"] for r in rows} <= {"equal", "replace", "delete", "insert"}
    rows = side_by_side(*cases[2])
    assert rows[0]["op"] == rows[1]["op"] == rows[-1]["op"] == "equal" and {r["op"] for r in rows[2:-1]} == {"replace"}
    assert (300 * 200 > diff.DIFF_WORK) and len(rows) == 402  # (300 × 200 equal pairs: one block, not weighed)
    assert [r["op"] for r in side_by_side(*cases[3])] == ["equal", "replace", "equal"]


async def test_diffs_from_the_page_never_hold_up_a_file_view(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Diffs run on threads of their own: two slow diffs of one user held every other user's file view for
    20 s, as they shared the file views' two threads."""
    release = threading.Event()

    def slow(old: str, new: str) -> list[dict[str, object]]:
        release.wait(30)
        return side_by_side(old, new)

    monkeypatch.setattr(api_me, "side_by_side", slow)
    path = "/api/me/personas/Cora/files/memory"
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann, bot.client("bob") as bob:
        status, current = await ann.call("GET", path)
        assert (await ann.call("PUT", path, {"content": "new", "version": current["version"]}))[0] == 200
        diffs = [asyncio.create_task(ann.call("GET", f"{path}/diff?from=1&to=2")) for _ in range(2)]
        await asyncio.sleep(0.3)  # both on their threads
        status, shown = await bob.call("GET", path)  # held up behind them before
        assert status == 200 and not any(d.done() for d in diffs), shown
        release.set()
        assert [(await d)[0] for d in diffs] == [200, 200]


# -- 8: links, addresses and answers an operator or a person meets first -------------------------------------

async def test_a_process_of_a_fleet_without_the_page_hands_out_links_to_it(tmp_path: Path) -> None:
    """README: the page may run in any one process of a fleet. The others answered !dashboard with "the web page
    is not switched on", so people of their shards or Matrix accounts could not log in; with [web] public_url
    (the page's address) and enabled = false they link to it."""
    async with running_bot(tmp_path, public_url="https://bot.example.org") as bot:
        config = web_config(tmp_path, enabled=False, public_url="https://bot.example.org")
        async with App(config, llm=ScriptedProvider(), embedder=HashEmbedder()) as other:
            reply = await other.commands.dispatch("!dashboard", context("ann"))
            assert "https://bot.example.org/login/" in reply.text and reply.private, reply.text
            token = reply.text.rsplit("/login/", 1)[1]
            assert await bot.app.storage.web.link_valid(token)  # the page's process opens it
        bare = web_config(tmp_path / "bare", enabled=False)
        async with App(bare, llm=ScriptedProvider(), embedder=HashEmbedder()) as alone:
            assert "not switched on" in (await alone.commands.dispatch("!dashboard", context("ann"))).text


async def test_a_login_link_survives_markdown(tmp_path: Path) -> None:
    """Tokens were base64url: Matrix renders a reply as Markdown, and "_" or "__" in a token became emphasis in
    the link people click (about one link in 4,000 opened nothing)."""
    from adapters.matrix import render

    async with running_bot(tmp_path) as bot:
        for _ in range(50):
            url, token = await bot.link("ann")
            assert re.fullmatch(r"[0-9a-f]{64}", token), token
            reply = (await bot.app.commands.dispatch("!dashboard", context("ann"))).text
            assert url in render(reply, "m.text")["formatted_body"] or url not in reply


async def test_a_login_from_another_address_than_the_pages_is_a_page_that_names_it(tmp_path: Path) -> None:
    """A link opened through a tunnel (http://127.0.0.1:PORT where public_url is https://…) showed its Log in
    button, which answered bare JSON in the browser."""
    async with running_bot(tmp_path, public_url="https://bot.example.org") as bot:
        _, token = await bot.link("ann")
        async with aiohttp.ClientSession() as http:
            async with http.post(bot.url + "/login", data={"token": token}, allow_redirects=False,
                                 headers={"Origin": bot.url}) as response:
                body = await response.text()
                assert response.status == 403 and response.content_type == "text/html", body
                assert "https://bot.example.org" in body and "!dashboard" in body
        assert await bot.app.storage.web.link_valid(token)  # not used up: it still works at the right address


async def test_links_naming_every_address_are_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With host 0.0.0.0 and no public_url, links pointed at http://0.0.0.0:PORT (no browser opens it) unsaid."""
    with caplog.at_level(logging.WARNING, logger="adapters.web"):
        async with running_bot(tmp_path, host="0.0.0.0", allowed_hosts=["bot.lan"]) as bot:
            reply = (await bot.app.commands.dispatch("!dashboard", context("ann"))).text
    assert "public_url" in reply and "0.0.0.0" in reply, reply
    assert any("no browser opens" in r.getMessage() for r in caplog.records), caplog.text
    async with running_bot(tmp_path / "named", host="0.0.0.0", public_url="https://bot.example.org") as bot:
        reply = (await bot.app.commands.dispatch("!dashboard", context("ann"))).text
        assert "public_url" not in reply and "https://bot.example.org/login/" in reply


def test_a_metrics_host_without_its_port_is_refused(tmp_path: Path) -> None:
    """metrics_host alone moved /metrics to a random port, another each start (a scraper lost its target)."""
    with pytest.raises(Exception, match="metrics_host needs metrics_port"):
        web_config(tmp_path, metrics_host="127.0.0.1")
    assert web_config(tmp_path, metrics_host="127.0.0.1", metrics=False).web.metrics is False
    assert web_config(tmp_path, metrics_host="127.0.0.1", enabled=False).web.enabled is False  # (nothing served)


async def test_reverting_to_a_version_over_todays_limit_is_refused_not_missing(tmp_path: Path) -> None:
    """The page answered 404 (as for a version that does not exist) for one that exists but is too long."""
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        _, now = await ann.call("GET", f"{FILES}/memory")
        status, long = await ann.call("PUT", f"{FILES}/memory",
                                      {"content": "# Memory\n" + "- Ann likes tea.\n" * 400, "version": now["version"]})
        assert status == 200, long
        bot.app.cortex.files.file_max_chars = 4000
        status, error = await ann.call("POST", f"{FILES}/memory/revert", {"version": long["version"]})
        assert status == 422 and "over today's limit" in error["error"], error
        status, error = await ann.call("POST", f"{FILES}/memory/revert", {"version": 99})
        assert status == 404 and "no version 99" in error["error"], error
