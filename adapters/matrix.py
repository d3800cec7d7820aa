"""The Matrix adapter (matrix-nio): room messages in, streamed replies (``m.replace`` edits) out.

It only translates: a ``RoomMessageText`` becomes a :class:`bot.policy.Inbound` for
:class:`bot.router.Router`, and :class:`MatrixSink` sends Markdown rendered to ``formatted_body``,
edits, shows typing, answers privately in a DM (with a short notice in the room) and keeps threads
and replies together. Everything sent carries empty ``m.mentions``, never an ``@room`` ping and
no link to a user (clients show one as a mention).

State (user id, device id, access token, sync token) lives in ``store_path``: a restart resumes
the sync where it stopped, so old messages are never answered twice, and with end-to-end encryption
the device keeps its keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ParamSpec, TypeAlias, TypeVar
from urllib.parse import quote, unquote, urlparse

import aiohttp
import platformdirs
from markdown_it import MarkdownIt
from nio import (
    AsyncClient,
    AsyncClientConfig,
    Event,
    InviteMemberEvent,
    JoinResponse,
    LoginResponse,
    MatrixRoom,
    MegolmEvent,
    ReactionEvent,
    RedactionEvent,
    Response,
    RoomCreateResponse,
    RoomEncryptedFile,
    RoomEncryptedImage,
    RoomEncryptedMedia,
    RoomInviteResponse,
    RoomMemberEvent,
    RoomMessageEmote,
    RoomMessageFile,
    RoomMessageImage,
    RoomMessageMedia,
    RoomMessageText,
    RoomMessageUnknown,
    RoomSendResponse,
    StickerEvent,
    SyncError,
    SyncResponse,
    UploadResponse,
    WhoamiError,
)
from nio.api import MATRIX_MEDIA_API_PATH
from nio.crypto.attachments import decrypt_attachment
from nio.exceptions import EncryptionError

from adapters.matrix_backlog import Backlogs
from adapters.matrix_content import (
    MEDIA_EVENTS,
    TEXTLESS,
    author_of,
    home_server,
    json_object,
    keep,
    mentioned,
    message_key,
    relates_to,
    reply_target,
    server_seconds,
    without_reply_fallback,
)
from adapters.matrix_gaps import missed_redactions
from adapters.matrix_joins import HIDDEN_BEFORE_JOIN, JoinTimes
from adapters.matrix_levels import replaced_whole
from adapters.matrix_order import InOrder, Slot
from adapters.matrix_reactions import Reactions
from adapters.matrix_upgrades import verified_predecessor
from adapters.reachable import wait_until_answers
from bot.app import App
from bot.commands import Attachment, CommandReply, PlatformCommand
from bot.commands.files import MAX_ATTACHMENT_BYTES
from bot.config import MATRIX_SESSION_FILE, ConfigError, MatrixConfig, read_secret, shown_variable
from bot.policy import Inbound, refusal
from bot.ports import IncomingMessage
from bot.privatefs import create_private, own_folder, private_file
from bot.ratelimit import RateLimiter
from bot.splitting import split_message
from bot.text import shown, unescaped

log = logging.getLogger(__name__)

PLATFORM = "matrix"
POWER = f"{PLATFORM}:power"  # the rank the access lists' matrix:power:N holds from N up (bot.policy)
# Synapse refuses an event over 65,536 bytes (its content with the envelope: ids, hashes, signatures).
EVENT_BUDGET = 60_000  # bytes of an event's content, as the server (or, encrypted, the ciphertext) counts them
# Characters per message. Each size ensures the plainest form of an edit (see _edit_forms: the text once, without
# HTML) fits EVENT_BUDGET for any text: a character is at most 6 bytes of JSON (a control character as \u0001);
# encrypted, nio encrypts ASCII-escaped JSON (up to 12 bytes a character: a surrogate pair) and the
# ciphertext is base64 (4/3). Richer forms (HTML, the edit fallback) are sent when they fit.
LIMIT = 8_000
ENCRYPTED_LIMIT = 3_500
ENCRYPTION_OVERHEAD = 1_024  # megolm's envelope: sender key, session and device ids, MAC, signature
MAX_FILE_BYTES = MAX_ATTACHMENT_BYTES  # a command's file (an export's zip at most)
# A file a command may come with: Element sends a PNG (a character card) as an image.
DOWNLOAD_SECONDS = 120.0  # for one file a command came with, from the first byte asked to the last read
DOWNLOADS_AT_ONCE = 2  # files of commands fetched at a time (each held whole in memory, up to MAX_FILE_BYTES)
TYPING_MS = 30_000  # how long the server shows the bot typing after each renewal (renewed after two thirds)
FileEvent: TypeAlias = RoomMessageFile | RoomEncryptedFile | RoomMessageImage | RoomEncryptedImage
FILE_EVENTS = (RoomMessageFile, RoomEncryptedFile, RoomMessageImage, RoomEncryptedImage)
MediaEvent: TypeAlias = RoomMessageMedia | RoomEncryptedMedia  # (adapters.matrix_content.MEDIA_EVENTS)
Textless: TypeAlias = RoomMessageUnknown | StickerEvent  # (adapters.matrix_content.TEXTLESS)
VERIFICATION = "m.key.verification."  # msgtypes of a device verification in a room: not handled at all
Received: TypeAlias = RoomMessageText | RoomMessageEmote | MediaEvent | Textless  # a message the bot handles
ENCRYPTED_FILES = (RoomEncryptedFile, RoomEncryptedImage)
P = ParamSpec("P")
E = TypeVar("E", bound=Event)
Handler: TypeAlias = Callable[[MatrixRoom, E], Awaitable[None]]  # an event callback
# A link to a user (matrix.to, Element's own permalinks, matrix: URIs), which clients show as a mention (a pill)
_USER_LINK = re.compile(r"#/(user/)?@|^matrix:(//[^/]*)?/?u/", re.IGNORECASE)



def _server_time(event: Any) -> datetime | None:
    """When the homeserver got ``event`` (its ``origin_server_ts``), or None when it gives none a date can show
    (the message is then dated by the bot's clock)."""
    seconds = server_seconds(getattr(event, "server_timestamp", None))
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)

class _Markdown(MarkdownIt):
    def validateLink(self, url: str) -> bool:  # (markdown-it's name)
        """No link to a user: the Markdown of one (``[Ann](https://matrix.to/#/@ann:server)``) stays text; nor to
        the content of a homeserver (``mxc://``)."""
        return super().validateLink(url) and not _USER_LINK.search(unquote(url)) and \
            not url.strip().lower().startswith("mxc:")


# No images: clients load an inline image (``![x](mxc://attacker.org/<a secret>)`` in what a model was talked into
# writing) from its server as soon as anyone reads the message, without a click. Its Markdown stays text.
_markdown = _Markdown("commonmark", {"html": False, "breaks": True}).enable("table").disable("image")


KEY_REQUESTS_PER_MINUTE = 10  # a sender's undecryptable messages in group rooms that ask for their keys
UNDECRYPTABLE = ("I could not read your last message: my device did not get its encryption keys. I asked your "
                 "client for them; if I do not answer it, send it again (verifying my device helps).")
# Said (unencrypted) once in an encrypted room the bot cannot read: end-to-end encryption is off for it.
UNREADABLE_ROOM = ("End-to-end encryption is off for this bot, so it cannot read this room (nor answer here); "
                   "start an unencrypted chat with it.")
GROUP_PHASE = "/group"  # a direct room's channel while more than two are in it (see MatrixAdapter.inbound)
SYNC_RETRY_FIRST, SYNC_RETRY_LONGEST = 1.0, 300.0  # seconds between failed syncs: doubled from the first
SIGNED_OUT = "M_UNKNOWN_TOKEN"  # the session was signed out (in a client, by an admin) or the token is wrong


_ROOM_PING = re.compile(r"@(room)", re.IGNORECASE)  # clients match the @room ping case-insensitively
# A user's permalink written as plain text, which clients (Element) show as a mention pill: a word joiner after
# its "#/" (or "u/") keeps it text. Links to rooms stay as they are.
_USER_PERMALINK = re.compile(r"(matrix\.to/#/(?=@|%40)|matrix:u/)", re.IGNORECASE)


def _unpinged(text: str) -> str:
    """``text`` (plain or HTML) with no @room ping and no user permalink a client would show as a pill."""
    return _USER_PERMALINK.sub("\\1\u2060", _ROOM_PING.sub("@\u2060\\1", text))


def render(text: str, msgtype: str) -> dict[str, Any]:
    safe = _unpinged(text)
    return {
        "msgtype": msgtype,
        "body": safe,
        "format": "org.matrix.custom.html",
        # again after rendering: Markdown decodes character references ("@&#114;oom" renders as "@room"); a user's
        # link is refused as a link by the renderer and stays text
        "formatted_body": _unpinged(_markdown.render(_ROOM_PING.sub("@\u2060\\1", text))).strip(),
        "m.mentions": {},
    }


def event_size(content: dict[str, Any], encrypted: bool) -> int:
    """Bytes ``content`` takes in its event: canonical JSON in UTF-8; encrypted, the base64 of the ASCII-escaped
    JSON nio encrypts, with megolm's envelope."""
    if encrypted:
        return len(json.dumps(content, separators=(",", ":"))) * 4 // 3 + ENCRYPTION_OVERHEAD
    return len(json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode())


def _plain(content: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in content.items() if k not in ("format", "formatted_body")}


def message_forms(new: dict[str, Any], relation: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """A message's content, richest first: with its HTML, then without."""
    extra = {"m.relates_to": relation} if relation else {}
    yield new | extra
    yield _plain(new) | extra


def edit_forms(new: dict[str, Any], handle: str) -> Iterator[dict[str, Any]]:
    """An edit's content, richest first. Its fallback for clients without edits ("* text") repeats the text:
    a long text drops the fallback's HTML, then shortens the fallback, then drops its own HTML."""
    relation = {"m.relates_to": {"rel_type": "m.replace", "event_id": handle}}
    plain = _plain(new)
    short = {**plain, "body": f"* {new['body'][:80]}…"}
    yield {**new, "body": f"* {new['body']}", "formatted_body": f"* {new['formatted_body']}",
           "m.new_content": new} | relation
    yield {**plain, "body": f"* {new['body']}", "m.new_content": new} | relation
    yield {**short, "m.new_content": new} | relation
    yield {**short, "m.new_content": plain} | relation


def fitting(forms: Iterable[dict[str, Any]], encrypted: bool) -> dict[str, Any]:
    """The first of ``forms`` within :data:`EVENT_BUDGET` (the last when none is; the pieces' size, LIMIT or
    ENCRYPTED_LIMIT, keeps the last within it)."""
    content: dict[str, Any] = {}
    for content in forms:
        if event_size(content, encrypted) <= EVENT_BUDGET:
            break
    return content


def creators_outrank(room_version: Any) -> bool:
    """Whether a room's creators hold the highest power whatever its power levels say: from room version 12
    on. In older rooms a creator is an admin only while the power levels say so (they may have lowered
    their own). A missing version is "1"; unknown (unstable) versions count as older."""
    version = str(room_version or "1")
    return version.isascii() and version.isdigit() and int(version) >= 12


def guarded(handler: Callable[P, Awaitable[None]]) -> Callable[P, Awaitable[None]]:
    """A nio callback that logs its errors instead of raising them: an exception ends ``sync_forever`` (and with
    it the bot), and as the sync token is saved after the callbacks, the same event would end it after a restart."""
    @functools.wraps(handler)
    async def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            await handler(*args, **kwargs)
        except Exception:
            log.exception("Matrix: %s failed; the event is skipped", getattr(handler, "__name__", "a callback"))
    return run


MX_REPLY, MX_REPLY_END = "<mx-reply>", "</mx-reply>"


def without_quoted_reply(formatted: str) -> str:
    """A formatted body without the quote of the message it answers, which the spec puts at its start. (Not a
    regular expression: ``<mx-reply>`` six thousand times without its end, in anyone's message, took a lazy
    match 1.5 s of the event loop.)"""
    if formatted.startswith(MX_REPLY) and (end := formatted.find(MX_REPLY_END)) != -1:
        return formatted[end + len(MX_REPLY_END):]
    return formatted


def _names(text: str, name: str) -> bool:
    """Whether ``text`` names ``name`` as a word of its own ("Cora, hi", not "Coral reefs")."""
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) is not None




class MatrixError(RuntimeError):
    pass


def read_secrets(config: MatrixConfig, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The account's password and access token from the environment (either may be empty, not both)."""
    try:
        password = read_secret(config.password_env, env) or "" if config.password_env else ""
        token = read_secret(config.access_token_env, env) or "" if config.access_token_env else ""
    except ConfigError as exc:
        raise MatrixError(str(exc)) from None
    if not (password or token):  # (both named: either will do, and the line named only the password's)
        named = [shown_variable(name, f"[matrix] {key}") + f" ({what})" for name, key, what in (
            (config.password_env, "password_env", "the account's password"),
            (config.access_token_env, "access_token_env", "an access token")) if name]
        raise MatrixError(f"[matrix] needs a password or an access token: set "
                          f"{' or '.join(named) or '[matrix] password_env or access_token_env'}")
    return password, token


SESSION_FILE = MATRIX_SESSION_FILE


def keep_private(store: Path) -> None:
    """The store folder made, or made the owner's alone with the files in it (see :func:`own_folder`)."""
    try:
        own_folder(store)
    except OSError as exc:
        raise MatrixError(f"the Matrix store folder {store} holds the bot's login and keys, and others may read it; "
                          f"it cannot be made private ({exc.strerror}): chmod 700 it as its owner, or set [matrix] "
                          "store_path to a folder of the account running the bot") from None


def store_dir(config: MatrixConfig) -> Path:
    """Where the account's session (and with e2ee its keys) is kept: ``store_path``, else the data folder's."""
    return Path(config.store_path or Path(platformdirs.user_data_dir("cortex-bot")) / "matrix")


def saved_session(store: Path, user_id: str) -> dict[str, Any]:
    """The session file's state (device, access token of a password login, sync token, rooms) of ``user_id``."""
    try:
        data = json.loads((store / SESSION_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("user_id") == user_id else {}


class _Client(AsyncClient):  # type: ignore[misc]  # (nio ships no types)
    """nio's client, showing the adapter each sync before its events are handed out (``before_events``)."""

    before_events: Callable[[SyncResponse], None] | None = None

    async def receive_response(self, response: Response) -> None:
        if isinstance(response, SyncResponse) and self.before_events is not None:
            self.before_events(response)
        await super().receive_response(response)

    def _handle_joined_state(self, room_id: str, join_info: Any, encrypted_rooms: set[str]) -> None:
        """A joined room's state from a sync, its power levels replaced whole (see ``adapters.matrix_levels``)."""
        replaced_whole(self.rooms.get(room_id))
        super()._handle_joined_state(room_id, join_info, encrypted_rooms)

    def load_store(self) -> None:
        """nio's key store, its database made owner-only before nio opens it (nio creates it with the umask: in a
        folder others may enter, everyone could read the account's and the rooms' keys)."""
        if self.store is None and self.config.encryption_enabled and self.store_path and self.user_id \
                and self.device_id:
            private_file(Path(self.store_path) / (self.config.store_name or f"{self.user_id}_{self.device_id}.db"))
        super().load_store()


class MatrixSink:
    """Delivery for one incoming message (see :class:`bot.router.ChatSink`)."""

    limit = LIMIT

    def __init__(self, adapter: MatrixAdapter, room: MatrixRoom,
                 event: Received) -> None:
        self.adapter = adapter
        self.room = room
        self.event = event
        self.encrypted = adapter.is_encrypted(room.room_id)
        self.limit = ENCRYPTED_LIMIT if self.encrypted else LIMIT
        relates = relates_to(event.source.get("content"))
        root = relates.get("event_id") if relates.get("rel_type") == "m.thread" else None
        self.thread_root = root if isinstance(root, str) else None

    def _relation(self) -> dict[str, Any]:
        if self.thread_root:
            return {"rel_type": "m.thread", "event_id": self.thread_root, "is_falling_back": True,
                    "m.in_reply_to": {"event_id": self.event.event_id}}
        return {"m.in_reply_to": {"event_id": self.event.event_id}}

    @staticmethod
    def message_key(handle: str) -> str:
        """How a reply's message is named (for ``!memory why`` sent as a reply to it)."""
        return message_key(handle)

    async def send(self, text: str) -> str:
        new = render(text, self.adapter.config.msgtype)
        return await self.adapter.send(self.room.room_id, fitting(message_forms(new, self._relation()), self.encrypted))

    async def edit(self, handle: str, text: str) -> None:
        new = render(text, self.adapter.config.msgtype)
        await self.adapter.send(self.room.room_id, fitting(edit_forms(new, handle), self.encrypted))

    @asynccontextmanager
    async def typing(self) -> AsyncIterator[None]:
        if not self.adapter.app.config.chat.typing_indicator:
            yield
            return
        await self.adapter.typing_starts(self.room.room_id)
        try:
            yield
        finally:
            await self.adapter.typing_ends(self.room.room_id)

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
        self.leave = PlatformCommand(
            PLATFORM, "leave", f"make me leave this room (its admins: power level {config.admin_power_level} or more)")
        app.commands.note_platform_command(self.leave)
        self.password, self.token = read_secrets(config, env)
        self.store = store_dir(config)
        keep_private(self.store)  # the login and, with e2ee, the keys
        self.client = _Client(
            config.homeserver, config.user_id, store_path=str(self.store),
            config=AsyncClientConfig(encryption_enabled=config.e2ee, store_sync_tokens=False),
        )
        self.client.before_events = self._before_events
        self.server_name = home_server(config.user_id)
        self._sent: OrderedDict[str, None] = OrderedDict()  # recent event ids the bot sent
        self._senders: OrderedDict[str, str] = OrderedDict()  # who sent older events replied to (asked once)
        self._named_commands: re.Pattern[str] | None = None  # "!memory …" in answers, to show with the room's prefix
        self._redactions: OrderedDict[str, None] = OrderedDict()  # redactions handled (a catch-up meets them again)
        self._catching_up: set[str] = set()  # rooms whose skipped redactions are being read back
        self._gaps: dict[str, tuple[str, str | None]] = {}  # per room: a skipped stretch still to read back
        self.reactions = Reactions(self)
        self._order = InOrder()  # each room's messages handled in the order they came (adapters.matrix_order)
        self._handled: OrderedDict[str, None] = OrderedDict()  # recent messages handled (a read-back meets them again)
        self._downloads = asyncio.Semaphore(DOWNLOADS_AT_ONCE)  # a burst of file commands in one sync waits its turn
        state = self._load_state()
        self.backlogs = Backlogs(self, json_object(state.get("message_gaps")))  # what limited syncs skipped
        # The direct room the bot opened for each user (for private answers), kept in the session file.
        self._dms: dict[str, str] = dict(state.get("dm_rooms", {}))
        # Who invited the bot into each room it joined on an invite.
        self._inviters: dict[str, str] = dict(state.get("room_inviters", {}))
        # Rooms the bot joined as a direct chat ("dm": the invite said is_direct, or the bot opened it) or as
        # a group ("group"), kept in the session file: a group room down to two members stays a group.
        self._kinds: dict[str, str] = dict(state.get("room_kinds", {}))
        # Rooms that replace one the bot was in (an upgrade), with the room they replace: its settings came along.
        self._upgraded: dict[str, str] = dict(state.get("upgraded_rooms", {}))
        self._creators: dict[str, frozenset[str]] = {}
        self.joins = JoinTimes(self.client)
        # When the last sync was handled (kept with its token): a limited sync skipped what came after it.
        self._synced_at = float(state.get("synced_at") or 0.0)
        # Rooms whose history was hidden from newcomers at some time: what was said then stays hidden from those
        # who join later (the visibility at each event decides), so they stay such rooms for the bot.
        self._hidden_history: set[str] = set(state.get("hidden_history_rooms", []))
        self._makers: dict[str, str] = {}  # who sent each room's m.room.create (not its additional creators)
        self._creators_outrank: set[str] = set()  # rooms of version 12 or later: their creators hold power 100
        self._tasks: set[asyncio.Task[None]] = set()
        # Typing is one flag per room for the bot's account: it stays on while any answer there is written or
        # waits for its turn (refreshed before the server's timeout), and goes off with the last one.
        self._typing: dict[str, tuple[int, asyncio.Task[None]]] = {}
        self._stopping = asyncio.Event()
        self._sync_seen = asyncio.Event()  # set (and replaced) after each sync
        self._joining: set[str] = set()  # rooms joined on invite whose own join event is not seen yet
        self._join_events: dict[str, str] = {}  # of those: the event id of that join, where a sync brought it
        self._sync_failures = 0  # failed syncs in a row (each waits longer before the next)
        self._undecryptable: OrderedDict[tuple[str, str], None] = OrderedDict()  # (room, session) said once
        # Without e2ee: the encrypted rooms told once that the bot cannot read them (kept in the session file).
        self._told_unreadable: set[str] = set(state.get("unreadable_rooms_told", []))
        # Key requests a sender's undecryptable messages in group rooms may cause: each is a to-device request and
        # a warning, and anyone's server can send made-up sessions without end.
        self._key_requests = RateLimiter(KEY_REQUESTS_PER_MINUTE)
        self._fatal: MatrixError | None = None  # why the sync stopped for good (run raises it)
        self._lost = asyncio.Event()  # the account's claim went to another process
        self.ready = asyncio.Event()

    # -- state -----------------------------------------------------------------------------------

    @property
    def _state_file(self) -> Path:
        return self.store / SESSION_FILE

    def _load_state(self) -> dict[str, Any]:
        return saved_session(self.store, self.config.user_id)

    def _save_state(self, **changes: Any) -> None:
        state = self._load_state() | {"user_id": self.config.user_id} | changes
        tmp = self._state_file.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)  # left by a crash: created anew below, owner-only from the first byte
        with create_private(tmp) as out:  # it holds the access token
            out.write(json.dumps(state).encode())
        tmp.replace(self._state_file)

    async def wait_for_homeserver(self, first_wait: float = 2.0, longest_wait: float = 300.0) -> None:
        """Until the homeserver answers, say once which URL cannot be reached and why, then keep trying
        with back-off (nio alone would retry silently, or fill the log)."""
        server = self.config.homeserver
        await wait_until_answers(
            server.rstrip("/") + "/_matrix/client/versions", first=first_wait, longest=longest_wait,
            down=lambda problem: log.error(
                "Matrix: cannot reach the homeserver at %s (%s); check [matrix] homeserver. Retrying with back-off "
                "(at most every %.0f s)", server, problem, longest_wait),
            back=lambda: log.info("Matrix: %s answers again; connecting", server))

    async def login(self) -> None:
        state = self._load_state()
        if state.get("access_token") and state.get("device_id") and await self._still_valid(state):
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

    async def _still_valid(self, state: dict[str, Any]) -> bool:
        """Whether the session saved by an earlier password login is still signed in. One signed out since
        (in a client, or by an admin) is dropped, so the password logs in anew; a check that fails for
        another reason (the server busy) keeps it, and the sync tells."""
        self.client.access_token = str(state["access_token"])
        who = await self.client.whoami()
        self.client.access_token = ""
        if isinstance(who, WhoamiError) and who.status_code == SIGNED_OUT:
            log.warning("Matrix: the saved session of %s was signed out; logging in again with the password",
                        self.config.user_id)
            self._save_state(access_token="")
            return False
        return True

    # -- running ---------------------------------------------------------------------------------

    async def run(self) -> None:
        # One process per account: a second one would answer every message twice.
        await self.app.fleet.hold(f"matrix:{self.config.user_id}", f"the Matrix account {self.config.user_id}",
                                  on_lost=self._account_lost)
        connecting = asyncio.ensure_future(self._connect())
        lost = asyncio.ensure_future(self._lost.wait())
        try:  # (the claim may be lost while waiting for the homeserver or logging in)
            await asyncio.wait({connecting, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not connecting.done():
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
        if self._fatal is not None:
            raise self._fatal
        since = connecting.result()
        self._serve_callbacks()
        self.backlogs.resume()  # (before the first sync's own events)
        log.info("Matrix: %s syncing from %s", self.config.user_id, self.config.homeserver)
        self.ready.set()
        try:
            await self.client.sync_forever(timeout=10_000, since=since, full_state=True)
        finally:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._fatal is not None:
            raise self._fatal

    async def _connect(self) -> str:
        """Wait for the homeserver, log in, and the sync token to start from (a first start takes the room state
        and answers the invites that arrived before it)."""
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
            # Invites are not history: answer the ones that arrived before the bot first ran (as direct or
            # group chats, as their invites said).
            for invited in list(self.client.invited_rooms.values()):
                info = first.rooms.invite.get(invited.room_id)
                await self._consider_invite(invited, getattr(invited, "inviter", None) or "",
                                            self._invited_directly(info.invite_state if info else []))
        # (``since`` goes to the first sync only, never to client.next_batch: nio drops a sync answer whose token
        # equals it, and after a restart with nothing new that was the full-state one, leaving no room known.)
        return str(since)

    def _serve_callbacks(self) -> None:
        """Every callback is guarded: one bad event must not end the sync (see ``guarded``)."""
        self.client.add_event_callback(guarded(self._served(self._on_message)),
                                       (RoomMessageText, RoomMessageEmote, *TEXTLESS))
        self.client.add_event_callback(guarded(self._served(self._on_file)), MEDIA_EVENTS)
        self.client.add_event_callback(guarded(self._served(self.reactions.on_reaction)), ReactionEvent)
        self.client.add_event_callback(guarded(self._on_redaction), RedactionEvent)
        self.client.add_event_callback(guarded(self._served(self._on_undecryptable)), MegolmEvent)
        self.client.add_event_callback(guarded(self._on_invite), InviteMemberEvent)
        self.client.add_event_callback(guarded(self._on_member), RoomMemberEvent)
        self.client.add_response_callback(guarded(self._on_sync), SyncResponse)
        self.client.add_response_callback(guarded(self._on_sync_error), SyncError)

    async def typing_starts(self, room_id: str) -> None:
        count, task = self._typing.get(room_id, (0, None))
        self._typing[room_id] = (count + 1, task or asyncio.create_task(self._keep_typing(room_id)))

    async def typing_ends(self, room_id: str) -> None:
        count, task = self._typing[room_id]
        if count > 1:
            self._typing[room_id] = (count - 1, task)
            return
        del self._typing[room_id]
        task.cancel()
        try:
            await asyncio.gather(task, return_exceptions=True)  # (a renewal on its way lands before the end)
            await self.client.room_typing(room_id, False)
        except Exception as exc:  # (a lost connection: the server's timeout ends it)
            log.debug("Matrix: typing not ended in %s (%s)", room_id, type(exc).__name__)

    async def _keep_typing(self, room_id: str) -> None:
        while True:
            try:
                await self.client.room_typing(room_id, True, timeout=TYPING_MS)
            except Exception as exc:
                log.debug("Matrix: no typing indicator in %s (%s)", room_id, type(exc).__name__)
            await asyncio.sleep(TYPING_MS / 1000 * 2 / 3)

    async def close(self) -> None:
        for _, typing in self._typing.values():
            typing.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()

    async def _on_sync_error(self, response: SyncError) -> None:
        """A failed sync (a proxy's 502, the server overloaded, the session signed out): nio would sync again
        at once, thousands of times a minute. Wait, doubling up to ``SYNC_RETRY_LONGEST``; say so once."""
        if response.status_code == SIGNED_OUT:
            if not await self._login_again():
                self._signed_out()
            return
        self._sync_failures += 1
        wait = min(SYNC_RETRY_FIRST * 2 ** min(self._sync_failures - 1, 20), SYNC_RETRY_LONGEST)
        wait = max(wait, (response.retry_after_ms or 0) / 1000)
        if self._sync_failures == 1:
            log.error("Matrix: sync with %s failed (%s); retrying with back-off (at most every %.0f s)",
                      self.config.homeserver, _short(response), SYNC_RETRY_LONGEST)
        await asyncio.sleep(wait)

    async def _login_again(self) -> bool:
        """With the password and without encryption, a signed-out session is replaced by a new login at once
        (with encryption, the device's keys belong to the old session: a restart sets up the new device)."""
        if not self.password or self.config.e2ee:
            return False
        response = await self.client.login(self.password, device_name=self.config.device_name)
        if not isinstance(response, LoginResponse):
            log.error("Matrix: logging in again failed: %s", response)
            return False
        self._save_state(device_id=response.device_id, access_token=response.access_token)
        log.warning("Matrix: the session of %s was signed out; logged in again (a new device)", self.config.user_id)
        return True

    def _account_lost(self, why: str) -> None:
        """Another process took the account's claim (this one stalled, or could not reach the database for the
        claim's whole time): it serves the account now, and this one stops, or every message is answered twice."""
        self._fatal = MatrixError(f"{why}; this process stopped serving it (restart it once the other one stops)")
        self._lost.set()
        self.client.stop_sync_forever()

    def _signed_out(self) -> None:
        """The session is gone: stop with one clear line (the process ends; a restart logs in again with the
        password, or needs a new access token)."""
        if self.password:
            self._save_state(access_token="")
            how = "restart the bot: it logs in again with the password (a new device, with new keys)"
        else:
            how = f"put a new access token in {self.config.access_token_env} (or set password_env) and restart"
        self._fatal = MatrixError(f"the Matrix session of {self.config.user_id} was signed out ({SIGNED_OUT}); {how}")
        log.error("Matrix: %s", self._fatal)
        self.client.stop_sync_forever()

    async def _on_sync(self, response: SyncResponse) -> None:
        if self._sync_failures:
            log.info("Matrix: syncing again after %d failed attempts", self._sync_failures)
            self._sync_failures = 0
        seen, self._sync_seen = self._sync_seen, asyncio.Event()
        seen.set()
        # A join whose own event the timeline did not carry (a limited one): the room counts as joined after
        # the first sync that brings it, whatever happens.
        self._joining.difference_update(response.rooms.join)
        for room_id in response.rooms.join:
            self._join_events.pop(room_id, None)
        self._left(response.rooms.leave)
        since = self._load_state().get("next_batch")  # where this sync started
        for room_id, info in response.rooms.join.items():
            if info.timeline.limited and info.timeline.prev_batch:  # events before prev_batch were skipped
                self._gap(room_id, info.timeline.prev_batch, since if isinstance(since, str) else None)
        self._synced_at = time.time()
        self._save_state(next_batch=response.next_batch, synced_at=self._synced_at,
                         message_gaps=self.backlogs.to_save())
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

    def serves(self, room: MatrixRoom) -> bool:
        """Whether the bot can take part in ``room``: any room with e2ee; without it, only an unencrypted one (it
        cannot read an encrypted room's messages, and what it sent there would go unencrypted)."""
        return self.config.e2ee or not room.encrypted

    def _served(self, handler: Handler[E]) -> Handler[E]:
        """``handler`` for the rooms the bot serves; in an encrypted room without e2ee, an event (an undecryptable
        message, or one a client sent unencrypted there) is not read, and tells the room once that it cannot be."""
        async def run(room: MatrixRoom, event: E) -> None:
            if self.serves(room):
                await handler(room, event)
            elif event.sender != self.config.user_id and not self._before_join(room):
                await self._unreadable(room, event)
        return run

    async def _unreadable(self, room: MatrixRoom, event: Event) -> None:
        """An event in an encrypted room the bot cannot read (e2ee off): the room is told so once, unless the
        access lists leave its sender out."""
        if room.room_id in self._told_unreadable:
            return
        inbound = await self.reactions.inbound(room, event)
        if refusal(inbound, self.app.config.access, is_command=True) is None:
            await self._tell_unreadable(room.room_id)

    async def _tell_unreadable(self, room_id: str) -> None:
        """Say once per room (kept in the session file), unencrypted, that end-to-end encryption is off for the
        bot: with e2ee off it cannot read an encrypted room, and stays quiet there."""
        if room_id in self._told_unreadable:
            return
        self._told_unreadable.add(room_id)
        self._save_state(unreadable_rooms_told=sorted(self._told_unreadable))
        log.info("Matrix: %s is encrypted and e2ee is off: the bot cannot read it (said so there once)", room_id)
        await self.send(room_id, render(UNREADABLE_ROOM, self.config.msgtype), unencrypted_notice=True)

    async def _consider_invite(self, room: MatrixRoom, inviter: str, direct: bool | None = None) -> None:
        servers = self.config.invite_servers or [self.server_name]
        allowed = self.config.auto_join and home_server(inviter) in servers
        access = self.app.config.access
        if f"{PLATFORM}:{inviter}" in access.deny_users or (
            access.allow_users and f"{PLATFORM}:{inviter}" not in access.allow_users
        ):
            allowed = False
        if allowed and self._invited_enough(inviter):
            log.warning("Matrix: declined an invite to %s: %s already brought the bot into %d rooms "
                        "([matrix] max_rooms_per_inviter)", room.room_id, inviter, self.config.max_rooms_per_inviter)
            allowed = False
        if allowed:
            if direct is not None:
                self._remember_kind(room.room_id, "dm" if direct else "group")
            self._inviters[room.room_id] = inviter
            self._save_state(room_inviters=self._inviters)
            self._joining.add(room.room_id)
            response = await self.client.join(room.room_id)
            if not isinstance(response, JoinResponse):
                self._joining.discard(room.room_id)  # (not joined: no room of theirs to count)
                log.warning("Matrix: could not join %s on invite: %s", room.room_id, response)
                return
            log.info("Matrix: joined %s on invite", room.room_id)
            await self._follow_upgrade(room.room_id, inviter)
            # (an encrypted room, without e2ee, is told it cannot be read at its first message, where the access
            # lists are asked about its sender: an invite alone made the bot speak where they keep it silent)
        else:
            await self.client.room_leave(room.room_id)
            log.info("Matrix: declined an invite to %s", room.room_id)

    async def _follow_upgrade(self, room_id: str, inviter: str) -> None:
        """A room that replaces one the bot was in (see ``adapters.matrix_upgrades``) is what that one was. A
        client's invite into an upgraded DM does not say is_direct: the new room is the user's DM still when its
        inviter is the user the old one was private to (``_private_to``'s checks, the new room's own checked at
        each message as any DM's are). A group room stays a group whatever its invite said."""
        old = self.client.rooms.get(await verified_predecessor(self.client, room_id, self.client.rooms) or "")
        if old is None:
            return
        if await self._was_private_to(old, inviter):
            self._remember_kind(room_id, "dm")
        elif self._kinds.get(old.room_id) == "group" or not self.is_dm(old):
            self._remember_kind(room_id, "group")
        log.info("Matrix: %s replaces %s (an upgrade): a %s room", room_id, old.room_id, self._kinds.get(room_id))
        # What its admins set for the room is keyed by its id: the new room takes it over, once (a setting cleared
        # there is not brought back when the bot is invited again).
        if room_id not in self._upgraded:
            await self.app.carry_over_place(f"{PLATFORM}:{old.room_id}", f"{PLATFORM}:{room_id}",
                                            author=f"{PLATFORM}:{inviter}")
            self._upgraded[room_id] = old.room_id
            self._save_state(upgraded_rooms=self._upgraded)

    def _invited_directly(self, invite_state: list[Any]) -> bool | None:
        """Whether the invite (the bot's own member event among a room's invite state) says ``is_direct``;
        None when the state does not hold it."""
        for event in invite_state:
            if isinstance(event, InviteMemberEvent) and event.state_key == self.config.user_id:
                return bool(json_object(event.content).get("is_direct"))
        return None

    def _invited_enough(self, inviter: str) -> bool:
        """Whether ``inviter`` (not an admin) already brought the bot into as many rooms as one user may: on
        a public homeserver anyone could otherwise fill it with rooms, each one more to sync."""
        limit = self.config.max_rooms_per_inviter
        if not limit or inviter in self.config.admin_ids:
            return False
        # A room joined a moment ago (invites that came in one sync) is not in ``rooms`` until a sync brings it.
        rooms = sum(1 for room, who in self._inviters.items()
                    if who == inviter and (room in self.client.rooms or room in self._joining))
        return rooms >= limit

    async def _may_redact(self, room: MatrixRoom, user_id: str) -> bool:
        """Whether the user may redact others' events in the room (a creator of a version 12 room may, unlisted:
        nio's own check says no)."""
        await self._load_creators(room.room_id)
        return self.power_level(room, user_id) >= int(room.power_levels.defaults.redact)

    def power_level(self, room: MatrixRoom, user_id: str) -> int:
        """The user's power level in the room (``_load_creators`` first: creators hold 100)."""
        level = int(room.power_levels.get_user_level(user_id))
        if room.room_id in self._creators_outrank and user_id in self._creators.get(room.room_id, ()):
            level = max(level, 100)  # room version 12: creators outrank everyone and are not listed
        return level

    async def ranks_of(self, room: MatrixRoom, user_id: str) -> tuple[tuple[str, int], ...]:
        """The user's rank in the room for the access rules: their power level."""
        await self._load_creators(room.room_id)
        return ((POWER, self.power_level(room, user_id)),)

    async def inbound(self, room: MatrixRoom, event: Received) -> Inbound:
        content = event.source.get("content")
        me = self.config.user_id
        # The bot's own display name: the room's form of it gains " (@id)" once a member copies the name.
        bot_user = room.users.get(me)
        display = (bot_user.display_name if bot_user is not None else None) or room.user_name(me) or me
        reply_to = reply_target(content)
        said = said_in(event)
        body = without_reply_fallback(said) if reply_to else said
        formatted = without_quoted_reply(getattr(event, "formatted_body", None) or "")  # not the quoted message
        mentions_bot = (me in mentioned(content) or _names(body, me) or bool(display and _names(body, display))
                        or me in formatted)
        is_dm, channel_id, parent = await self.conversation(room, event.sender)
        level = self.power_level(room, event.sender)
        # Whose message it replies to matters only where it decides: in a room, without a mention.
        replied_to_bot = (reply_to is not None and not is_dm and not mentions_bot
                          and await self._sent_by_me(room.room_id, reply_to))
        # (a message the bot may answer or run: the others need no history)
        addressed = bool(mentions_bot) or replied_to_bot or body.lstrip().startswith(self.config.command_prefix)
        text = body
        for name in (me, display):
            if name and text.startswith(name) and not text[len(name):len(name) + 1].isalnum():  # not "Coral"
                text = text[len(name):].lstrip(":, ")
        author, handle = author_of(room, event.sender, shared=not is_dm)  # (in a room: with the id)
        incoming = IncomingMessage(
            platform=PLATFORM,
            channel_id=channel_id,
            parent_channel_id=parent,
            author_id=event.sender,
            author_name=author,
            author_handle=handle,
            text=text,
            is_dm=is_dm,
            channel_name=room.display_name,
            # A room is Matrix's unit of administration (power levels): its guidelines, settings and skills
            # belong to it, and a room admin is admin of that room only.
            server_id=None if is_dm else room.room_id,
            author_home=home_server(event.sender),
            mentions_bot=bool(mentions_bot),
            reply_to=f"{PLATFORM}-message:{reply_to}" if reply_to else None,
            message_key=MatrixSink.message_key(event.event_id),
            # (the homeserver's time: a message read back after a limited sync is stored after it came)
            sent_at=_server_time(event),
            history_from=None if is_dm else await self._history_from(room, event.sender, addressed),
        )
        return Inbound(
            incoming,
            is_self=event.sender == me,
            replied_to_bot=replied_to_bot,
            ranks=((POWER, level),),
            # In a DM everyone holds power 100 in their own room: that makes nobody an admin of anything.
            is_admin=event.sender in self.config.admin_ids or (not is_dm and level >= self.config.admin_power_level),
            is_bot_admin=event.sender in self.config.admin_ids,
        )

    def _hides_history(self, room: MatrixRoom) -> bool:
        """Whether the room hides, or once hid, what was said before a member joined (noted in the session file:
        what was said then stays hidden from those who join later)."""
        if room.history_visibility in HIDDEN_BEFORE_JOIN and room.room_id not in self._hidden_history:
            self._hidden_history.add(room.room_id)
            self._save_state(hidden_history_rooms=sorted(self._hidden_history))
        return room.room_id in self._hidden_history

    async def _history_from(self, room: MatrixRoom, sender: str, addressed: bool) -> datetime | None:
        """Since when ``sender`` sees the room's messages, in a room that hides (or once hid) what was said before
        a member joined (``IncomingMessage.history_from``): from their join; when the server cannot say, from
        now (nothing before their message). Looked up only for a message the bot may answer (``addressed``):
        for the others, from now."""
        if not self._hides_history(room):
            return None
        joined = await self.joins.joined_at(room.room_id, sender) if addressed else None
        return joined or datetime.now(UTC)

    async def _sent_by_me(self, room_id: str, event_id: str) -> bool:
        """Whether the bot sent ``event_id``: its recent sends are known; an older one (sent before a restart,
        or past the last 1,000) is asked of the server, once."""
        if event_id in self._sent:
            return True
        sender = self._senders.get(event_id)
        if sender is None:
            sender = await self._event_sender(room_id, event_id)
            if sender is None:
                return False  # the server did not answer: ask again next time
            keep(self._senders, event_id, sender)  # "" (no such event here) too: a made-up id costs one request
        return sender == self.config.user_id

    async def _event_sender(self, room_id: str, event_id: str) -> str | None:
        """Who sent ``event_id`` in the room, as its server says; "" when the server says there is no such
        event there; None when it did not answer."""
        response = await self.client.room_get_event(room_id, event_id)
        sender = getattr(getattr(response, "event", None), "sender", None)
        if isinstance(sender, str):
            return sender
        return "" if str(getattr(response, "status_code", "") or "").startswith("M_") else None

    async def _on_undecryptable(self, room: MatrixRoom, event: MegolmEvent) -> None:
        """A message the bot could not decrypt (its device lacks the session's keys): in a DM, ask the
        sender's devices for the keys and say so once per session, instead of a silence that looks like a
        dead bot. (In a group room it may not have been for the bot: the log says it.)"""
        if event.sender == self.config.user_id or self._before_join(room) or not self.config.e2ee:
            return  # (without e2ee, an encrypted event in an unencrypted room: encrypted ones see ``_served``)
        key = (room.room_id, str(event.session_id))
        if key in self._undecryptable:
            return
        direct = self.is_dm(room)
        # A made-up session id is one more notice: in a DM, as a readable message would, they meet the access
        # lists and the sender's rate limit; in a group room the lists and a limit of key requests per sender.
        inbound = await self.reactions.inbound(room, event)
        if direct and not await self.reactions.allowed(inbound, "an undecryptable message"):
            return
        if not direct and (refusal(inbound, self.app.config.access, is_command=True) is not None
                           or self._key_requests.check(event.sender)):
            return
        keep(self._undecryptable, key, None)
        log.warning("Matrix: could not decrypt a message from %s in %s (session %s)", event.sender, room.room_id,
                    event.session_id)
        with contextlib.suppress(Exception):  # (already asked, or the sender's devices unknown)
            await self.client.request_room_key(event)
        if direct:
            await self.deliver(room.room_id, CommandReply(UNDECRYPTABLE))

    async def conversation(self, room: MatrixRoom, sender: str) -> tuple[bool, str, str | None]:
        """Whether ``room`` is ``sender``'s direct chat with the bot, the room's channel id and its parent's.

        A direct room is one person's: anyone else who speaks there (others joined it, or its maker left and a
        newcomer stayed, or a room was made to look direct) is in a conversation of its own, so the direct one
        (its window, its summary, its private answers) never reaches them; the room's lists and persona still
        apply (the parent). Rooms the bot joined as groups are one conversation, whoever speaks."""
        direct = self.is_dm(room)
        if direct and (sender == self.config.user_id or await self._private_to(room, sender)):
            return True, room.room_id, None
        kind = self._kinds.get(room.room_id)
        if kind == "dm" or (kind is None and direct):  # (no kind: a room joined before kinds were kept)
            return False, f"{room.room_id}{GROUP_PHASE}", room.room_id
        return False, room.room_id, None

    async def _on_member(self, room: MatrixRoom, event: RoomMemberEvent) -> None:
        if self._hides_history(room):
            self.joins.note(room.room_id, event)  # (as it arrives: see adapters.matrix_joins)
        if event.state_key == self.config.user_id and event.membership == "join" \
                and self._join_events.get(room.room_id, event.event_id) == event.event_id:
            self._joining.discard(room.room_id)  # what follows in the timeline was said with the bot there
            self._join_events.pop(room.room_id, None)

    def _before_events(self, response: SyncResponse) -> None:
        self._note_new_joins(response)
        since = self._load_state().get("next_batch")  # where this sync started
        self.backlogs.note(response, since if isinstance(since, str) else None)

    def _note_new_joins(self, response: SyncResponse) -> None:
        """Before a sync's events are handed out: the bot's own join in each room it is joining, the last one in
        the room's timeline. Invited back (after !leave, a kick), the bot is given the room's recent history with
        its earlier join in it: what came after that one was answered then, or said while it was away (an old
        !leave among it made it leave again)."""
        me = self.config.user_id
        for room_id in self._joining & response.rooms.join.keys():
            joins = [e.event_id for e in response.rooms.join[room_id].timeline.events if isinstance(e, RoomMemberEvent)
                     and e.state_key == me and e.membership == "join" and e.prev_membership != "join"]
            if joins:  # (a name change of the bot's is a join after a join: not this one)
                self._join_events[room_id] = joins[-1]

    def _left(self, room_ids: Iterable[str]) -> None:
        """Rooms the bot left, was kicked from or turned down (a sync's "leave" section, which nio does not read):
        gone from the client's rooms, where they still listed the bot as a member (a direct room it was kicked
        from took every private answer; rooms it was made to leave counted against their inviter's limit)."""
        inviters = len(self._inviters)
        for room_id in room_ids:
            self.client.rooms.pop(room_id, None)
            self.client.invited_rooms.pop(room_id, None)
            self._joining.discard(room_id)
            self._join_events.pop(room_id, None)
            # What is read again on a return (its creators), and who brought the bot in (counted only for rooms it
            # is in): kept after a leave, they grew by every room the bot was ever in, the session file too.
            self._creators.pop(room_id, None)
            self._makers.pop(room_id, None)
            self._creators_outrank.discard(room_id)
            self._inviters.pop(room_id, None)
        if len(self._inviters) != inviters:
            self._save_state(room_inviters=self._inviters)

    async def _on_redaction(self, room: MatrixRoom, event: RedactionEvent) -> None:
        """A message taken back (by its sender or a moderator): the bot's copy goes too (see ``withdraw``).
        Redactions come from anyone's homeserver: the redacted event is asked of this room (it must be
        there), and its sender's message goes only if they or someone who may redact here took it back."""
        if self._before_join(room) or not isinstance(event.redacts, str) or event.event_id in self._redactions:
            return
        sender = await self._event_sender(room.room_id, event.redacts)
        if sender is not None:
            keep(self._redactions, event.event_id, None)  # answered: a catch-up meeting it again skips it
        if not sender:
            return  # not an event of this room (or the server did not answer: a catch-up may ask again)
        if event.sender != sender and not await self._may_redact(room, event.sender):
            return
        # One of the bot's replies, taken back by a moderator: it goes from the store (and the prompts) too.
        author = None if sender == self.config.user_id else f"{PLATFORM}:{sender}"
        await self.app.core.withdraw(MatrixSink.message_key(event.redacts), author)

    def _gap(self, room_id: str, prev_batch: str, since: str | None) -> None:
        """A stretch of the room a limited sync skipped (``since`` to ``prev_batch``), to read back for its
        redactions: merged with one still waiting (the newest start, the oldest end), one catch-up per room
        at a time (a room flooded with events makes every sync limited). Who joined or left in it is read
        from the room's state when next needed."""
        self.joins.gap(room_id, self._synced_at)
        waiting = self._gaps.get(room_id)
        self._gaps[room_id] = (prev_batch, waiting[1] if waiting is not None else since)
        if room_id not in self._catching_up:
            self._catching_up.add(room_id)
            self._spawn(self._catch_up(room_id))

    async def _catch_up(self, room_id: str) -> None:
        """Messages taken back in the stretches limited syncs skipped (see ``adapters.matrix_gaps``)."""
        try:
            while room_id in self._gaps:
                prev_batch, since = self._gaps.pop(room_id)
                async for event in missed_redactions(self.client, room_id, prev_batch, since):
                    room = self.client.rooms.get(room_id)
                    if room is None:  # left meanwhile
                        self._gaps.pop(room_id, None)
                        return
                    await self._on_redaction(room, event)
        except Exception:
            log.exception("Matrix: reading back the redactions a limited sync skipped in %s failed", room_id)
        finally:
            self._catching_up.discard(room_id)

    def _before_join(self, room: MatrixRoom) -> bool:
        """Whether an event of a room just joined on invite precedes the bot's own join in the timeline (the
        room's history, shown to newcomers): someone asked another member then, not the bot."""
        return room.room_id in self._joining

    def _takes(self, room: MatrixRoom, event: Received) -> bool:
        """Whether a message (or an upload) is handled: not the bot's own, not from before its join, not an edit
        of an earlier one (an edited text or caption is not run or answered again), and not handled already (a
        stretch a limited sync skipped is read back: see ``_read_backlog``)."""
        if event.sender == self.config.user_id or self._before_join(room) or event.event_id in self._handled:
            return False
        if relates_to(event.source.get("content")).get("rel_type") == "m.replace":
            return False
        if isinstance(event, RoomMessageUnknown) and event.msgtype.startswith(VERIFICATION):
            return False  # (a client asking to verify the bot's device: no one's message, and not answered)
        keep(self._handled, event.event_id, None)
        return True

    def _command_file(self, event: Received) -> tuple[str, dict[str, Any]] | None:
        """An upload's file name and content when its caption may be a command that takes the file (MSC2530: a
        caption is a body that differs from the ``filename``); otherwise its caption is read as a message, as
        Discord's text beside a picture is. The file itself is never read for chat."""
        if not isinstance(event, FILE_EVENTS) or not upload_caption(event).startswith(self.config.command_prefix):
            return None
        content = json_object(event.source.get("content"))
        return str(content.get("filename") or ""), content

    async def _on_message(self, room: MatrixRoom, event: RoomMessageText | RoomMessageEmote | Textless) -> None:
        if self._takes(room, event):
            self._spawn(self._handle(room, event, self._order.take(room.room_id)))

    async def _on_file(self, room: MatrixRoom, event: MediaEvent) -> None:
        """An upload. With a caption that is a command, a file (``!persona import`` with a card) is the command's
        attachment (see ``_command_file``); an upload without a caption is a message without text (in a DM, or
        addressed: the bot says it reads text)."""
        if self._takes(room, event):
            self._spawn(self._handle(room, event, self._order.take(room.room_id), file=self._command_file(event)))

    async def _download(self, event: FileEvent, filename: str, content: dict[str, Any]) -> Attachment:
        """The file's bytes (decrypted in an encrypted room); ValueError with one line when it cannot be."""
        size = json_object(content.get("info")).get("size")
        too_big = f"commands take files of at most {MAX_FILE_BYTES // 1024 // 1024} MB"
        if isinstance(size, int | float) and size > MAX_FILE_BYTES:
            raise ValueError(f"{shown(filename)} is {size / 1e6:.1f} MB; {too_big}")
        async with self._downloads:
            data = await self._fetch(str(event.url or ""), filename)
        if isinstance(event, ENCRYPTED_FILES):
            data = decrypt_attachment(data, event.key["k"], event.hashes["sha256"], event.iv)
        return Attachment(filename, data)

    async def _fetch(self, mxc: str, filename: str) -> bytes:
        """The content at ``mxc``, read as it streams in and given up past ``MAX_FILE_BYTES`` or
        ``DOWNLOAD_SECONDS``: the size an event claims is its sender's word, and nio's ``download`` reads
        the whole body, however big, without a time limit."""
        url = urlparse(mxc)
        media = url.path.strip("/")
        if url.scheme != "mxc" or not url.netloc or not media:
            raise ValueError(f"could not download {shown(filename)}: it has no mxc:// address")
        path = f"{MATRIX_MEDIA_API_PATH}/download/{quote(url.netloc, safe='')}/{quote(media, safe='')}"
        headers = {"Authorization": f"Bearer {self.client.access_token}"} | (self.client.config.custom_headers or {})
        over = f"{shown(filename)} is over {MAX_FILE_BYTES // 1024 // 1024} MB"
        try:
            response = await self.client.send("GET", path, headers=headers, timeout=DOWNLOAD_SECONDS)
            async with response:
                if response.status != 200:
                    raise ValueError(f"could not download {shown(filename)}: HTTP {response.status}")
                if (response.content_length or 0) > MAX_FILE_BYTES:
                    raise ValueError(over)
                data = bytearray()
                async for chunk in response.content.iter_chunked(64 * 1024):
                    data += chunk
                    if len(data) > MAX_FILE_BYTES:
                        raise ValueError(over)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ValueError(f"could not download {shown(filename)}: {type(exc).__name__}") from exc
        return bytes(data)

    async def _handle(self, room: MatrixRoom, event: Received, slot: Slot,
                      file: tuple[str, dict[str, Any]] | None = None, *, read_back: bool = False) -> None:
        """Handle a message once the one before it in the room was stored or handled (see
        ``adapters.matrix_order``); the next one goes ahead once this one is stored, or handled. One ``read_back``
        after a restart (``adapters.matrix_backlog``, which caps how many) is not counted against its author's rate
        limit: sent over hours, it all arrives now, and the newest were dropped as "too fast"."""
        try:
            await slot.wait()
            await self._handle_in_turn(room, event, slot, file, read_back)
        finally:
            slot.pass_on()

    async def _handle_in_turn(self, room: MatrixRoom, event: Received,
                              slot: Slot, file: tuple[str, dict[str, Any]] | None, read_back: bool) -> None:
        try:
            await self._load_creators(room.room_id)
            inbound = await self.inbound(room, event)
            if read_back:
                inbound = replace(inbound, counted=True)
            if isinstance(event, RoomMessageEmote):  # "/me waves": an action, as chats write one; never a command
                if not inbound.message.text.strip():
                    return
                inbound = _with_text(inbound, f"*{inbound.message.text.strip()}*")
            prefix, own, said = self.config.command_prefix, self.app.commands.prefix, inbound.message.text
            if prefix != own and said.startswith(prefix):
                # The room's prefix is configurable; the command layer speaks "!" (answers are shown with the room's).
                inbound = _with_text(inbound, own + said[len(prefix):])
            elif prefix != own and not inbound.message.is_dm and self.app.commands.is_command(said):
                return  # another bot's command: a prefix of its own is set so that the two never both answer
            if self.app.commands.is_command(inbound.message.text):  # (it stores nothing: a slow one, an import or
                slot.pass_on()  # a model checked, held the room's next messages up to the line's wait)
            # The file is fetched only for a command of this bot's that takes one, from someone who may run it
            # now; otherwise the caption goes on as a command without it (refused, slowed down, or ignored
            # when it is another bot's) as a typed one would.
            if (file is not None and isinstance(event, FILE_EVENTS)
                    and (claimed := await self.app.router.claim_files(inbound)) is not None):
                inbound = claimed
                try:
                    inbound = replace(inbound, attachments=(await self._download(event, *file),))
                except (ValueError, EncryptionError) as exc:
                    await MatrixSink(self, room, event).send_reply(CommandReply(str(exc)))
                    return
            if inbound.message.text.strip().lower() == self.app.commands.prefix + self.leave.name:
                await self._leave_command(inbound, room, MatrixSink(self, room, event))
                return
            await self.app.router.handle(inbound, MatrixSink(self, room, event), on_stored=slot.pass_on)
        except Exception:
            log.exception("Matrix: failed to handle event %s in %s", event.event_id, room.room_id)

    async def _leave_command(self, inbound: Inbound, room: MatrixRoom, sink: MatrixSink) -> None:
        """``!leave``: the bot leaves a room its admin asks it to; in a direct chat the user leaves it themselves."""
        # As every command: not from those the access lists leave out, and within the command limit.
        if not await self.app.router.admits(inbound, sink, is_command=True):
            return
        prefix = self.config.command_prefix
        if inbound.message.is_dm:
            await sink.send_reply(CommandReply(
                f"{prefix}{self.leave.name} is for rooms. To end our direct chat, leave it in your client (your "
                f"memory stays; {prefix}memory forget-me deletes it)."))
        elif inbound.is_admin:
            await self.client.room_leave(room.room_id)
        else:
            await sink.send_reply(CommandReply(
                f"{prefix}{self.leave.name} is for this room's admins (power level "
                f"{self.config.admin_power_level} or more): they can make me leave."))

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
                self._makers[room_id] = str(event.get("sender", ""))
                content = json_object(event.get("content"))
                extra = content.get("additional_creators")
                if isinstance(extra, list):
                    creators.update(c for c in extra if isinstance(c, str))
                if content.get("creator"):
                    creators.add(str(content["creator"]))
                if creators_outrank(content.get("room_version")):
                    self._creators_outrank.add(room_id)
        self._creators[room_id] = frozenset(c for c in creators if c)

    # -- sending ---------------------------------------------------------------------------------

    async def send(self, room_id: str, content: dict[str, Any], *, unencrypted_notice: bool = False) -> str:
        """Send a message. Without e2ee nio would send it unencrypted into an encrypted room: only the notice that
        the bot cannot read it goes there (``unencrypted_notice``), nothing else (an answer, a private file)."""
        if not self.config.e2ee and self.is_encrypted(room_id) and not unencrypted_notice:
            raise MatrixError(f"not sending into {room_id}: the room is encrypted and e2ee is off")
        response = await self.client.room_send(
            room_id, "m.room.message", content, ignore_unverified_devices=True
        )
        if not isinstance(response, RoomSendResponse):
            raise MatrixError(f"could not send to {room_id}: {response}")
        keep(self._sent, response.event_id, None)
        return str(response.event_id)

    def is_encrypted(self, room_id: str) -> bool:
        """Whether the room is encrypted (a room not synced yet is one the bot just opened: encrypted with e2ee)."""
        room = self.client.rooms.get(room_id)
        return bool(room.encrypted) if room is not None else self.config.e2ee

    async def deliver(self, room_id: str, reply: CommandReply, relation: dict[str, Any] | None = None) -> None:
        """A command's answer: its text (in pieces within an event's size) and its files."""
        encrypted = self.is_encrypted(room_id)
        text = self._with_room_prefix(reply.markdown())
        for piece in split_message(text, ENCRYPTED_LIMIT if encrypted else LIMIT) or [text]:
            new = render(piece, self.config.msgtype)
            if reply.escaped:  # (people's words as they wrote them: the escapes are for the HTML's Markdown)
                new["body"] = _unpinged(unescaped(piece))
            await self.send(room_id, fitting(message_forms(new, relation), encrypted))
        for attachment in reply.attachments:  # (in the thread the command came from, as its text is)
            await self._send_file(room_id, attachment, encrypted, relation)

    def _with_room_prefix(self, text: str) -> str:
        """A command's answer with the commands it names (``!memory resume``) written with the configured prefix."""
        prefix, own = self.config.command_prefix, self.app.commands.prefix
        if prefix == own:
            return text
        if self._named_commands is None:
            groups = sorted(self.app.commands.first_words(), key=len, reverse=True)
            self._named_commands = re.compile(rf"(?<![\w{re.escape(own)}]){re.escape(own)}(?=(?:"
                                              + "|".join(map(re.escape, groups)) + r")\b)")
        return self._named_commands.sub(lambda _: prefix, text)

    async def _send_file(self, room_id: str, attachment: Attachment, encrypted: bool,
                         relation: dict[str, Any] | None = None) -> None:
        """Upload a file and send it; in an encrypted room the file is encrypted too (its keys go in the event,
        which is encrypted)."""
        upload, keys = await self.client.upload(
            _bytes_reader(attachment.data), content_type="application/octet-stream",
            filename=attachment.filename, filesize=len(attachment.data), encrypt=encrypted,
        )
        if not isinstance(upload, UploadResponse):
            await self.send(room_id, render(f"(could not upload {attachment.filename}: {upload})", self.config.msgtype))
            return
        where = {"file": {"url": upload.content_uri, **keys}} if keys else {"url": upload.content_uri}
        await self.send(room_id, {"msgtype": "m.file", "body": attachment.filename, **where,
                                  "info": {"size": len(attachment.data)}, "m.mentions": {}}
                        | ({"m.relates_to": relation} if relation else {}))

    async def dm_room(self, user_id: str) -> str:
        """The room for private answers to ``user_id``: a direct room the bot opened for them or one they made
        (see ``_private_to``), unencrypted without e2ee; else a new one, with the user invited."""
        mine = self.client.rooms.get(self._dms.get(user_id, ""))
        mine = mine if mine is not None and self.serves(mine) else None  # (without e2ee: never an encrypted one)
        for room in ([mine] if mine else []) + [r for r in self.client.rooms.values() if r is not mine]:
            if self.serves(room) and await self._private_to(room, user_id):
                return str(room.room_id)
        if mine is not None and await self._invite_again(mine, user_id):
            return str(mine.room_id)
        return await self._open_dm(user_id)

    async def _invite_again(self, room: MatrixRoom, user_id: str) -> bool:
        """Whether ``user_id`` is invited again into the direct room the bot opened for them, which they left or
        whose invite they turned down: the bot is alone in it, nobody else invited. A new room for every
        private answer left a room behind, bot alone, each time such a user sent a memory command."""
        alone = set(room.users) == {self.config.user_id} and not room.invited_users
        if not alone or room.history_visibility == "world_readable":
            return False
        response = await self.client.room_invite(room.room_id, user_id)
        if not isinstance(response, RoomInviteResponse):
            log.warning("Matrix: could not invite %s into their direct room again (%s); opening another", user_id,
                        getattr(response, "message", response))
            return False
        if self.config.e2ee:  # nio shares a room's key with the members it knows: the invite, once a sync brings it
            await self._synced(lambda: user_id in room.users)  # (invited or, if the sync brought it too, joined)
        return True

    async def _private_to(self, room: MatrixRoom, user_id: str) -> bool:
        """Whether answers for ``user_id`` alone may go to ``room``: a room private to them (``_was_private_to``)
        that no upgrade replaced (clients hide the old room once its successor is joined)."""
        return not room.replacement_room and await self._was_private_to(room, user_id)

    async def _was_private_to(self, room: MatrixRoom, user_id: str) -> bool:
        """Whether ``room`` is private to ``user_id``, replaced by an upgrade or not. Anyone can make a room that
        looks direct (invite the bot "directly", then the victim, and leave), so: only the bot and the user are in
        it, nobody else is invited, its history is not world-readable, and the bot opened it for the user (who may
        not have joined yet), or the user joined it and made it (sent its create event) or invited the bot into
        it."""
        me = self.config.user_id
        if me not in room.users and self.is_dm(room):
            # Just after a start, a room's members may not be loaded yet (its summary's count is): load them
            # (nio adds them to the room), or a real direct room would be taken for a group.
            await self.client.joined_members(room.room_id)
        invited = set(room.invited_users)
        joined = set(room.users) - invited
        if not self.is_dm(room) or me not in joined or room.history_visibility == "world_readable":
            return False  # (world_readable: anyone may read it without joining)
        if self._dms.get(user_id) == room.room_id:
            return joined | invited == {me, user_id} and invited <= {user_id}
        if joined != {me, user_id} or invited or room.join_rule != "invite":
            return False
        if self._inviters.get(room.room_id) == user_id:
            return True
        # Made by the user: the sender of its create event. Room version 12 lets a maker name others as
        # "additional creators", which the user merely accepts by joining: those count as made by the maker.
        await self._load_creators(room.room_id)
        return self._makers.get(room.room_id) == user_id

    async def _open_dm(self, user_id: str) -> str:
        response = await self.client.room_create(
            is_direct=True, invite=[user_id],
            initial_state=[{"type": "m.room.encryption", "state_key": "",
                            "content": {"algorithm": "m.megolm.v1.aes-sha2"}}] if self.config.e2ee else [],
        )
        if not isinstance(response, RoomCreateResponse):
            raise MatrixError(f"could not open a direct room with {user_id}: {response}")
        room_id = str(response.room_id)
        self._dms[user_id] = room_id
        self._save_state(dm_rooms=self._dms)
        self._remember_kind(room_id, "dm")
        if self.config.e2ee:
            await self._synced(lambda: room_id in self.client.rooms)  # nio encrypts only for rooms it has synced
        return room_id

    async def _synced(self, done: Callable[[], bool], deadline: float = 30.0) -> None:
        """Wait (at most ``deadline`` seconds) until a sync has brought what ``done`` looks for."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(deadline):
                while not done():
                    await self._sync_seen.wait()


def _short(response: SyncError) -> str:
    """A failed sync in a few words: its error code and message (a proxy's HTML page cut short)."""
    status = getattr(getattr(response, "transport_response", None), "status", None)  # the HTTP answer's
    parts = (f"HTTP {status}" if status else "", response.status_code or "", response.message or "")
    return " ".join(" ".join(parts).split())[:200] or "no answer"


def said_in(event: Received) -> str:
    """A message's words: an upload's caption (a bare one's body is its file's name, which says nothing, "Cora.jpg"
    no mention of the bot and "!x.png" no command), none of a message without text (see ``TEXTLESS``)."""
    if isinstance(event, TEXTLESS):
        return ""
    return upload_caption(event) if isinstance(event, MEDIA_EVENTS) else event.body


def upload_caption(event: MediaEvent) -> str:
    """An upload's caption (MSC2530: a body that differs from the ``filename``); "" for a bare upload, whose
    body is its file's name."""
    filename = str(json_object(event.source.get("content")).get("filename") or "")
    return event.body.strip() if filename and event.body.strip() != filename else ""


def _with_text(inbound: Inbound, text: str) -> Inbound:
    return replace(inbound, message=replace(inbound.message, text=text))


def _bytes_reader(data: bytes) -> io.BytesIO:
    return io.BytesIO(data)
