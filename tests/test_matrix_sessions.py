"""The Matrix adapter when its session or the road to the homeserver fails, on a real Synapse: a reverse
proxy answering 502 (the sync waits with back-off, says so once, and recovers), and the bot's session
signed out from elsewhere (logged in again with the password, or a clear stop and a fresh login at the
next start)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from adapters.matrix import MatrixError
from tests.synapse import SynapseServer
from tests.test_matrix import Timeline, dm_with, send_text, start_bot, stop_bot, user

pytestmark = pytest.mark.slow


class Proxy:
    """A reverse proxy in front of Synapse that can be told to answer 502 (a gateway whose upstream is down)."""

    def __init__(self, synapse: SynapseServer) -> None:
        self.synapse, self.failing, self.syncs = synapse, False, 0
        self.url = ""

    async def forward(self, request: web.Request) -> web.StreamResponse:
        if "/sync" in request.path:
            self.syncs += 1
        if self.failing:
            return web.Response(status=502, text="<html>502 Bad Gateway</html>", content_type="text/html")
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        async with self.session.request(request.method, self.synapse.url + request.rel_url.path_qs, headers=headers,
                                        data=await request.read()) as upstream:
            return web.Response(status=upstream.status, body=await upstream.read(),
                                content_type=upstream.content_type or "application/json")

    async def __aenter__(self) -> Proxy:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()
        await self.session.close()


@pytest.fixture
async def proxy(synapse: SynapseServer) -> AsyncIterator[Proxy]:
    async with Proxy(synapse) as running:
        yield running


class Behind:
    """The Synapse fixture as the bot sees it: through the proxy."""

    def __init__(self, synapse: SynapseServer, proxy: Proxy) -> None:
        self._synapse, self.url = synapse, proxy.url

    def __getattr__(self, name: str) -> Any:
        return getattr(self._synapse, name)


async def test_failing_syncs_back_off_are_reported_once_and_recover(
        synapse: SynapseServer, proxy: Proxy, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """nio syncs again at once after an error: 3,462 requests in 3 s while a proxy answered 502."""
    caplog.set_level(logging.INFO, logger="adapters.matrix")
    bot = await start_bot(Behind(synapse, proxy), tmp_path)  # type: ignore[arg-type]
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, bot.user_id)
        proxy.failing, proxy.syncs = True, 0
        await asyncio.sleep(4)
        assert 1 <= proxy.syncs <= 5  # 1, 2, 4 s apart (the first may already be on its way)
        failed = [r.getMessage() for r in caplog.records if "sync with" in r.getMessage()]
        assert len(failed) == 1 and "502" in failed[0] and "back-off" in failed[0]
        proxy.failing = False
        await send_text(alice, room, "back again?")
        await seen.sync_until(lambda: any("echo: back again?" in b for b in seen.bodies(room, bot.user_id)),
                              "an answer once the proxy works again", deadline=30)
        assert any("syncing again after" in r.getMessage() for r in caplog.records)
        assert not bot.task.done()
    finally:
        await alice.close()
        await stop_bot(bot)


async def test_a_signed_out_session_logs_in_again_with_the_password(synapse: SynapseServer, tmp_path: Path) -> None:
    bot = await start_bot(synapse, tmp_path)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        room = await dm_with(seen, bot.user_id)
        old = bot.adapter.client.access_token
        synapse.request("POST", "/_matrix/client/v3/logout", {}, token=old)  # "sign out" in a client
        await send_text(alice, room, "still there?")
        await seen.sync_until(lambda: any("echo: still there?" in b for b in seen.bodies(room, bot.user_id)),
                              "an answer from the new session")
        assert bot.adapter.client.access_token != old and not bot.task.done()
        saved = json.loads((tmp_path / "matrix" / "session.json").read_text())
        assert saved["access_token"] == bot.adapter.client.access_token
    finally:
        await alice.close()
        await stop_bot(bot)


async def test_a_session_signed_out_while_stopped_is_replaced_at_the_next_start(
        synapse: SynapseServer, tmp_path: Path) -> None:
    first = await start_bot(synapse, tmp_path)
    token, user_id = first.adapter.client.access_token, first.user_id
    await stop_bot(first)
    synapse.request("POST", "/_matrix/client/v3/logout", {}, token=token)
    again = await start_bot(synapse, tmp_path, user_id=user_id)
    alice = await user(synapse, "alice")
    seen = Timeline(alice)
    try:
        assert again.adapter.client.access_token != token
        room = await dm_with(seen, again.user_id)
        await send_text(alice, room, "hello")
        await seen.sync_until(lambda: any("echo: hello" in b for b in seen.bodies(room, again.user_id)), "an answer")
    finally:
        await alice.close()
        await stop_bot(again)


async def test_with_encryption_a_signed_out_session_stops_with_one_clear_line(
        synapse: SynapseServer, tmp_path: Path) -> None:
    """The device's keys belong to the old session: the adapter stops and says how to go on."""
    bot = await start_bot(synapse, tmp_path, e2ee=True)
    try:
        synapse.request("POST", "/_matrix/client/v3/logout", {}, token=bot.adapter.client.access_token)
        with pytest.raises(MatrixError, match="was signed out .*restart the bot"):
            await asyncio.wait_for(bot.task, 60)
        assert not json.loads((tmp_path / "matrix" / "session.json").read_text()).get("access_token")
    finally:
        await stop_bot(bot)


@pytest.mark.parametrize("kind", ["password_env", "access_token_env"])
async def test_a_secret_ending_in_a_line_break_signs_in_and_one_with_a_break_inside_is_named(
        synapse: SynapseServer, tmp_path: Path, kind: str) -> None:
    """A secret from the environment ending in a line break (a Kubernetes secret made with `echo`): with a password,
    doctor said ✓ and run stopped with "M_FORBIDDEN Invalid username or password"; with a token, doctor ended in a
    traceback ("Forbidden control character detected in headers"). A break inside one is no secret anyone means."""
    from adapters.credentials import matrix_login
    from adapters.matrix import MatrixAdapter
    from bot.app import App
    from bot.config import parse_config
    from tests.fakes.provider import ScriptedProvider
    from tests.test_matrix import DEADLINE, PASSWORD, _unique

    bot_id = synapse.register(_unique("cortex"), PASSWORD)
    token, _ = synapse.login_token(bot_id.split(":")[0][1:], PASSWORD)
    secret = token if kind == "access_token_env" else PASSWORD
    config = parse_config({"storage": {"url": f"sqlite:///{tmp_path / 'bot.db'}"},
                           "matrix": {"enabled": True, "homeserver": synapse.url, "user_id": bot_id,
                                      kind: "MX_SECRET", "store_path": str(tmp_path / "mx")}})
    inside = {"MX_SECRET": secret[:5] + "\n" + secret[5:]}
    said = "environment variable MX_SECRET holds a line break or another control character inside its secret"
    assert (await matrix_login(config.matrix, inside))[0] is False
    assert said in (await matrix_login(config.matrix, inside))[1]
    ended = {"MX_SECRET": secret + "\n"}
    ok, _detail = await matrix_login(config.matrix, ended)
    assert ok, _detail
    app = App(config, llm=ScriptedProvider())
    await app.start()
    try:
        with pytest.raises(MatrixError, match=said):
            MatrixAdapter(app, config.matrix, env=inside)
        adapter = MatrixAdapter(app, config.matrix, env=ended)
        task = asyncio.create_task(adapter.run())
        waiter = asyncio.create_task(adapter.ready.wait())
        try:
            done, _ = await asyncio.wait({task, waiter}, timeout=DEADLINE, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()  # (the adapter's start-up error)
            assert waiter in done, "the bot did not get ready"
        finally:
            await adapter.close()
            task.cancel()
            waiter.cancel()
            await asyncio.gather(task, waiter, return_exceptions=True)
    finally:
        await app.stop()
