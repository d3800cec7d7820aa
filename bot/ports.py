"""Ports of the core: the neutral message types adapters produce and consume, and the small
protocols through which the cortex (and later the memory store) plug into a reply.

Only these types cross the boundary between ``bot`` and ``adapters``/``cortex``. Nothing here knows
a platform or an SDK.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, Protocol

from bot.llm.base import ToolCall, ToolSpec
from bot.storage.base import StoredMessage
from bot.storage.sources import ReplySource
from bot.text import one_line_name, speaker_name

Platform = Literal["console", "discord", "matrix"]


@dataclass(frozen=True, slots=True)
class IncomingMessage:
    """A message an adapter has decided the bot should answer."""

    platform: str
    channel_id: str  # platform-local id of the channel, room, thread or DM
    author_id: str  # platform-local id of the human author
    author_name: str
    text: str
    is_dm: bool = False
    channel_name: str = ""
    server_id: str | None = None  # Discord guild / Matrix server; None in DMs
    mentions_bot: bool = False
    reply_to: str | None = None  # the message this one answers, as a sink names messages (discord-message:ID)
    sent_at: datetime | None = None
    parent_channel_id: str | None = None  # a thread's or forum post's channel: its persona is inherited
    author_home: str | None = None  # the author's home server where a platform has one (Matrix: their homeserver)
    message_key: str | None = None  # the platform message, as sinks name them (matrix-message:$id): see withdraw
    # The platform shows the author this channel's messages only from this time on (a Matrix room whose history
    # visibility is "joined" or "invited": since they joined it). What the bot keeps of earlier talk is not
    # theirs to be told: the reply's history and summary leave it out. None: they may see all of it.
    history_from: datetime | None = None
    # The author's unique user name where a display name is anyone's to take (Discord's nicknames): the prompt's
    # label for them then says it after a display name other than it (see bot.text.speaker_name).
    author_handle: str | None = None
    # The author's name as the platform gave it (set from author_name, which becomes the label of their turns;
    # kept by dataclasses.replace, so that a label is never labelled again).
    author_display: str = ""

    def __post_init__(self) -> None:  # names as prompts and stores may take them (see bot.text.one_line_name)
        given = self.author_display or self.author_name
        object.__setattr__(self, "author_display", given)
        object.__setattr__(self, "author_name", speaker_name(given, self.author_id, self.author_handle))
        object.__setattr__(self, "channel_name", one_line_name(self.channel_name))

    @property
    def display_name(self) -> str:
        """The author's name to store and to call them by (a memory file's "My memories of Alice"): the label
        of their turns without the id or user name it may add ("Alice (@alice:example.org)")."""
        return one_line_name(self.author_display) or self.author_name

    @property
    def author_key(self) -> str:
        return f"{self.platform}:{self.author_id}"

    @property
    def channel_key(self) -> str:
        return f"{self.platform}:{self.channel_id}"

    @property
    def parent_channel_key(self) -> str | None:
        return None if self.parent_channel_id is None else f"{self.platform}:{self.parent_channel_id}"

    @property
    def author_home_key(self) -> str | None:
        return None if self.author_home is None else f"{self.platform}:{self.author_home}"

    @property
    def server_key(self) -> str | None:
        return None if self.server_id is None else f"{self.platform}:{self.server_id}"


@dataclass(frozen=True, slots=True)
class PromptContext:
    """What a section provider may look at while a reply prompt is assembled."""

    persona: str
    language: str
    user_db_id: int
    user_key: str
    user_name: str
    channel_key: str
    is_dm: bool
    server_key: str | None
    message: str
    now: datetime
    in_prompt: frozenset[int] = frozenset()  # ids of the stored messages already in the prompt's history
    previous: str = ""  # the message before this one in the channel ("" when there is none)
    is_admin: bool = False  # the author is an admin where the message was sent (or a bot admin)
    is_bot_admin: bool = False  # the author is one of the bot's own admins
    message_key: str | None = None  # the platform message answered (what is remembered from it says so)
    parent_channel_key: str | None = None  # a thread's or forum post's channel (its switches apply here too)
    incognito: bool | None = None  # the author is incognito with the persona (None: not asked yet)


@dataclass(frozen=True, slots=True)
class PromptSection:
    title: str
    body: str
    sources: tuple[ReplySource, ...] = ()  # what went into it (ids only), for "why did you say that"
    # False: the body is what people said and stored (recalled messages, memory items), kept as written: a
    # "{user_name}" in it is one somebody typed, not a template variable to fill with the present user's name.
    template: bool = True


SectionSlot = Literal["rules", "guidelines", "cortex", "knowledge"]


class PromptSectionProvider(Protocol):
    """Adds sections to a reply prompt at one slot of the order in bot/prompt.py.

    Providers must be fast (they run on the reply path) and bound their own output by ``budget``
    tokens; they never raise for missing data (return an empty list instead).
    """

    slot: SectionSlot

    async def sections(self, context: PromptContext, budget: int) -> list[PromptSection]: ...


@dataclass(frozen=True, slots=True)
class Exchange:
    """One stored user message and the stored reply to it."""

    channel_db_id: int
    user_db_id: int
    user_key: str
    persona: str
    is_dm: bool
    server_key: str | None
    user_message: StoredMessage
    reply: StoredMessage
    extra: dict[str, object] = field(default_factory=dict)
    incognito: bool | None = None  # as the reply path found it when the message arrived (None: not asked)


class ReplyPreparer(Protocol):
    """Told the moment a message to answer arrives, before it is stored: may start work its reply will
    need (the memory search's query embedding). Must return at once and never raise.

    ``text`` is the message as it will be stored; ``previous`` the core's guess of the text its prompt's
    history window will end with (the start, at most 1,000 characters, of the last message this process
    stored in the channel), "" if none.
    """

    def prepare(self, message: IncomingMessage, persona: str, text: str, previous: str) -> None: ...


class ExchangeObserver(Protocol):
    """Told after every stored exchange. Must only record or enqueue work, never wait on it."""

    async def on_exchange(self, exchange: Exchange) -> None: ...


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """A tool's answer to the model: data, never instructions; ``is_error`` when the call failed."""

    content: str
    is_error: bool = False


class Toolbox(Protocol):
    """The tools offered for one reply (already filtered by permission, place and trigger)."""

    @property
    def specs(self) -> tuple[ToolSpec, ...]: ...

    @property
    def max_rounds(self) -> int: ...

    @property
    def token_cap(self) -> int: ...

    def status(self, call: ToolCall) -> str:
        """A short line the platform shows while ``call`` runs ("looking that up…")."""

    async def execute(self, call: ToolCall) -> ToolOutcome:
        """Run one call; never raises (a failure is an outcome with ``is_error``)."""


class ToolProvider(Protocol):
    async def toolbox(self, context: PromptContext) -> Toolbox | None:
        """The tools for this reply, or None when none are offered here."""


@dataclass(frozen=True, slots=True)
class ServerRef:
    """A Discord server or a Matrix room someone administers, as the web page lists it."""

    key: str  # discord:<guild id> or matrix:<room id>, as IncomingMessage.server_key
    name: str


class LookupsSpent(Exception):
    """An admin directory may not ask its platform about one more server now (a limit per minute): the answer is
    neither yes nor no, and ``wait`` seconds later it may be asked."""

    def __init__(self, wait: float) -> None:
        super().__init__(f"try again in {wait:.0f} s")
        self.wait = wait


class AdminDirectory(Protocol):
    """A platform's live answer to "is this user an admin there?" (the web page asks on every request,
    as the chat commands check the platform's permissions on every use)."""

    platform: str

    async def is_admin(self, user_key: str, server_key: str) -> bool:
        """Raises :class:`LookupsSpent` when the platform may not be asked now."""

    async def servers(self, user_key: str) -> list[ServerRef]:
        """Servers or rooms the bot shares with the user where the user is an admin."""
