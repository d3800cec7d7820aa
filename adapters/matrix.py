"""The Matrix adapter (matrix-nio): room messages in, streamed replies (``m.replace`` edits) out.

It only translates: a ``RoomMessageText`` becomes a :class:`bot.policy.Inbound` for
:class:`bot.router.Router`, and :class:`MatrixSink` sends Markdown rendered to ``formatted_body``,
edits, shows typing, answers privately in a DM (with a short notice in the room) and keeps threads
and replies together. Everything sent carries empty ``m.mentions`` and never an ``@room`` ping.

State (user id, device id, access token, sync token) lives in ``store_path``: a restart resumes
the sync where it stopped, so old messages are never answered twice, and with end-to-end encryption
the device keeps its keys.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeAlias

import aiohttp
import platformdirs
from markdown_it import MarkdownIt
from nio import (
    AsyncClient,
    AsyncClientConfig,
    InviteMemberEvent,
    LoginResponse,
    MatrixRoom,
    ReactionEvent,
    RoomCreateResponse,
    RoomEncryptedFile,
    RoomMessageFile,
    RoomMessageText,
    RoomSendResponse,
    SyncResponse,
    UploadResponse,
)
from nio.crypto.attachments import decrypt_attachment
from nio.exceptions import EncryptionError

from adapters.matrix_reactions import Reactions
from bot.app import App
from bot.commands import Attachment, CommandReply
from bot.config import MatrixConfig
from bot.policy import Inbound
from bot.ports import IncomingMessage

log = logging.getLogger(__name__)

PLATFORM = "matrix"
LIMIT = 16_000  # Matrix events may be 64 KiB; long replies stay readable in clients below this
MAX_FILE_BYTES = 8 * 1024 * 1024  # a command's file (the card cap)
FileEvent: TypeAlias = RoomMessageFile | RoomEncryptedFile
_markdown = MarkdownIt("commonmark", {"html": False, "breaks": True}).enable("table")


def render(text: str, msgtype: str) -> dict[str, Any]:
    safe = text.replace("@room", "@\u2060room")  # never an @room ping
    return {
        "msgtype": msgtype,
        "body": safe,
        "format": "org.matrix.custom.html",
        "formatted_body": _markdown.render(safe).strip(),
        "m.mentions": {},
    }


_MX_REPLY = re.compile(r"<mx-reply>.*?</mx-reply>", re.DOTALL)


def _names(text: str, name: str) -> bool:
    """Whether ``text`` names ``name`` as a word of its own ("Cora, hi", not "Coral reefs")."""
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) is not None


_FALLBACK = re.compile(r"^> (\* )?<@[^>\s]+:[^>\s]+>")  # "> <@ann:example.org> what was said"


def without_reply_fallback(body: str) -> str:
    """A reply's own text: older clients start its body with the quoted message (``> <@sender:server> …``
    lines, then an empty line), which the spec no longer asks for; a command sent as a reply must still
    start with its ``!``. A quote the user typed (``> something``) is their text and stays."""
    if not _FALLBACK.match(body):
        return body
    lines = body.split("\n")
    quoted = 0
    while quoted < len(lines) and lines[quoted].startswith(">"):
        quoted += 1
    if not quoted or quoted == len(lines):
        return body
    return "\n".join(lines[quoted + (lines[quoted] == ""):])


class MatrixError(RuntimeError):
    pass


def read_secrets(config: MatrixConfig, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The account's password and access token from the environment (either may be empty, not both)."""
    environment = env if env is not None else os.environ
    password = environment.get(config.password_env, "") if config.password_env else ""
    token = environment.get(config.access_token_env, "") if config.access_token_env else ""
    if not (password or token):
        raise MatrixError(
            f"[matrix] needs a password or an access token: set ${config.password_env or config.access_token_env}"
        )
    return password, token


class MatrixSink:
    """Delivery for one incoming message (see :class:`bot.router.ChatSink`)."""

    limit = LIMIT

    def __init__(self, adapter: MatrixAdapter, room: MatrixRoom, event: RoomMessageText) -> None:
        self.adapter = adapter
        self.room = room
        self.event = event
        relates = event.source.get("content", {}).get("m.relates_to", {})
        self.thread_root = relates.get("event_id") if relates.get("rel_type") == "m.thread" else None

    def _relation(self) -> dict[str, Any]:
        if self.thread_root:
            return {"rel_type": "m.thread", "event_id": self.thread_root, "is_falling_back": True,
                    "m.in_reply_to": {"event_id": self.event.event_id}}
        return {"m.in_reply_to": {"event_id": self.event.event_id}}

    @staticmethod
    def message_key(handle: str) -> str:
        """How a reply's message is named (for ``!memory why`` sent as a reply to it)."""
        return f"{PLATFORM}-message:{handle}"

    async def send(self, text: str) -> str:
        content = render(text, self.adapter.config.msgtype) | {"m.relates_to": self._relation()}
        return await self.adapter.send(self.room.room_id, content)

    async def edit(self, handle: str, text: str) -> None:
        new = render(text, self.adapter.config.msgtype)
        content = {
            **new,
            "body": f"* {new['body']}",
            "formatted_body": f"* {new['formatted_body']}",
            "m.new_content": new,
            "m.relates_to": {"rel_type": "m.replace", "event_id": handle},
        }
        await self.adapter.send(self.room.room_id, content)

    @asynccontextmanager
    async def typing(self) -> AsyncIterator[None]:
        client = self.adapter.client
        enabled = self.adapter.app.config.chat.typing_indicator
        if enabled:
            await client.room_typing(self.room.room_id, True, timeout=30_000)
        try:
            yield
        finally:
            if enabled:
                await client.room_typing(self.room.room_id, False)

    async def send_reply(self, reply: CommandReply) -> None:
        await self.adapter.deliver(self.room.room_id, reply, relation=self._relation())

    async def send_private(self, reply: CommandReply) -> None:
        dm = await self.adapter.dm_room(self.event.sender)
        await self.adapter.deliver(dm, reply)
        notice = render("I answered you in a direct message.", self.adapter.config.msgtype)
        await self.adapter.send(self.room.room_id, notice | {"m.relates_to": self._relation()})


class MatrixAdapter:
    name = PLATFORM

    def __init__(self, app: App, config: MatrixConfig, *, env: dict[str, str] | None = None) -> None:
        self.app = app
        self.config = config
        self.password, self.token = read_secrets(config, env)
        self.store = Path(config.store_path or Path(platformdirs.user_data_dir("cortex-bot")) / "matrix")
        self.store.mkdir(parents=True, exist_ok=True)
        self.client = AsyncClient(
            config.homeserver, config.user_id, store_path=str(self.store),
            config=AsyncClientConfig(encryption_enabled=config.e2ee, store_sync_tokens=False),
        )
        self.server_name = config.user_id.split(":", 1)[1]
        self._sent: OrderedDict[str, None] = OrderedDict()  # recent event ids the bot sent
        self.reactions = Reactions(self)
        self._dms: dict[str, str] = {}
        # Rooms the bot joined as a direct chat ("dm": the invite said is_direct, or the bot opened it) or as
        # a group ("group"), kept in the session file: a group room down to two members stays a group.
        self._kinds: dict[str, str] = dict(self._load_state().get("room_kinds", {}))
        self._creators: dict[str, frozenset[str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self.ready = asyncio.Event()

    # -- state -----------------------------------------------------------------------------------

    @property
    def _state_file(self) -> Path:
        return self.store / "session.json"

    def _load_state(self) -> dict[str, Any]:
        try:
            data = json.loads(self._state_file.read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return data if isinstance(data, dict) and data.get("user_id") == self.config.user_id else {}

    def _save_state(self, **changes: Any) -> None:
        state = self._load_state() | {"user_id": self.config.user_id} | changes
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.chmod(tmp, 0o600)  # it holds the access token
        tmp.replace(self._state_file)

    async def wait_for_homeserver(self, first_wait: float = 2.0, longest_wait: float = 300.0) -> None:
        """Until the homeserver answers, say once which URL cannot be reached and why, then keep trying
        with back-off (nio alone would retry silently, or fill the log)."""
        url = self.config.homeserver.rstrip("/") + "/_matrix/client/versions"
        wait = first_wait
        told = False
        while True:
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session, \
                        session.get(url) as response:
                    if response.status < 500:
                        if told:
                            log.info("Matrix: %s answers again; connecting", self.config.homeserver)
                        return
                    problem = f"HTTP {response.status}"
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if not told:
                log.error("Matrix: cannot reach the homeserver at %s (%s); check [matrix] homeserver. Retrying with "
                          "back-off (at most every %.0f s)", self.config.homeserver, problem, longest_wait)
                told = True
            await asyncio.sleep(wait)
            wait = min(wait * 2, longest_wait)

    async def login(self) -> None:
        state = self._load_state()
        if state.get("access_token") and state.get("device_id"):
            self.client.restore_login(self.config.user_id, state["device_id"], state["access_token"])
        elif self.token:
            device_id = state.get("device_id", "")
            if not device_id:  # the token belongs to a device: ask the server which
                self.client.access_token = self.token
                who = await self.client.whoami()
                device_id = getattr(who, "device_id", None) or ""
                if not device_id:
                    raise MatrixError(f"Matrix rejected the access token for {self.config.user_id}: {who}")
                self._save_state(device_id=device_id)
            self.client.restore_login(self.config.user_id, device_id, self.token)
        else:
            response = await self.client.login(self.password, device_name=self.config.device_name)
            if not isinstance(response, LoginResponse):
                raise MatrixError(f"Matrix login for {self.config.user_id} failed: {response}")
            self._save_state(device_id=response.device_id, access_token=response.access_token)
        if self.config.e2ee:
            self.client.load_store()
            if self.client.should_upload_keys:
                await self.client.keys_upload()

    # -- running ---------------------------------------------------------------------------------

    async def run(self) -> None:
        # One process per account: a second one would answer every message twice.
        await self.app.fleet.hold(f"matrix:{self.config.user_id}", f"the Matrix account {self.config.user_id}")
        await self.wait_for_homeserver()
        await self.login()
        since = self._load_state().get("next_batch")
        if not since:
            # First start: take the room state and skip the history, so old messages are not answered.
            first = await self.client.sync(timeout=0, full_state=True)
            if not isinstance(first, SyncResponse):
                raise MatrixError(f"Matrix sync failed: {first}")
            since = first.next_batch
            self._save_state(next_batch=since)
            # Invites are not history: answer the ones that arrived before the bot first ran.
            for invited in list(self.client.invited_rooms.values()):
                await self._consider_invite(invited, getattr(invited, "inviter", None) or "")
        self.client.next_batch = since
        self.client.add_event_callback(self._on_message, RoomMessageText)
        self.client.add_event_callback(self._on_file, (RoomMessageFile, RoomEncryptedFile))
        self.client.add_event_callback(self.reactions.on_reaction, ReactionEvent)
        self.client.add_event_callback(self._on_invite, InviteMemberEvent)
        self.client.add_response_callback(self._on_sync, SyncResponse)
        log.info("Matrix: %s syncing from %s", self.config.user_id, self.config.homeserver)
        self.ready.set()
        try:
            await self.client.sync_forever(timeout=10_000, since=since, full_state=True)
        finally:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()

    async def _on_sync(self, response: SyncResponse) -> None:
        self._save_state(next_batch=response.next_batch)
        if self.config.e2ee and self.client.should_upload_keys:
            await self.client.keys_upload()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- events ----------------------------------------------------------------------------------

    async def _on_invite(self, room: MatrixRoom, event: InviteMemberEvent) -> None:
        if event.state_key != self.config.user_id or event.membership != "invite":
            return
        await self._consider_invite(room, event.sender, bool(event.content.get("is_direct")))

    def is_dm(self, room: MatrixRoom) -> bool:
        """A direct chat: two members, in a room the bot joined as a direct chat. A room joined before the
        bot kept track (no kind recorded) counts as direct by its two members alone, as it did then."""
        return room.member_count <= 2 and self._kinds.get(room.room_id, "dm") == "dm"

    def _remember_kind(self, room_id: str, kind: str) -> None:
        self._kinds[room_id] = kind
        self._save_state(room_kinds=self._kinds)

    async def _consider_invite(self, room: MatrixRoom, inviter: str, direct: bool | None = None) -> None:
        servers = self.config.invite_servers or [self.server_name]
        allowed = self.config.auto_join and inviter.split(":", 1)[-1] in servers
        access = self.app.config.access
        if f"{PLATFORM}:{inviter}" in access.deny_users or (
            access.allow_users and f"{PLATFORM}:{inviter}" not in access.allow_users
        ):
            allowed = False
        if allowed:
            if direct is not None:
                self._remember_kind(room.room_id, "dm" if direct else "group")
            await self.client.join(room.room_id)
            log.info("Matrix: joined %s on invite", room.room_id)
        else:
            await self.client.room_leave(room.room_id)
            log.info("Matrix: declined an invite to %s", room.room_id)

    def inbound(self, room: MatrixRoom, event: RoomMessageText | FileEvent) -> Inbound:
        content = event.source.get("content", {})
        me = self.config.user_id
        mentions = content.get("m.mentions", {}).get("user_ids", [])
        display = room.user_name(me) or me
        reply_to = content.get("m.relates_to", {}).get("m.in_reply_to", {}).get("event_id")
        body = without_reply_fallback(event.body) if reply_to else event.body
        formatted = _MX_REPLY.sub("", getattr(event, "formatted_body", None) or "")  # not the quoted message
        mentions_bot = me in mentions or _names(body, me) or bool(display and _names(body, display)) or me in formatted
        is_dm = self.is_dm(room)
        level = room.power_levels.get_user_level(event.sender)
        if event.sender in self._creators.get(room.room_id, ()):
            level = max(level, 100)  # room version 12: creators outrank everyone and are not listed
        text = body
        for name in (me, display):
            if name and text.startswith(name) and not text[len(name):len(name) + 1].isalnum():  # not "Coral"
                text = text[len(name):].lstrip(":, ")
        incoming = IncomingMessage(
            platform=PLATFORM,
            channel_id=room.room_id,
            author_id=event.sender,
            author_name=room.user_name(event.sender) or event.sender,
            text=text,
            is_dm=is_dm,
            channel_name=room.display_name,
            # A room is Matrix's unit of administration (power levels): its guidelines, settings and skills
            # belong to it, and a room admin is admin of that room only.
            server_id=None if is_dm else room.room_id,
            author_home=event.sender.split(":", 1)[-1],
            mentions_bot=bool(mentions_bot),
            reply_to=f"{PLATFORM}-message:{reply_to}" if reply_to else None,
        )
        return Inbound(
            incoming,
            is_self=event.sender == me,
            replied_to_bot=reply_to in self._sent,
            roles=(f"{PLATFORM}:power:{level}",),
            # In a DM everyone holds power 100 in their own room: that makes nobody an admin of anything.
            is_admin=event.sender in self.config.admin_ids or (not is_dm and level >= self.config.admin_power_level),
            is_bot_admin=event.sender in self.config.admin_ids,
        )

    async def _on_message(self, room: MatrixRoom, event: RoomMessageText) -> None:
        if event.sender == self.config.user_id:
            return
        if event.source.get("content", {}).get("m.relates_to", {}).get("rel_type") == "m.replace":
            return  # an edit of an earlier message
        self._spawn(self._handle(room, event))

    async def _on_file(self, room: MatrixRoom, event: FileEvent) -> None:
        """A file sent with a caption that is a command (``!persona import`` with a card): the caption is
        the command and the file its attachment (MSC2530: a caption is a body that differs from the
        ``filename``). Files without such a caption are not read."""
        content = event.source.get("content", {})
        filename = str(content.get("filename") or "")
        caption = event.body.strip()
        if event.sender == self.config.user_id or not filename or caption == filename:
            return
        if not caption.startswith(self.config.command_prefix):
            return
        self._spawn(self._handle(room, event, file=(filename, content)))

    async def _download(self, event: FileEvent, filename: str, content: dict[str, Any]) -> Attachment:
        """The file's bytes (decrypted in an encrypted room); ValueError with one line when it cannot be."""
        size = int(content.get("info", {}).get("size") or 0)
        if size > MAX_FILE_BYTES:
            raise ValueError(f"{filename} is {size / 1e6:.1f} MB; commands take files of at most "
                             f"{MAX_FILE_BYTES // 1024 // 1024} MB")
        response = await self.client.download(mxc=event.url)
        data = getattr(response, "body", None)
        if not isinstance(data, bytes):
            raise ValueError(f"could not download {filename}: {response}")
        if len(data) > MAX_FILE_BYTES + 1024:
            raise ValueError(f"{filename} is over {MAX_FILE_BYTES // 1024 // 1024} MB")
        if isinstance(event, RoomEncryptedFile):
            data = decrypt_attachment(data, event.key["k"], event.hashes["sha256"], event.iv)
        return Attachment(filename, data)

    async def _handle(self, room: MatrixRoom, event: RoomMessageText | FileEvent,
                      file: tuple[str, dict[str, Any]] | None = None) -> None:
        try:
            await self._load_creators(room.room_id)
            inbound = self.inbound(room, event)
            if file is not None and isinstance(event, RoomMessageFile | RoomEncryptedFile):
                try:
                    inbound = replace(inbound, attachments=(await self._download(event, *file),))
                except (ValueError, EncryptionError) as exc:
                    await MatrixSink(self, room, event).send_reply(CommandReply(str(exc)))
                    return
            prefix = self.config.command_prefix
            if inbound.message.text.strip() in (f"{prefix}leave",) and inbound.is_admin and not inbound.message.is_dm:
                await self.client.room_leave(room.room_id)
                return
            if prefix != self.app.commands.prefix and inbound.message.text.startswith(prefix):
                # The room's prefix is configurable; the command layer speaks "!".
                inbound = _with_text(inbound, self.app.commands.prefix + inbound.message.text[len(prefix):])
            await self.app.router.handle(inbound, MatrixSink(self, room, event))
        except Exception:
            log.exception("Matrix: failed to handle event %s in %s", event.event_id, room.room_id)

    async def _load_creators(self, room_id: str) -> None:
        """The room's creators (sender and additional_creators of m.room.create), fetched once per room."""
        if room_id in self._creators:
            return
        response = await self.client.room_get_state(room_id)
        events = getattr(response, "events", None)
        if not isinstance(events, list):
            return  # try again with the next message
        creators: set[str] = set()
        for event in events:
            if isinstance(event, dict) and event.get("type") == "m.room.create":
                creators.add(str(event.get("sender", "")))
                content = event.get("content", {})
                creators.update(str(c) for c in content.get("additional_creators", []))
                if content.get("creator"):
                    creators.add(str(content["creator"]))
        self._creators[room_id] = frozenset(c for c in creators if c)

    # -- sending ---------------------------------------------------------------------------------

    async def send(self, room_id: str, content: dict[str, Any]) -> str:
        response = await self.client.room_send(
            room_id, "m.room.message", content, ignore_unverified_devices=True
        )
        if not isinstance(response, RoomSendResponse):
            raise MatrixError(f"could not send to {room_id}: {response}")
        self._sent[response.event_id] = None
        while len(self._sent) > 1000:
            self._sent.popitem(last=False)
        return str(response.event_id)

    async def deliver(self, room_id: str, reply: CommandReply, relation: dict[str, Any] | None = None) -> None:
        content = render(reply.text, self.config.msgtype)
        if relation:
            content["m.relates_to"] = relation
        await self.send(room_id, content)
        for attachment in reply.attachments:
            upload, _ = await self.client.upload(
                _bytes_reader(attachment.data), content_type="application/octet-stream",
                filename=attachment.filename, filesize=len(attachment.data),
            )
            if not isinstance(upload, UploadResponse):
                await self.send(room_id, render(f"(could not upload {attachment.filename}: {upload})",
                                                self.config.msgtype))
                continue
            await self.send(room_id, {"msgtype": "m.file", "body": attachment.filename, "url": upload.content_uri,
                                      "info": {"size": len(attachment.data)}, "m.mentions": {}})

    async def dm_room(self, user_id: str) -> str:
        """The bot's direct room with ``user_id`` (created, and the user invited, when there is none)."""
        cached = self.client.rooms.get(self._dms.get(user_id, ""))
        if cached is not None and self.is_dm(cached) and user_id in (set(cached.users) | set(cached.invited_users)):
            return str(cached.room_id)
        for room in self.client.rooms.values():
            members = set(room.users) | set(room.invited_users)
            if self.is_dm(room) and members == {self.config.user_id, user_id}:
                self._dms[user_id] = room.room_id
                return str(room.room_id)
        response = await self.client.room_create(
            is_direct=True, invite=[user_id],
            initial_state=[{"type": "m.room.encryption", "state_key": "",
                            "content": {"algorithm": "m.megolm.v1.aes-sha2"}}] if self.config.e2ee else [],
        )
        if not isinstance(response, RoomCreateResponse):
            raise MatrixError(f"could not open a direct room with {user_id}: {response}")
        self._dms[user_id] = response.room_id
        self._remember_kind(response.room_id, "dm")
        return str(response.room_id)


def _with_text(inbound: Inbound, text: str) -> Inbound:
    return replace(inbound, message=replace(inbound.message, text=text))


def _bytes_reader(data: bytes) -> io.BytesIO:
    return io.BytesIO(data)
