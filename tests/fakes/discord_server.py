"""A fake Discord on 127.0.0.1: the REST API and the gateway websocket, for the unmodified discord.py.

A real aiohttp server (REST under ``/api/v10``, the gateway at ``/gateway``) running in a background
thread with its own event loop, like :mod:`tests.fakes.llm_server`, so an in-process client and a bot
started as a subprocess both talk to it over loopback::

    with FakeDiscord(shard_count=2) as fake:
        # in-process: discord.http.Route.BASE = fake.api_base and
        #             discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(fake.gateway_url)
        # subprocess: env CORTEXBOT_DISCORD_API_BASE=fake.api_base (see adapters/discord.py)
        fake.wait_until(lambda f: len(f.identifies) == 2)
        sent = fake.dispatch_message("hello")          # a DM: goes to the session of shard 0
        fake.wait_until(lambda f: f.messages_in(sent.channel_id))

What it records (thread-safe copies): every IDENTIFY with its ``shard`` (:attr:`identifies`) and how each session
ended (:attr:`disconnects`, with the close code), every slash-command sync (``PUT /applications/{app}/commands`` and
the guild variant, :attr:`command_syncs`), every message the bot posts or edits (:attr:`messages`, :attr:`edits`;
:meth:`fail_edits` makes the next edits fail, :meth:`refuse_posts` a channel refuse new messages) and every REST
request (:attr:`requests`). Each is tagged with the bot token that made it, which is how a test tells the processes
of a fleet apart (give each its own token value).

Routing follows Discord: a DM goes to shard 0, a guild's events to shard ``(guild_id >> 22) % count``
(:func:`shard_for`), each to the live session whose ``[shard_id, shard_count]`` owns it. Guilds added
with :meth:`FakeDiscord.add_guild` appear in READY (as unavailable) and arrive by GUILD_CREATE on the
owning shard. ``GET /gateway/bot`` answers ``shards = shard_count`` (what :class:`discord.AutoShardedClient`
asks when it is given no shard count).

Wire details verified with discord.py 2.7 (see ECOSYSTEM §10): JSON answers carry exactly
``Content-Type: application/json``; READY names ``resume_gateway_url`` (this server; resumes are answered
with "invalid session"); frames are plain text although the client asks for ``zlib-stream``.

Run it standalone with ``python -m tests.fakes.discord_server --port 8800 [--shards 2]``: it prints the
environment for ``cortexbot run``, sends each line typed on stdin as a DM, and prints what the bot posts.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from aiohttp import WSMsgType, web
from aiohttp.typedefs import Handler

API_PREFIX = "/api/v10"
DISCORD_EPOCH_MS = 1_420_070_400_000
JSON = {"Content-Type": "application/json"}  # exactly this: with a charset discord.py returns a str
SESSION_START_LIMIT = {"total": 1000, "remaining": 1000, "reset_after": 0, "max_concurrency": 1}


def shard_for(guild_id: int | None, shard_count: int) -> int:
    """The shard Discord sends an event to: DMs to shard 0, guild events by the guild id."""
    return 0 if guild_id is None else (guild_id >> 22) % shard_count


@dataclass(frozen=True)
class Identify:
    """One IDENTIFY (op 2) a client sent."""

    token: str
    shard: tuple[int, int] | None  # [shard_id, shard_count]; None when the client is unsharded
    intents: int
    session_id: str

    @property
    def shard_id(self) -> int:
        return self.shard[0] if self.shard else 0


@dataclass(frozen=True)
class Disconnect:
    """A gateway session that ended, with the websocket close code (1000: the client closed cleanly)."""

    identify: Identify
    close_code: int | None


@dataclass(frozen=True)
class CommandSync:
    """One bulk overwrite of the application commands (global, or for one guild)."""

    token: str
    application_id: str
    guild_id: str | None
    names: tuple[str, ...]


@dataclass(frozen=True)
class PostedMessage:
    """A message the bot sent (POST) or edited (PATCH)."""

    token: str
    channel_id: str
    message_id: str
    content: str | None
    body: dict[str, Any]
    files: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestRequest:
    method: str
    path: str  # without the /api/v10 prefix
    token: str


@dataclass(frozen=True)
class Dispatched:
    """What :meth:`FakeDiscord.dispatch_message` sent, and to which session."""

    message_id: str
    channel_id: str
    guild_id: str | None
    shard_id: int
    token: str  # of the session that received it
    session_id: str


MANAGE_GUILD = 1 << 5


@dataclass
class _Guild:
    id: int
    name: str
    channel_ids: tuple[int, ...]
    moderators: tuple[int, ...] = ()  # members with the role "Moderators" (Manage Server)
    members: tuple[int, ...] = ()  # members without a role

    @property
    def moderator_role(self) -> int:
        return self.id + 2


@dataclass
class _Session:
    ws: web.WebSocketResponse
    identify: Identify
    seq: int = 0
    closed: bool = False

    @property
    def shard(self) -> tuple[int, int]:
        return self.identify.shard or (0, 1)

    def owns(self, guild_id: int | None) -> bool:
        shard_id, count = self.shard
        return shard_for(guild_id, count) == shard_id

    async def dispatch(self, event: str, data: dict[str, Any]) -> None:
        self.seq += 1
        await self.ws.send_str(json.dumps({"op": 0, "t": event, "s": self.seq, "d": data}))


@dataclass
class _Records:
    identifies: list[Identify] = field(default_factory=list)
    disconnects: list[Disconnect] = field(default_factory=list)
    command_syncs: list[CommandSync] = field(default_factory=list)
    messages: list[PostedMessage] = field(default_factory=list)
    edits: list[PostedMessage] = field(default_factory=list)
    requests: list[RestRequest] = field(default_factory=list)


class FakeDiscord:
    """The fake. Use as a context manager, or call :meth:`start` / :meth:`stop`."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        shard_count: int = 1,
        application_id: int = 900_000_000_000_000_001,
        bot_id: int = 900_000_000_000_000_002,
        bot_name: str = "cortex",
        heartbeat_interval_ms: int = 41_250,
    ) -> None:
        self.host = host
        self.port = port
        self.shard_count = shard_count
        self.rejected_tokens: set[str] = set()  # GET /users/@me answers 401 to these (a reset token)
        self.application_id = application_id
        self.bot_user = _user(bot_id, bot_name, bot=True)
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self._ids = itertools.count(1)
        self._guilds: dict[int, _Guild] = {}
        self._sessions: list[_Session] = []  # only touched on the server's loop
        self._records = _Records()
        self._failing_edits: list[int] = []  # HTTP statuses the next message edits are answered with
        self._refused_posts: dict[str, tuple[int, dict[str, Any]]] = {}  # channel id -> (status, error body)
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # ----- lifecycle

    def start(self) -> FakeDiscord:
        if self._thread is not None:
            return self
        started = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start_site())
            except BaseException as exc:  # reported to the starting thread
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="FakeDiscord", daemon=True)
        self._thread.start()
        started.wait(10)
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def stop(self) -> None:
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(15)
        self._thread = self._loop = self._runner = None

    def __enter__(self) -> FakeDiscord:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def _start_site(self) -> None:
        app = web.Application()
        app.router.add_get("/gateway", self._gateway)
        api = web.RouteTableDef()
        api.get("/gateway")(self._get_gateway)
        api.get("/gateway/bot")(self._get_gateway_bot)
        api.get("/users/@me")(self._get_me)
        api.get("/oauth2/applications/@me")(self._get_application)
        api.get("/users/{user_id}")(self._get_user)
        api.post("/users/@me/channels")(self._open_dm)
        api.post("/channels/{channel_id}/messages")(self._post_message)
        api.patch("/channels/{channel_id}/messages/{message_id}")(self._edit_message)
        api.post("/channels/{channel_id}/typing")(self._typing)
        api.get("/guilds/{guild_id}")(self._get_guild)
        api.get("/guilds/{guild_id}/members/{user_id}")(self._get_member)
        api.put("/applications/{app_id}/commands")(self._sync_commands)
        api.put("/applications/{app_id}/guilds/{guild_id}/commands")(self._sync_commands)
        api.post("/interactions/{interaction_id}/{token}/callback")(self._interaction_callback)
        api.patch("/webhooks/{app_id}/{token}/messages/@original")(self._edit_original)
        api.post("/webhooks/{app_id}/{token}")(self._followup)
        api.route("*", "/{tail:.*}")(self._unknown_route)
        sub = web.Application(middlewares=[self._record_request])
        sub.add_routes(api)
        app.add_subapp(API_PREFIX, sub)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        self.port = server.sockets[0].getsockname()[1]
        self._runner = runner

    # ----- public API

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_base(self) -> str:
        """What discord.py's ``Route.BASE`` (or ``$CORTEXBOT_DISCORD_API_BASE``) should be."""
        return self.url + API_PREFIX

    @property
    def gateway_url(self) -> str:
        return f"ws://{self.host}:{self.port}/gateway"

    @property
    def identifies(self) -> list[Identify]:
        with self._cond:
            return list(self._records.identifies)

    @property
    def disconnects(self) -> list[Disconnect]:
        with self._cond:
            return list(self._records.disconnects)

    @property
    def command_syncs(self) -> list[CommandSync]:
        with self._cond:
            return list(self._records.command_syncs)

    @property
    def messages(self) -> list[PostedMessage]:
        with self._cond:
            return list(self._records.messages)

    @property
    def edits(self) -> list[PostedMessage]:
        with self._cond:
            return list(self._records.edits)

    @property
    def requests(self) -> list[RestRequest]:
        with self._cond:
            return list(self._records.requests)

    def messages_in(self, channel_id: str) -> list[PostedMessage]:
        return [m for m in self.messages if m.channel_id == channel_id]

    def add_guild(self, guild_id: int, *, name: str = "Test server", channel_ids: tuple[int, ...] = (),
                  moderators: tuple[int, ...] = (), members: tuple[int, ...] = ()) -> None:
        """A guild the bot is in (call before the bot connects); its channels are text channels. ``moderators``
        hold a role with Manage Server, ``members`` none; REST answers both (``GET /guilds/{id}/members/{id}``)."""
        self._guilds[guild_id] = _Guild(guild_id, name, channel_ids or (guild_id + 1,), moderators, members)

    def fail_edits(self, *statuses: int) -> None:
        """Answer the next message edits (``PATCH``) with these HTTP statuses, one each, unrecorded; then edits
        work again. 404 is Discord's answer for a message deleted meanwhile, 403 for a channel closed to the bot."""
        with self._cond:
            self._failing_edits.extend(statuses)

    def refuse_posts(self, channel_id: int, status: int = 403, code: int = 50013,
                     message: str = "Missing Permissions") -> None:
        """Answer every new message (``POST``) in ``channel_id`` with this error, unrecorded (403/50013: a channel
        the bot may read but not write in; 403/50007: a user whose DMs are closed)."""
        with self._cond:
            self._refused_posts[str(channel_id)] = (status, {"message": message, "code": code})

    def wait_until(self, predicate: Callable[[FakeDiscord], object], timeout: float = 10.0) -> None:
        """Block until ``predicate(self)`` is true (re-checked whenever something is recorded)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"condition not met within {timeout} s")
                self._cond.wait(min(remaining, 0.1))

    async def wait_until_async(self, predicate: Callable[[FakeDiscord], object], timeout: float = 10.0) -> None:
        await asyncio.to_thread(self.wait_until, predicate, timeout)

    def dispatch_message(
        self,
        content: str,
        *,
        author_id: int = 700_000_000_000_000_001,
        author_name: str = "ann",
        channel_id: int | None = None,
        guild_id: int | None = None,
        mentions_bot: bool = False,
    ) -> Dispatched:
        """Send a MESSAGE_CREATE to the session of the shard that owns it (no ``guild_id``: a DM).

        Thread-safe; raises ``LookupError`` when no connected session owns that shard.
        """
        assert self._loop is not None, "the fake is not running"
        coro = self._dispatch_message(content, author_id, author_name, channel_id, guild_id, mentions_bot)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def dispatch_event(self, event: str, data: dict[str, Any], *, guild_id: int | None = None) -> None:
        """Send any gateway event (``MESSAGE_DELETE``, ``CHANNEL_DELETE``, ...) to the session owning ``guild_id``."""
        assert self._loop is not None, "the fake is not running"
        session = self._owner_of(guild_id)
        asyncio.run_coroutine_threadsafe(session.dispatch(event, data), self._loop).result(10)

    # ----- helpers

    def _snowflake(self) -> int:
        return ((int(time.time() * 1000) - DISCORD_EPOCH_MS) << 22) | (next(self._ids) & 0x3FFFFF)

    def _record(self, kind: str, item: Any) -> None:
        with self._cond:
            getattr(self._records, kind).append(item)
            self._cond.notify_all()

    def _message(self, channel_id: str, content: str | None, author: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {
            "id": str(self._snowflake()), "channel_id": channel_id, "content": content or "", "type": 0,
            "author": author, "timestamp": _now(), "edited_timestamp": None, "tts": False,
            "mention_everyone": False, "mentions": [], "mention_roles": [], "attachments": [], "embeds": [],
            "pinned": False, "flags": 0, "components": [], **extra,
        }

    def _owner_of(self, guild_id: int | None) -> _Session:
        for session in reversed(self._sessions):
            if not session.closed and session.owns(guild_id):
                return session
        shard = shard_for(guild_id, self.shard_count)
        raise LookupError(f"no connected session owns shard {shard} (guild {guild_id})")

    async def _dispatch_message(
        self, content: str, author_id: int, author_name: str, channel_id: int | None, guild_id: int | None,
        mentions_bot: bool,
    ) -> Dispatched:
        session = self._owner_of(guild_id)
        channel = channel_id or (self._guilds[guild_id].channel_ids[0] if guild_id else author_id + 1)
        extra: dict[str, Any] = {"mentions": [self.bot_user] if mentions_bot else []}
        if guild_id is not None:
            extra |= {"guild_id": str(guild_id), "member": _member(None)}
        data = self._message(str(channel), content, _user(author_id, author_name), **extra)
        await session.dispatch("MESSAGE_CREATE", data)
        return Dispatched(data["id"], str(channel), extra.get("guild_id"), session.shard[0],
                          session.identify.token, session.identify.session_id)

    # ----- gateway

    async def _gateway(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(json.dumps({"op": 10, "d": {"heartbeat_interval": self.heartbeat_interval_ms}}))
        session: _Session | None = None
        try:
            async for frame in ws:
                if frame.type != WSMsgType.TEXT:
                    continue
                payload = json.loads(frame.data)
                if payload.get("op") == 1:  # heartbeat
                    await ws.send_str(json.dumps({"op": 11}))
                elif payload.get("op") == 2:
                    session = await self._identify(ws, payload["d"])
                elif payload.get("op") == 6:  # resume: not supported, the client identifies afresh
                    await ws.send_str(json.dumps({"op": 9, "d": False}))
        finally:
            if session is not None:
                session.closed = True
                self._sessions.remove(session)
                self._record("disconnects", Disconnect(session.identify, ws.close_code))
        return ws

    async def _identify(self, ws: web.WebSocketResponse, data: dict[str, Any]) -> _Session:
        shard = (int(data["shard"][0]), int(data["shard"][1])) if data.get("shard") else None
        identify = Identify(str(data["token"]), shard, int(data.get("intents", 0)), f"session-{next(self._ids)}")
        session = _Session(ws, identify)
        self._sessions.append(session)
        self._record("identifies", identify)
        owned = [g for g in self._guilds.values() if session.owns(g.id)]
        ready: dict[str, Any] = {
            "v": 10, "user": self.bot_user, "session_id": identify.session_id,
            "resume_gateway_url": self.gateway_url, "application": {"id": str(self.application_id), "flags": 0},
            "guilds": [{"id": str(g.id), "unavailable": True} for g in owned],
        }
        if shard is not None:
            ready["shard"] = list(shard)
        await session.dispatch("READY", ready)
        for guild in owned:
            await session.dispatch("GUILD_CREATE", self._guild_payload(guild))
        return session

    def _guild_payload(self, guild: _Guild) -> dict[str, Any]:
        everyone = {"id": str(guild.id), "name": "@everyone", "permissions": "104324673", "position": 0,
                    "color": 0, "hoist": False, "managed": False, "mentionable": False, "flags": 0}
        moderators = everyone | {"id": str(guild.moderator_role), "name": "Moderators", "position": 1,
                                 "permissions": str(104324673 | MANAGE_GUILD)}
        channels = [{"id": str(c), "type": 0, "name": f"channel-{i}", "position": i, "guild_id": str(guild.id),
                     "permission_overwrites": []} for i, c in enumerate(guild.channel_ids)]
        return {
            "id": str(guild.id), "name": guild.name, "owner_id": "1", "unavailable": False, "member_count": 2,
            "roles": [everyone, moderators], "channels": channels, "members": [_member(self.bot_user)], "threads": [],
            "stage_instances": [], "emojis": [], "stickers": [], "features": [], "voice_states": [],
            "presences": [], "large": False, "joined_at": _now(),
        }

    # ----- REST

    @web.middleware
    async def _record_request(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        token = request.headers.get("Authorization", "").removeprefix("Bot ")
        self._record("requests", RestRequest(request.method, request.path.removeprefix(API_PREFIX), token))
        return await handler(request)

    async def _get_gateway(self, request: web.Request) -> web.Response:
        return _json({"url": self.gateway_url})

    async def _get_gateway_bot(self, request: web.Request) -> web.Response:
        return _json({"url": self.gateway_url, "shards": self.shard_count, "session_start_limit": SESSION_START_LIMIT})

    async def _get_me(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization", "").removeprefix("Bot ") in self.rejected_tokens:
            return _json({"message": "401: Unauthorized", "code": 0}, 401)
        return _json(self.bot_user)

    async def _get_application(self, request: web.Request) -> web.Response:
        return _json({
            "id": str(self.application_id), "name": self.bot_user["username"], "description": "", "icon": None,
            "bot_public": True, "bot_require_code_grant": False, "owner": _user(1, "owner"),
            "verify_key": "0" * 64, "flags": 0,
        })

    async def _get_guild(self, request: web.Request) -> web.Response:
        guild = self._guilds.get(int(request.match_info["guild_id"]))
        if guild is None:
            return _json({"message": "Unknown Guild", "code": 10004}, 404)
        payload = self._guild_payload(guild)
        for gateway_only in ("channels", "members", "threads", "voice_states", "presences", "joined_at"):
            payload.pop(gateway_only)
        return _json(payload)

    async def _get_member(self, request: web.Request) -> web.Response:
        guild = self._guilds.get(int(request.match_info["guild_id"]))
        user_id = int(request.match_info["user_id"])
        if guild is None:
            return _json({"message": "Unknown Guild", "code": 10004}, 404)
        if user_id not in guild.moderators + guild.members:
            return _json({"message": "Unknown Member", "code": 10007}, 404)
        roles = [str(guild.moderator_role)] if user_id in guild.moderators else []
        return _json(_member(_user(user_id, f"user{user_id}")) | {"roles": roles})

    async def _get_user(self, request: web.Request) -> web.Response:
        return _json(_user(int(request.match_info["user_id"]), "user"))

    async def _open_dm(self, request: web.Request) -> web.Response:
        recipient = int((await request.json())["recipient_id"])
        return _json({"id": str(recipient + 1), "type": 1, "recipients": [_user(recipient, "user")]})

    async def _post_message(self, request: web.Request) -> web.Response:
        body, files = await _body(request)
        channel_id = request.match_info["channel_id"]
        with self._cond:
            refused = self._refused_posts.get(channel_id)
        if refused is not None:
            return _json(refused[1], refused[0])
        data = self._message(channel_id, body.get("content"), self.bot_user, nonce=body.get("nonce"))
        self._record("messages", _posted(request, channel_id, data["id"], body, files))
        return _json(data)

    async def _edit_message(self, request: web.Request) -> web.Response:
        body, files = await _body(request)
        channel_id, message_id = request.match_info["channel_id"], request.match_info["message_id"]
        with self._cond:
            failure = self._failing_edits.pop(0) if self._failing_edits else None
        if failure is not None:
            return _json({"message": f"edit refused by the test ({failure})", "code": 0}, failure)
        self._record("edits", _posted(request, channel_id, message_id, body, files))
        data = self._message(channel_id, body.get("content"), self.bot_user, id=message_id, edited_timestamp=_now())
        return _json(data)

    async def _typing(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def _sync_commands(self, request: web.Request) -> web.Response:
        commands = await request.json()
        app_id, guild_id = request.match_info["app_id"], request.match_info.get("guild_id")
        token = request.headers.get("Authorization", "").removeprefix("Bot ")
        self._record("command_syncs", CommandSync(token, app_id, guild_id, tuple(c["name"] for c in commands)))
        scope = {"guild_id": guild_id} if guild_id else {}
        # Discord answers every command with a description ("" for context-menu commands, which send none).
        return _json([{"description": "", **c, "id": str(self._snowflake()), "application_id": app_id,
                       "version": "1", **scope} for c in commands])

    async def _interaction_callback(self, request: web.Request) -> web.Response:
        body, files = await _body(request)
        message = self._message("0", (body.get("data") or {}).get("content"), self.bot_user)
        self._record("messages", _posted(request, "interaction", message["id"], body, files))
        flags = (body.get("data") or {}).get("flags") or 0
        interaction = {"id": request.match_info["interaction_id"], "type": 2,
                       "response_message_id": message["id"], "response_message_ephemeral": bool(flags & 64)}
        return _json({"interaction": interaction, "resource": {"type": body.get("type", 4), "message": message}})

    async def _edit_original(self, request: web.Request) -> web.Response:
        body, files = await _body(request)
        self._record("edits", _posted(request, "interaction", "@original", body, files))
        return _json(self._message("0", body.get("content"), self.bot_user))

    async def _followup(self, request: web.Request) -> web.Response:
        body, files = await _body(request)
        data = self._message("0", body.get("content"), self.bot_user)
        self._record("messages", _posted(request, "followup", data["id"], body, files))
        return _json(data)

    async def _unknown_route(self, request: web.Request) -> web.Response:
        return _json({"message": f"the fake Discord has no {request.method} {request.path}", "code": 0}, 404)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(data).encode(), status=status, headers=JSON)


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _user(user_id: int, name: str, *, bot: bool = False) -> dict[str, Any]:
    return {"id": str(user_id), "username": name, "discriminator": "0", "global_name": None, "avatar": None,
            "bot": bot}


def _member(user: dict[str, Any] | None) -> dict[str, Any]:
    member: dict[str, Any] = {"roles": [], "joined_at": _now(), "deaf": False, "mute": False, "flags": 0}
    return member | ({"user": user} if user else {})


async def _body(request: web.Request) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A JSON body, or a multipart one (``payload_json`` plus files): the JSON and the file names."""
    if not request.content_type.startswith("multipart/"):
        return (await request.json() if request.can_read_body else {}), ()
    form = await request.post()
    files = tuple(str(v.filename) for k, v in form.items() if k != "payload_json" and isinstance(v, web.FileField))
    return json.loads(str(form.get("payload_json") or "{}")), files


def _posted(
    request: web.Request, channel_id: str, message_id: str, body: dict[str, Any], files: tuple[str, ...]
) -> PostedMessage:
    token = request.headers.get("Authorization", "").removeprefix("Bot ")
    content = body.get("content") if "content" in body else (body.get("data") or {}).get("content")
    return PostedMessage(token, channel_id, message_id, content, body, files)


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted; each stdin line is sent as a DM, and what the bot posts is printed."""
    parser = argparse.ArgumentParser(description="Fake Discord (REST + gateway) for discord.py on loopback.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="what GET /gateway/bot recommends")
    args = parser.parse_args(argv)
    with FakeDiscord(args.host, args.port, shard_count=args.shards) as fake:
        print(f"Fake Discord on {fake.url}. Start the bot with:\n"
              f"  CORTEXBOT_DISCORD_API_BASE={fake.api_base} CORTEXBOT_DISCORD_GATEWAY={fake.gateway_url} "
              "DISCORD_TOKEN=anything cortexbot run\nType a line to send it as a DM; Ctrl-C stops.", flush=True)
        shown = 0
        try:
            for line in sys.stdin:
                try:
                    fake.dispatch_message(line.rstrip("\n"))
                except LookupError as exc:
                    print(f"not sent: {exc}", flush=True)
                    continue
                time.sleep(3)  # streaming replies post a first piece, then edit it
                for message in fake.messages[shown:]:
                    edits = [e.content for e in fake.edits if e.message_id == message.message_id]
                    print(f"bot: {edits[-1] if edits else message.content}", flush=True)
                shown = len(fake.messages)
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
