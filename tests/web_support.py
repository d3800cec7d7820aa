"""The real bot with its web server on 127.0.0.1 for tests, and a logged-in HTTP client per user."""

from __future__ import annotations

import re
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from adapters.web import WebServer
from bot.app import App
from bot.commands import CommandContext
from bot.config import parse_config
from bot.ports import AdminDirectory
from cortex.memory.embedders import HashEmbedder
from tests.engines import db_url_for
from tests.fakes.provider import ScriptedProvider

LINK = re.compile(r"(https?://\S+/login/(\S+))")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def web_config(tmp_path: Path, **web: Any) -> Any:
    return parse_config({
        "storage": {"url": db_url_for(tmp_path)},
        "llm": {"provider": "anthropic", "api_key_env": "CB_WEB_TEST_KEY"},
        "discord": {"admin_ids": [999]},
        "personas": [{"name": "Cora"}, {"name": "Vex", "language": "German"}],
        "web": {"enabled": True, "host": "127.0.0.1", "port": free_port(), **web},
    })


def context(user: str, *, platform: str = "discord", persona: str = "Cora", admin: bool = False) -> CommandContext:
    return CommandContext(platform, f"{platform}:{user}", user.title(), f"{platform}:dm-{user}", persona,
                          is_dm=True, is_admin=admin)


@dataclass
class Bot:
    app: App
    server: WebServer

    @property
    def url(self) -> str:
        return self.server.url

    async def link(self, user: str, *, platform: str = "discord") -> tuple[str, str]:
        """(the login URL, its token) that ``!dashboard`` gives ``user``."""
        reply = await self.app.commands.dispatch("!dashboard", context(user, platform=platform))
        assert reply.private, reply
        found = LINK.search(reply.text)
        assert found is not None, reply.text
        return found.group(1), found.group(2)

    @asynccontextmanager
    async def client(self, user: str, *, platform: str = "discord") -> AsyncIterator[Client]:
        """A logged-in session of ``user`` (through a !dashboard link, as a person would)."""
        _, token = await self.link(user, platform=platform)
        async with aiohttp.ClientSession(base_url=self.url, cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            async with http.post("/login", data={"token": token}, allow_redirects=False) as response:
                assert response.status == 303, await response.text()
            async with http.get("/api/me") as response:
                assert response.status == 200, await response.text()
                me = await response.json()
            yield Client(http, me["csrf"], me)


@dataclass
class Client:
    http: aiohttp.ClientSession
    csrf: str
    me: dict[str, Any]

    async def call(self, method: str, path: str, body: Any = None, *, csrf: bool = True) -> tuple[int, Any]:
        headers = {"X-CSRF-Token": self.csrf} if csrf else {}
        async with self.http.request(method, path, json=body, headers=headers) as response:
            data = await response.json() if response.content_type == "application/json" else await response.read()
            return response.status, data


@asynccontextmanager
async def running_bot(tmp_path: Path, *, directories: Sequence[AdminDirectory] = (), **web: Any
                      ) -> AsyncIterator[Bot]:
    async with App(web_config(tmp_path, **web), llm=ScriptedProvider(), embedder=HashEmbedder()) as app:
        server = WebServer(app, directories=directories, adapters={"discord": lambda: True})
        await server.start()
        try:
            yield Bot(app, server)
        finally:
            await server.stop()
