"""The web page's login and authorisation, served by the real bot on 127.0.0.1: a !dashboard link works
once and expires, the session cookie's flags, 401 without a session, CSRF and origin checks on every
change, logout, and JSON 4xx errors for bad input."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest

from tests.web_support import context, running_bot

pytestmark = pytest.mark.both_engines


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CB_WEB_TEST_KEY", "test-key")


async def test_with_any_free_port_the_links_name_the_port_chosen(tmp_path: Path) -> None:
    """``port = 0`` ("any free port") made links to http://127.0.0.1:0/login/…, which lead nowhere."""
    async with running_bot(tmp_path, port=0) as bot:
        assert not bot.url.endswith(":0") and bot.app.config.web.base_url == bot.url
        url, token = await bot.link("ann")
        assert url.startswith(bot.url + "/login/")
        async with aiohttp.ClientSession() as http, http.get(url) as page:
            assert page.status == 200


async def test_a_login_link_works_once_and_sets_a_strict_http_only_cookie(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot:
        url, token = await bot.link("ann")
        assert url.startswith(bot.url + "/login/")
        async with aiohttp.ClientSession() as http:
            # Opening the link (as a chat's link preview does) shows a button and does not use it up.
            for _ in range(2):
                async with http.get(url) as page:
                    assert page.status == 200
                    assert 'action="/login"' in await page.text()
                    assert page.headers["Referrer-Policy"] == "same-origin"
            async with http.post(bot.url + "/login", data={"token": token}, allow_redirects=False) as response:
                assert response.status == 303 and response.headers["Location"] == "/"
                cookie = response.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
        assert "Secure" not in cookie  # plain http on loopback: a Secure cookie would never come back
        async with aiohttp.ClientSession() as http:
            async with http.post(bot.url + "/login", data={"token": token}, allow_redirects=False) as again:
                assert again.status == 410
            async with http.get(url) as page:
                assert page.status == 410 and "!dashboard" in await page.text()


async def test_an_expired_or_unknown_link_opens_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_bot(tmp_path, link_minutes=1) as bot:
        _, token = await bot.link("ann")
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 61)
        async with aiohttp.ClientSession() as http:
            for sent in (token, "made-up", "x" * 5000, ""):
                async with http.post(bot.url + "/login", data={"token": sent}, allow_redirects=False) as response:
                    assert response.status == 410, sent[:20]
                    assert "Set-Cookie" not in response.headers


@pytest.mark.parametrize("public_url", ["https://bot.example.org/", "https://bot.example.org:443"])
async def test_https_public_url_makes_the_cookie_secure(tmp_path: Path, public_url: str) -> None:
    """(With ":443" written out, the browser's Origin, which has no default port, was refused.)"""
    async with running_bot(tmp_path, public_url=public_url) as bot:
        url, token = await bot.link("ann")
        assert url.startswith("https://bot.example.org/login/")
        async with aiohttp.ClientSession() as http:
            async with http.post(bot.url + "/login", data={"token": token}, allow_redirects=False,
                                 headers={"Origin": "https://bot.example.org"}) as response:
                cookie = response.headers["Set-Cookie"]
            url, token = await bot.link("ann")
            # a page on plain http at the same host (a proxy that also serves http, a network that forges it)
            # is not the https page, though the proxy hands the bot plain http with that Host
            async with http.post(bot.url + "/login", data={"token": token}, allow_redirects=False,
                                 headers={"Origin": "http://bot.example.org", "Host": "bot.example.org"}) as response:
                assert response.status == 403
                assert "Set-Cookie" not in response.headers
        assert cookie.startswith("__Host-cortexbot=") and "Secure" in cookie


async def test_without_a_session_the_api_answers_401_in_json(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, aiohttp.ClientSession(base_url=bot.url) as http:
        for method, path in (("GET", "/api/me"), ("GET", "/api/me/personas/Cora/files/memory"),
                             ("PUT", "/api/me/personas/Cora/files/memory"), ("POST", "/api/logout"),
                             # (a persona the bot has not, asked without a session: nothing learned about it)
                             ("GET", "/api/me/items?persona=Secret"), ("GET", "/api/me/items?persona=Cora")):
            async with http.request(method, path, cookies={"cortexbot_session": "forged"}) as response:
                assert response.status == 401, path
                assert "dashboard" in (await response.json())["error"]


async def test_changes_need_the_csrf_token_and_the_pages_origin(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        path = "/api/me/personas/Cora/files/memory"
        status, current = await ann.call("GET", path)
        assert status == 200
        body = {"content": "# Memory\nAnn likes tea.", "version": current["version"]}
        status, error = await ann.call("PUT", path, body, csrf=False)
        assert status == 403 and "X-CSRF-Token" in error["error"]
        async with ann.http.put(path, json=body, headers={"X-CSRF-Token": ann.csrf,
                                                          "Origin": "https://evil.example"}) as response:
            assert response.status == 403
        status, _ = await ann.call("GET", path)
        assert status == 200 and (await ann.call("GET", path))[1]["version"] == current["version"]
        status, saved = await ann.call("PUT", path, body)
        assert status == 200 and saved["version"] == current["version"] + 1


async def test_a_request_naming_another_user_than_the_sessions_is_refused(tmp_path: Path) -> None:
    """After someone else logged in in another tab of the browser, an open page went on reading with the one session
    cookie: Ann's page showed Bob's memory items and export. The page names its user in X-Cortex-User (percent-encoded);
    a request naming another user is a 409 with a code, reads and changes alike, and one without the header (an API
    client, curl) is whoever the session is."""
    async with running_bot(tmp_path) as bot, bot.client("bob") as bob:
        remembered = await bot.app.commands.dispatch("!memory remember Bob owes money to Carl", context("bob"))
        assert "Remembered" in remembered.text, remembered.text
        for named in ("discord:ann", "discord%3Aann", ""):  # (Ann's page, and one that names nobody)
            for method, path in (("GET", "/api/me/items?persona=Cora"), ("GET", "/api/me/export"), ("GET", "/api/me")):
                async with bob.http.request(method, path, headers={"X-Cortex-User": named}) as response:
                    body = await response.json()
                    assert response.status == 409 and body["code"] == "other_user", (named, path, body)
                    assert "owes money" not in str(body)
        path = "/api/me/personas/Cora/files/memory.md"
        _, current = await bob.call("GET", path)
        edit = {"content": "# Notes\n- typed in Ann's page\n", "version": current["version"]}
        async with bob.http.put(path, json=edit, headers={"X-CSRF-Token": bob.csrf, "X-Cortex-User": "discord:ann"}
                                ) as response:
            assert response.status == 409 and (await response.json())["code"] == "other_user"
        assert (await bob.call("GET", path))[1]["version"] == current["version"]  # nothing was saved
        for named in ("discord:bob", "discord%3Abob"):  # his own page, as the page sends it or not encoded
            async with bob.http.get("/api/me/items?persona=Cora", headers={"X-Cortex-User": named}) as response:
                assert response.status == 200 and "owes money" in await response.text()
        status, items = await bob.call("GET", "/api/me/items?persona=Cora")  # without the header: as before
        assert status == 200 and "owes money" in str(items)
        status, _ = await bob.call("PUT", path, edit)
        assert status == 200


async def test_logout_ends_the_session_on_the_server(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        cookie = next(iter(ann.http.cookie_jar))
        status, _ = await ann.call("POST", "/api/logout")
        assert status == 200
        async with aiohttp.ClientSession(base_url=bot.url) as other:  # the old cookie, replayed
            async with other.get("/api/me", cookies={cookie.key: cookie.value}) as response:
                assert response.status == 401


async def test_logging_out_everywhere_ends_every_session_and_unused_link_of_that_user_only(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann, bot.client("ann") as phone, \
            bot.client("bob") as bob:
        _, unused = await bot.link("ann")
        status, body = await ann.call("POST", "/api/logout?everywhere=1")
        assert status == 200 and body["sessions_ended"] == 2
        assert (await phone.call("GET", "/api/me"))[0] == 401  # her other browser too
        assert (await bob.call("GET", "/api/me"))[0] == 200  # nobody else
        async with aiohttp.ClientSession(base_url=bot.url) as http:  # a link she had not used
            async with http.post("/login", data={"token": unused}, allow_redirects=False) as response:
                assert response.status == 410
        # from chat (a link that leaked: the page may be out of reach), with the page's answer in words
        async with bot.client("bob") as laptop:
            reply = await bot.app.commands.dispatch("!dashboard --logout", context("bob"))
            assert reply.private and "2 sessions ended" in reply.text
            assert (await laptop.call("GET", "/api/me"))[0] == 401
            assert (await bob.call("GET", "/api/me"))[0] == 401
        assert "0 sessions ended" in (await bot.app.commands.dispatch("!dashboard --logout", context("ann"))).text
        refused = await bot.app.commands.dispatch("!dashboard --everything", context("ann"))
        assert refused.failed and "--logout" in refused.text


async def test_logging_in_again_ends_the_browsers_older_session(tmp_path: Path) -> None:
    """A browser that logged in through a new link kept its older session valid on the server until it expired
    (a cookie copied from it meanwhile went on working)."""
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        old = next(iter(ann.http.cookie_jar))
        _, token = await bot.link("ann")
        async with ann.http.post("/login", data={"token": token}, allow_redirects=False) as response:
            assert response.status == 303
        async with aiohttp.ClientSession(base_url=bot.url) as other:  # the older cookie, replayed
            async with other.get("/api/me", cookies={old.key: old.value}) as replayed:
                assert replayed.status == 401
        async with ann.http.get("/api/me") as fresh:  # the new session works
            assert fresh.status == 200


async def test_logout_works_after_the_change_limit_is_used_up(tmp_path: Path) -> None:
    """Logging out counted as a change: a user over the per-minute limit got a 429 and stayed logged in."""
    async with running_bot(tmp_path) as bot, bot.client("ann") as ann:
        bot.server.context.auth.limiter.per_minute = 2
        for _ in range(2):
            assert (await ann.call("POST", "/api/me/personas/Cora/files/memory.md/reset"))[0] == 200
        assert (await ann.call("POST", "/api/me/personas/Cora/files/memory.md/reset"))[0] == 429
        status, body = await ann.call("POST", "/api/logout")
        assert status == 200, body
        assert (await ann.call("GET", "/api/me"))[0] == 401


async def test_bad_input_is_a_json_4xx_never_a_500(tmp_path: Path) -> None:
    async with running_bot(tmp_path, max_body_kb=16) as bot, bot.client("ann") as ann:
        path = "/api/me/personas/Cora/files/memory"
        headers = {"X-CSRF-Token": ann.csrf, "Content-Type": "application/json"}
        for raw, expected in ((b"{not json", 400), (b"[1, 2]", 400), (b'{"content": 5, "version": 1}', 422),
                              (b'{"content": "x", "version": "1"}', 422), (b'{"content": "x"}', 422),
                              (b'{"content": "x", "version": 1, "extra": 1}', 422),
                              (b'{"content": "x", "version": 99999999999}', 422),
                              (b'{"content": "' + b"a" * 20_000 + b'", "version": 1}', 413)):
            async with ann.http.put(path, data=raw, headers=headers) as response:
                assert response.status == expected, (raw[:40], await response.text())
                assert "error" in await response.json()
        for method, bad in (("GET", "/api/me/personas/Cora/files/passwords"), ("GET", "/api/me/personas/Nobody/files"),
                            ("GET", "/api/me/personas/Cora/files/memory/versions/999"),
                            ("GET", "/api/nothing-here")):
            status, error = await ann.call(method, bad)
            assert status == 404 and "error" in error, bad
        status, error = await ann.call("GET", "/api/me/personas/Cora/files/memory/versions/abc")
        assert status == 400
        status, error = await ann.call("GET", "/api/me/personas/Cora/files/memory/diff?from=1&to=x")
        assert status == 400


async def test_a_login_form_posted_from_another_site_or_an_opaque_origin_is_refused(tmp_path: Path) -> None:
    async with running_bot(tmp_path) as bot:
        _, token = await bot.link("mallory")
        async with aiohttp.ClientSession() as http:
            for origin in ("https://evil.example", "null"):
                async with http.post(bot.url + "/login", data={"token": token}, allow_redirects=False,
                                     headers={"Origin": origin}) as response:
                    assert response.status == 403, origin
                    assert "Set-Cookie" not in response.headers
            async with http.post(bot.url + "/login", data={"token": token}, allow_redirects=False,
                                 headers={"Origin": bot.url}) as response:
                assert response.status == 303  # refused attempts did not use the link up


async def test_logging_out_of_a_page_that_is_off_says_so(tmp_path: Path) -> None:
    from bot.app import App
    from bot.config import parse_config
    from tests.fakes.provider import ScriptedProvider

    async with App(parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"}}),
                   llm=ScriptedProvider()) as app:
        assert "not switched on" in (await app.commands.dispatch("!dashboard", context("ann"))).text
        reply = await app.commands.dispatch("!dashboard --logout", context("ann"))
        assert reply.text.startswith("The web page is not switched on for this bot, and no session of yours was "
                                     "left from before"), reply.text


def test_matrix_admin_ids_written_as_the_access_lists_write_them_are_bot_admins() -> None:
    """``matrix:@boss:example.org`` (the access lists' form) passed the config and made nobody a bot admin on the
    page (nor in chat): it is read as the id it names."""
    from adapters.web.auth import is_bot_admin
    from bot.config import parse_config

    config = parse_config({"matrix": {"admin_ids": ["matrix:@boss:example.org"]},
                           "discord": {"admin_ids": ["discord:1234"]}})
    assert is_bot_admin(config, "matrix:@boss:example.org") and is_bot_admin(config, "discord:1234")
    assert not is_bot_admin(config, "matrix:@eve:example.org")
