"""The web page under attack and careless use, on the real bot: bodies and addresses a database cannot
store (NUL, unpaired surrogates) or a parser chokes on (deep nesting), unreadable login forms, two saves
racing on one version, a login link raced by concurrent posts, the __Host- cookie's deletion, a huge diff
that must not stall the event loop, non-canonical Discord ids, and Markdown that must not become script."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest

from adapters.admin_directory import DiscordAdminDirectory
from adapters.web.errors import GONE
from adapters.web.render import markdown_html
from adapters.web.userdata import SESSION_ENDED
from bot.config import DiscordConfig
from tests.test_web_admin import FakeGuild, member
from tests.web_support import context, running_bot

FILE = "/api/me/personas/Cora/files/memory"


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CB_WEB_TEST_KEY", "test-key")


@pytest.mark.both_engines
async def test_deeply_nested_json_is_a_400_not_a_500(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        headers = {"X-CSRF-Token": ann.csrf, "Content-Type": "application/json"}
        for raw in (b"[" * 5000 + b"]" * 5000, b'{"content": ' + b"[" * 5000 + b"]" * 5000 + b', "version": 1}'):
            async with ann.http.put(FILE, data=raw, headers=headers) as response:
                assert response.status == 400, await response.text()
                assert "nested" in (await response.json())["error"]


@pytest.mark.both_engines
async def test_nul_and_unpaired_surrogates_in_a_body_are_a_422_on_every_engine(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann, bot.client("999") as admin:
        _, current = await ann.call("GET", FILE)
        headers = {"X-CSRF-Token": ann.csrf, "Content-Type": "application/json"}
        for text in ("# Memory\\nAnn \\u0000 tea", "# Memory\\nAnn \\ud800 tea", "# Memory\\nAnn \\udfff"):
            raw = f'{{"content": "{text}", "version": {current["version"]}}}'.encode()
            async with ann.http.put(FILE, data=raw, headers=headers) as response:
                assert response.status == 422, (text, await response.text())
                assert "NUL" in (await response.json())["error"]
        assert (await ann.call("GET", FILE))[1]["version"] == current["version"]
        for method, path, body in (
                ("PUT", "/api/admin/settings", {"persona": "Cora", "server": "discord:\ud800", "key": "context_limit",
                                                "value": "40"}),
                ("POST", "/api/admin/rules", {"name": "kind", "text": "Be\x00 kind."}),
                ("PUT", "/api/admin/servers/discord%3A1/guidelines", {"text": "No \x00 here"}),
                ("PUT", "/api/admin/personas/Cora/sections/identity", {"text": "You are \ud83d Cora."})):
            status, error = await admin.call(method, path, body)
            assert status == 422, (path, error)
        status, rules = await admin.call("GET", "/api/admin/rules")
        assert status == 200 and rules["rules"] == []


@pytest.mark.both_engines
async def test_nul_in_the_address_is_a_400_on_every_engine(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann, bot.client("999") as admin:
        for path in ("/api/me/items?archived=true&query=a%00b", "/api/me/items?query=%00",
                     "/api/me/personas/Co%00ra/files"):
            status, error = await ann.call("GET", path)
            assert status == 400 and "NUL" in error["error"], (path, error)
        for path in ("/api/admin/servers/discord:%00/guidelines", "/api/admin/settings?server=discord:%00"):
            status, error = await admin.call("GET", path)
            assert status == 400 and "NUL" in error["error"], (path, error)
        status, error = await admin.call("PUT", "/api/admin/servers/discord:%00/guidelines", {"text": "x"})
        assert status == 400


@pytest.mark.both_engines
async def test_an_unreadable_login_form_is_a_400_and_leaves_the_link_usable(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot:
        _, token = await bot.link("ann")
        async with aiohttp.ClientSession() as http:
            for raw, kind in ((b"token=" + token.encode() + b"\xff", "application/x-www-form-urlencoded"),
                              (b"token=" + token.encode(), "application/x-www-form-urlencoded; charset=bogus"),
                              (b"--x\r\n", "multipart/form-data; boundary=x"),
                              (b"garbage", "multipart/form-data")):
                async with http.post(bot.url + "/login", data=raw, headers={"Content-Type": kind},
                                     allow_redirects=False) as response:
                    assert response.status == 400, (raw[:20], kind, await response.text())
                    assert "Set-Cookie" not in response.headers
            async with http.post(bot.url + "/login", data={"token": token}, allow_redirects=False) as response:
                assert response.status == 303


@pytest.mark.both_engines
async def test_two_saves_based_on_the_same_version_save_once(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        _, current = await ann.call("GET", FILE)
        answers = await asyncio.gather(*(
            ann.call("PUT", FILE, {"content": f"# Memory\nAnn's edit number {i}.", "version": current["version"]})
            for i in range(4)))
        assert sorted(status for status, _ in answers) == [200, 409, 409, 409], answers
        saved = next(body for status, body in answers if status == 200)
        _, now = await ann.call("GET", FILE)
        assert now["version"] == current["version"] + 1 and now["content"] == saved["content"]


@pytest.mark.both_engines
async def test_concurrent_posts_of_one_link_open_one_session(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot:
        _, token = await bot.link("ann")

        async def log_in() -> int:
            async with aiohttp.ClientSession() as http:
                async with http.post(bot.url + "/login", data={"token": token}, allow_redirects=False) as response:
                    return response.status

        statuses = await asyncio.gather(*(log_in() for _ in range(8)))
        assert sorted(statuses) == [303] + [410] * 7
        rows = await bot.app.storage.db.fetch_all("SELECT id_hash FROM web_sessions WHERE user_key = ?",
                                                  ("discord:ann",))
        assert len(rows) == 1


async def test_links_and_sessions_from_before_forget_me_open_nothing(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann, bot.client("ann") as second:
        _, spare = await bot.link("ann")
        status, _ = await ann.call("POST", "/api/me/forget-me", {"confirm": "forget me"})
        assert status == 200
        status, _ = await second.call("GET", "/api/me")
        assert status == 401
        async with aiohttp.ClientSession() as http:
            async with http.post(bot.url + "/login", data={"token": spare}, allow_redirects=False) as response:
                assert response.status == 410
        assert await bot.app.storage.get_user("discord:ann") is None


@pytest.mark.both_engines
@pytest.mark.parametrize("window", ["before the user row is read", "after it is read"])
async def test_a_request_racing_forget_me_brings_nothing_back(tmp_path: Path, window: str) -> None:
    """The request passed its login check; then a forget-me (from the chat, or another tab) finishes
    before the request makes the user's row, or after it read the row and before it makes the pair."""
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        storage, store = bot.app.storage, bot.app.cortex.store
        target, name = (storage, "get_user") if window.startswith("before") else (store, "count_messages")
        real = getattr(target, name)
        raced: list[object] = []

        async def forgotten_first(*args: object) -> object:
            if not raced:  # once (the forget-me itself reads the user too)
                raced.append(None)
                raced[0] = await bot.app.cortex.commands.forget_user("discord:ann")
            return await real(*args)

        setattr(target, name, forgotten_first)
        status, body = await ann.call("GET", FILE)
        assert raced and raced[0] is not None  # the forget-me did delete the user's data meanwhile
        assert (status, body) == (401, {"error": SESSION_ENDED})
        assert await storage.get_user("discord:ann") is None
        for table in ("users", "cortex_pairs", "cortex_versions"):
            assert (await storage.db.fetch_one(f"SELECT count(*) FROM {table}"))[0] == 0, table


@pytest.mark.both_engines
@pytest.mark.parametrize("route", ["edit", "reset"])
async def test_a_forget_me_landing_after_the_pair_was_read_is_a_409_and_writes_nothing(
        tmp_path: Path, route: str) -> None:
    """An edit's check finds the file gone (a conflict); a reset, which checks nothing, meets the foreign
    key of the deleted pair (the error middleware's 409): either way nothing comes back."""
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        _, current = await ann.call("GET", FILE)
        files = bot.app.cortex.files
        real = getattr(files, route)

        async def forgotten_first(*args: Any, **kwargs: Any) -> Any:
            await bot.app.cortex.commands.forget_user("discord:ann")
            return await real(*args, **kwargs)

        setattr(files, route, forgotten_first)
        if route == "edit":
            status, body = await ann.call("PUT", FILE, {"content": "# Memory\nAnn likes tea.",
                                                        "version": current["version"]})
            assert status == 409 and "reload" in body["error"], (status, body)
        else:
            status, body = await ann.call("POST", FILE + "/reset")
            assert (status, body) == (409, {"error": GONE})
        for table in ("users", "cortex_pairs", "cortex_versions"):
            assert (await bot.app.storage.db.fetch_one(f"SELECT count(*) FROM {table}"))[0] == 0, table


@pytest.mark.both_engines
async def test_a_row_made_by_the_chat_meanwhile_keeps_its_name(tmp_path: Path) -> None:
    """The page finds no row, then a chat message makes it (with the name the chat shows now) before the
    page does: the page takes that row as it is."""
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        storage = bot.app.storage
        await bot.app.cortex.commands.forget_user("discord:ann")  # no row (the session is gone with it)
        async with bot.client("ann") as again:
            real = storage.get_user

            async def chat_first(key: str) -> object:
                await storage.upsert_user(key, "Ann Renamed")
                return None

            storage.get_user = chat_first  # type: ignore[method-assign]
            try:
                status, _ = await again.call("GET", FILE)
            finally:
                storage.get_user = real  # type: ignore[method-assign]
            assert status == 200
            user = await storage.get_user("discord:ann")
            assert user is not None and user.display_name == "Ann Renamed"
        assert (await ann.call("GET", FILE))[0] == 401  # the first session ended with the forget-me


@pytest.mark.both_engines
async def test_forget_me_before_the_user_has_a_row_still_ends_links_and_sessions(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, aiohttp.ClientSession(
            base_url=bot.url, cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        _, token = await bot.link("bob")  # !dashboard alone stores no user row
        _, spare = await bot.link("bob")
        async with http.post("/login", data={"token": token}, allow_redirects=False) as response:
            assert response.status == 303  # a session, still no row
        assert await bot.app.storage.get_user("discord:bob") is None
        reply = await bot.app.commands.dispatch("!memory forget-me confirm", context("bob"))
        assert "stores nothing about you" in reply.text and "logins" in reply.text
        async with http.get(FILE) as response:
            assert response.status == 401  # the session ended: the page makes no row for it
        async with http.post("/login", data={"token": spare}, allow_redirects=False) as response:
            assert response.status == 410
        assert await bot.app.storage.get_user("discord:bob") is None


async def test_a_login_racing_forget_me_keeps_no_session(tmp_path: Path) -> None:
    """The forget-me comes right after the login used its link, before the session is made: the
    session must not outlive it (SQLite: the login's transaction makes the forget-me wait)."""
    async with running_bot(tmp_path) as bot:
        _, token = await bot.link("ann")
        connection = bot.app.storage.db.connection  # type: ignore[attr-defined]
        real = connection.execute_fetchall
        forgetting: list[asyncio.Task[object]] = []

        async def racing(sql: str, params: Any = ()) -> Any:
            rows = await real(sql, params)
            if sql.startswith("UPDATE web_links SET used_at") and not forgetting:
                forgetting.append(asyncio.ensure_future(bot.app.cortex.commands.forget_user("discord:ann")))
                await asyncio.sleep(0.05)  # the forget-me runs now, as far as it can
            return rows

        connection.execute_fetchall = racing
        async with aiohttp.ClientSession(base_url=bot.url) as http:
            async with http.post("/login", data={"token": token}, allow_redirects=False) as response:
                assert response.status == 303
                session = response.cookies["cortexbot_session"].value
            await asyncio.gather(*forgetting)
            async with http.get(FILE, cookies={"cortexbot_session": session}) as response:
                assert response.status == 401
        assert forgetting
        assert (await bot.app.storage.db.fetch_one("SELECT count(*) FROM web_sessions"))[0] == 0
        assert await bot.app.storage.get_user("discord:ann") is None


async def test_the_host_cookie_is_deleted_with_secure_so_browsers_accept_it(tmp_path: Path) -> None:
    async with running_bot(tmp_path, public_url="https://bot.example.org") as bot:
        for path, body in (("/api/logout", None), ("/api/me/forget-me", {"confirm": "forget me"})):
            _, token = await bot.link("ann")
            async with aiohttp.ClientSession(base_url=bot.url) as http:
                async with http.post("/login", data={"token": token}, allow_redirects=False) as response:
                    session = response.cookies["__Host-cortexbot"].value
                cookies = {"__Host-cortexbot": session}
                async with http.get("/api/me", cookies=cookies) as response:
                    csrf = (await response.json())["csrf"]
                async with http.post(path, json=body, cookies=cookies, headers={"X-CSRF-Token": csrf}) as response:
                    assert response.status == 200, await response.text()
                    deletion = response.headers["Set-Cookie"]
            assert deletion.startswith('__Host-cortexbot=""') and "Max-Age=0" in deletion, deletion
            assert "Secure" in deletion and "Path=/" in deletion and "Domain" not in deletion, deletion


async def test_a_huge_diff_does_not_stall_the_bot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A diff runs on a worker thread: the loop answers others meanwhile (a diff held until the check is done)."""
    import threading

    from adapters.web import api_me
    from adapters.web.render import side_by_side

    release = threading.Event()

    def held(old: str, new: str) -> list[dict[str, object]]:
        release.wait(30)
        return side_by_side(old, new)

    monkeypatch.setattr(api_me, "side_by_side", held)
    async with running_bot(tmp_path, max_body_kb=64) as bot, bot.client("ann") as ann:
        _, pair = await bot.app.cortex.store.pair_for("discord:ann", "Ann", "Cora")
        rng = random.Random(7)
        for _ in range(2):  # the worst case of a line diff: thousands of short lines, few distinct
            text = "\n".join(rng.choice("ab") for _ in range(3500))
            await bot.app.cortex.store.add_version(pair.id, "memory.md", text, "user", "test")
        _, versions = await ann.call("GET", FILE + "/versions")
        newest, older = versions["versions"][0]["version"], versions["versions"][1]["version"]
        diff = asyncio.create_task(ann.call("GET", f"{FILE}/diff?from={older}&to={newest}"))
        await asyncio.sleep(0.05)  # the diff has started
        async with aiohttp.ClientSession() as http, http.get(bot.url + "/healthz") as response:
            assert response.status == 200 and not diff.done()  # the loop answered while the diff ran
        release.set()
        status, body = await diff
        assert status == 200 and len(body["rows"]) >= 3500


def books_directory() -> DiscordAdminDirectory:
    """Discord with one guild, discord:1, where discord:10 holds Manage Server."""
    guild = FakeGuild(1, "Books", [member(10, manage=True)], [])
    client = SimpleNamespace(guilds=[guild], get_guild=lambda gid: guild if gid == 1 else None)
    return DiscordAdminDirectory(client, DiscordConfig())


async def test_discord_ids_are_only_canonical_numbers() -> None:
    directory = books_directory()
    assert await directory.is_admin("discord:10", "discord:1")
    for user, server in (("discord:10", "discord:01"), ("discord:10", "discord:0001"), ("discord:010", "discord:1"),
                         ("discord:10", "discord:+1"), ("discord:10", "discord:\u0661")):
        assert not await directory.is_admin(user, server), (user, server)


async def test_a_server_admin_cannot_write_a_non_canonical_key_of_their_server(tmp_path: Path) -> None:
    async with running_bot(tmp_path, directories=[books_directory()]) as bot, bot.client("10") as mod:
        status, _ = await mod.call("PUT", f"/api/admin/servers/{quote('discord:1', safe='')}/guidelines",
                                   {"text": "Be kind to books."})
        assert status == 200
        for key in ("discord:01", "discord:001"):
            status, _ = await mod.call("PUT", f"/api/admin/servers/{quote(key, safe='')}/guidelines",
                                       {"text": "Stored where the bot never reads"})
            assert status == 400, key  # no key the bot reads, for anyone (tests/test_web_hardening.py)


def test_markdown_never_becomes_markup_or_script() -> None:
    for text in ("<script>alert(1)</script>", '<img src=x onerror="alert(1)">', "[x](javascript:alert(1))",
                 "[x](JaVaScRiPt:alert(1))", "<javascript:alert(1)>", "[x](vbscript:msgbox)",
                 "[x](data:text/html;base64,PHNjcmlwdD4=)", "![x](https://evil.example/pixel.png)",
                 '<a href="javascript:alert(1)">x</a>', "[a]: javascript:alert(1)\n\n[a]"):
        rendered = markdown_html(text)
        assert "<script" not in rendered and "<img" not in rendered, rendered
        assert 'href="javascript' not in rendered.lower() and 'href="vbscript' not in rendered.lower(), rendered
        assert 'href="data:' not in rendered.lower(), rendered


@pytest.mark.both_engines
async def test_saves_based_on_one_version_from_two_processes_land_once(tmp_path: Path) -> None:
    """The check is in the insert itself, so it holds across processes (two handles on one database)."""
    from bot.storage import open_storage
    from cortex.store import CortexStore
    from tests.engines import db_url_for

    url = db_url_for(tmp_path)
    first, second = await open_storage(url), await open_storage(url)
    try:
        await first.migrate()
        user = await first.upsert_user("discord:ann", "Ann")
        stores = [CortexStore(first), CortexStore(second)]
        pair = await stores[0].ensure_pair(user.id, "Cora")
        await stores[0].add_version(pair.id, "memory.md", "v1", "system")
        saved = await asyncio.gather(*(
            store.add_version_based_on(1, pair.id, "memory.md", f"edit {n}", "user")
            for n, store in enumerate(stores * 3)))
        landed = [s for s in saved if s is not None]
        assert len(landed) == 1 and landed[0].version == 2
        assert [v.version for v in await stores[1].versions(pair.id, "memory.md")] == [1, 2]
    finally:
        await first.close()
        await second.close()
