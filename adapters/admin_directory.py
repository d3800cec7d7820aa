"""Live answers to "is this user an admin of that server?" for the web page (:class:`bot.ports.AdminDirectory`),
by the same rules as the chat adapters use for commands.

* Discord: Manage Server or Administrator in the guild (``adapters.discord._is_admin``), or a configured
  admin id. Server keys are ``discord:<guild id>``.
* Matrix: a group room is the "server" (key ``matrix:<room id>``); a user administers it when their power
  level there is at least ``admin_power_level`` (room creators count as 100), or is a configured admin id.
  Direct rooms administer nothing (everyone has power 100 in their own).
* Discord with shards split over processes (``shard_ids``): a guild of another process's shards is asked
  from Discord (the guild, then the member), so its admins are admins on any process's web page; the list
  of a user's servers holds this process's guilds only.
* Discord in more than ``FETCH_GUILDS`` servers lists a user's servers from its member cache only
  (asking Discord about every one would take too long); ``is_admin`` asks Discord when the member is not
  in the cache, or always when the bot lacks the members intent (its cache is then not kept current), and
  keeps that answer (yes or no) for ``ANSWER_SECONDS`` per server and user.

Nothing here raises for a malformed or foreign key: the answer is simply no. ``cortexbot run`` builds
them with :func:`discord_directory` and :func:`matrix_directory` from its running adapters.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from bot.config import DiscordConfig, MatrixConfig
from bot.ports import LookupsSpent, ServerRef
from bot.ratelimit import RateLimiter

if TYPE_CHECKING:
    from adapters.discord import DiscordAdapter
    from adapters.matrix import MatrixAdapter

log = logging.getLogger(__name__)

DISCORD = "discord"
MATRIX = "matrix"
FETCH_GUILDS = 25  # listing a user's servers asks Discord about uncached members in at most this many
FETCH_CONCURRENCY = 5
LIST_SECONDS = 60.0  # a user's server list is kept this long (a page load asks for it)
# is_admin answers from the member cache at once; an answer that needed a REST call (a member Discord did not
# send, or a non-member) is kept this long per (server, user), so a page's requests, or anyone's requests
# naming a server they are not in, cannot spend the bot's rate limit. Rights are asked again after it.
ANSWER_SECONDS = 30.0
MAX_ANSWERS = 10_000
# Guilds of other processes' shards asked from Discord for one user (answers kept don't count), and for all:
# each request naming a guild id not asked before cost one REST call, and any logged-in user could name a new
# made-up id on every request, spending the bot token's rate limit that every shard sends its messages with.
GUILD_LOOKUPS_PER_USER = 10
GUILD_LOOKUPS_IN_ALL = 300


# The server keys the bot itself reads (IncomingMessage.server_key): a guild id as Discord writes it, a Matrix
# room id (``!`` and printable ASCII; room version 12 ids carry no server name). Nothing else is a server.
DISCORD_SERVER_KEY = re.compile(r"discord:[1-9][0-9]{0,19}")
MATRIX_SERVER_KEY = re.compile(r"matrix:![!-.0-~]{1,254}")  # printable ASCII without "/"


def is_server_key(key: str) -> bool:
    """Whether ``key`` is a server key the bot can meet in a chat: ``discord:<guild id>`` (canonical digits,
    no leading zero, not fullwidth) or ``matrix:!<room id>``. Settings or guidelines stored under any other
    key would never be read."""
    return bool(DISCORD_SERVER_KEY.fullmatch(key) or MATRIX_SERVER_KEY.fullmatch(key))


def _id_of(key: str, platform: str) -> str:
    """The id part of ``platform:id`` ("" for another platform's key)."""
    prefix, _, rest = key.partition(":")
    return rest if prefix == platform else ""


def _snowflake(text: str) -> int | None:
    """A Discord id written as Discord writes it: ``discord:01`` is not guild 1 (its guidelines and settings
    would be stored under a key the bot never reads)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 20) or str(int(text)) != text:
        return None
    return int(text)


class DiscordAdminDirectory:
    """Over a connected ``discord.Client``: members from the cache, else fetched from Discord."""

    platform = DISCORD

    def __init__(self, client: Any, config: DiscordConfig, *, answer_seconds: float = ANSWER_SECONDS,
                 guild_lookups: tuple[int, int] = (GUILD_LOOKUPS_PER_USER, GUILD_LOOKUPS_IN_ALL)) -> None:
        self.client = client  # discord.Client (or AutoShardedClient)
        self.config = config
        self.answer_seconds = answer_seconds
        self._lookups_each, self._lookups_all = (RateLimiter(n) for n in guild_lookups)  # per minute
        self._listed: dict[int, tuple[float, list[ServerRef]]] = {}
        self._unanswered = 0  # lookups Discord failed to answer (a list made meanwhile is not kept)
        # (guild id, user id) -> (when asked, the REST lookup's answer); concurrent askers share one lookup
        self._answers: dict[tuple[int, int], tuple[float, asyncio.Future[bool]]] = {}
        # guild id -> (when asked, the guild as Discord answers): guilds of other processes' shards
        self._guilds: dict[int, tuple[float, asyncio.Future[Any]]] = {}

    @property
    def _cache_is_current(self) -> bool:
        """Whether cached members are kept up to date: only with the (privileged) members intent does Discord
        send member updates. Without it discord.py still caches whoever is in a voice channel, with the roles
        they had when they joined it: a moderator demoted meanwhile would stay one here."""
        return bool(getattr(getattr(self.client, "intents", None), "members", True))

    async def _guild_admin(self, guild: Any, user_id: int, *, fetch: bool = True) -> bool:
        """From the member cache (when it is kept current, or when nothing may be fetched: a listing); else (when
        ``fetch``) as Discord answers, kept for ``answer_seconds``."""
        member = guild.get_member(user_id) if self._cache_is_current or not fetch else None
        if member is not None:
            return self._admin(member)
        return fetch and await self._fetched_admin(guild, user_id)

    async def _fetch(self, guild: Any, user_id: int) -> tuple[Any, bool]:
        """The member as Discord answers (None when not a member) and whether that answer is definite
        (False after an error: it is not kept)."""
        import discord

        try:
            return await guild.fetch_member(user_id), True
        except (discord.NotFound, discord.Forbidden):
            return None, True
        except (discord.HTTPException, OSError, TimeoutError) as exc:  # (discord.py lets a reset connection through)
            log.warning("Discord: could not look up member %s of guild %s: %s", user_id, guild.id,
                        str(exc) or type(exc).__name__)
            return None, False

    def _admin(self, member: Any) -> bool:
        from adapters.discord import _is_admin

        return member is not None and _is_admin(member, self.config)

    async def is_admin(self, user_key: str, server_key: str) -> bool:
        user_id = _snowflake(_id_of(user_key, DISCORD))
        guild_id = _snowflake(_id_of(server_key, DISCORD))
        if user_id is None or guild_id is None:
            return False
        guild = self.client.get_guild(guild_id)
        if guild is None and self._on_other_shards(guild_id):
            self._may_look_up(user_key, guild_id)
            guild = await self._fetched_guild(guild_id)
        if guild is None:  # the bot is not in it (or not connected): nobody administers it through the bot
            return False
        return user_id in self.config.admin_ids or await self._guild_admin(guild, user_id)

    def _on_other_shards(self, guild_id: int) -> bool:
        """Whether the guild belongs to a shard this process does not run (a fleet splits the shards: the web
        page's process knows only its own shards' guilds, and asks Discord about the others)."""
        shard_ids, count = getattr(self.client, "shard_ids", None), getattr(self.client, "shard_count", None)
        if not shard_ids or not count:
            return False
        return (guild_id >> 22) % int(count) not in shard_ids

    def _may_look_up(self, user_key: str, guild_id: int) -> None:
        """Nothing when the guild's answer is kept, or ``user_key`` (and everyone together) may have one more
        asked from Discord this minute; else :class:`LookupsSpent`."""
        kept = self._guilds.get(guild_id)
        if kept is not None and time.monotonic() - kept[0] < self.answer_seconds:
            return
        wait = max(self._lookups_each.waiting(user_key), self._lookups_all.waiting(""))
        if wait:
            if self._lookups_each.tell(user_key, wait):
                log.warning("Discord: not asking about more servers of other shards for %s this minute (at most "
                            "%d a user, %d in all)", user_key, self._lookups_each.per_minute,
                            self._lookups_all.per_minute)
            raise LookupsSpent(wait)
        self._lookups_each.check(user_key)
        self._lookups_all.check("")

    async def _fetched_guild(self, guild_id: int) -> Any:
        """The guild as Discord answers (None: the bot is not in it), asked at most once per ``answer_seconds``."""
        now = time.monotonic()
        kept = self._guilds.get(guild_id)
        if kept is None or now - kept[0] >= self.answer_seconds:
            if len(self._guilds) >= MAX_ANSWERS:
                self._guilds.clear()
            kept = (now, asyncio.ensure_future(self._ask_guild(guild_id)))
            self._guilds[guild_id] = kept
        return await asyncio.shield(kept[1])

    async def _ask_guild(self, guild_id: int) -> Any:
        import discord

        try:
            return await self.client.fetch_guild(guild_id, with_counts=False)
        except (discord.NotFound, discord.Forbidden):
            return None
        except (discord.HTTPException, OSError, TimeoutError) as exc:
            log.warning("Discord: could not look up guild %s: %s", guild_id, str(exc) or type(exc).__name__)
            self._guilds.pop(guild_id, None)  # not kept: the next request asks again
            return None

    async def _fetched_admin(self, guild: Any, user_id: int) -> bool:
        """Whether a member missing from the cache administers ``guild``: asked from Discord at most once per
        ``answer_seconds`` for each (server, user), concurrent askers waiting for the same lookup."""
        key, now = (int(guild.id), user_id), time.monotonic()
        kept = self._answers.get(key)
        if kept is None or now - kept[0] >= self.answer_seconds:
            self._forget_old_answers(now)
            kept = (now, asyncio.ensure_future(self._ask(guild, user_id)))
            self._answers[key] = kept
        # shielded: a request that goes away (its client disconnected) does not cancel the others' lookup
        return await asyncio.shield(kept[1])

    async def _ask(self, guild: Any, user_id: int) -> bool:
        definite = False
        try:
            member, definite = await self._fetch(guild, user_id)
            return self._admin(member)
        finally:
            if not definite:  # Discord failed to answer: the next request asks again
                self._answers.pop((int(guild.id), user_id), None)
                self._unanswered += 1

    def _forget_old_answers(self, now: float) -> None:
        if len(self._answers) < MAX_ANSWERS:
            return
        for key, (asked, _) in list(self._answers.items()):
            if now - asked >= self.answer_seconds:
                del self._answers[key]
        if len(self._answers) >= MAX_ANSWERS:  # all fresh: a flood of distinct lookups; start over
            self._answers.clear()

    async def servers(self, user_key: str) -> list[ServerRef]:
        user_id = _snowflake(_id_of(user_key, DISCORD))
        if user_id is None:
            return []
        cached = self._listed.get(user_id)
        if cached is not None and time.monotonic() - cached[0] < LIST_SECONDS:
            return list(cached[1])
        unanswered = self._unanswered
        found = await self._list(user_id)
        if self._unanswered != unanswered:  # a lookup failed (the network): this list is not kept
            return list(found)
        if len(self._listed) > 1000:
            self._listed.clear()
        self._listed[user_id] = (time.monotonic(), found)
        return list(found)

    async def _list(self, user_id: int) -> list[ServerRef]:
        guilds = list(self.client.guilds)
        if user_id in self.config.admin_ids:  # an admin everywhere, as in chat
            return [ServerRef(f"{DISCORD}:{g.id}", str(g.name)) for g in guilds]
        fetch = len(guilds) <= FETCH_GUILDS  # a bot in many servers answers from its member cache only
        limit = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def check(guild: Any) -> ServerRef | None:
            async with limit:
                admin = await self._guild_admin(guild, user_id, fetch=fetch)
            return ServerRef(f"{DISCORD}:{guild.id}", str(guild.name)) if admin else None

        found = await asyncio.gather(*(check(g) for g in guilds))
        return [ref for ref in found if ref is not None]


def _listed_level(room: Any, user_id: str) -> int:
    """The user's power level as the room's power levels list it."""
    return int(room.power_levels.get_user_level(user_id))


class MatrixAdminDirectory:
    """Over a logged-in ``nio.AsyncClient``: the power levels of the rooms it has synced."""

    platform = MATRIX

    def __init__(self, client: Any, config: MatrixConfig,
                 level: Callable[[Any, str], int] | None = None,
                 is_dm: Callable[[Any], bool] | None = None) -> None:
        self.client = client  # nio.AsyncClient
        self.config = config
        # A user's power level in a room: the adapter's rule (room version 12 creators outrank everyone).
        self._level: Callable[[Any, str], int] = level or _listed_level
        self.is_dm: Callable[[Any], bool] = is_dm or (lambda room: room.member_count <= 2)  # the adapter's rule

    def _group_rooms(self) -> Iterable[Any]:
        return (room for room in dict(self.client.rooms).values() if not self.is_dm(room))

    def _room_admin(self, room: Any, user_id: str) -> bool:
        return user_id in room.users and self._level(room, user_id) >= self.config.admin_power_level

    async def is_admin(self, user_key: str, server_key: str) -> bool:
        """Admin of a group room the bot is in (the room is Matrix's "server": its guidelines and settings),
        by the room's power levels; the configured admin ids everywhere."""
        user_id, room_id = _id_of(user_key, MATRIX), _id_of(server_key, MATRIX)
        if not user_id.startswith("@") or not room_id.startswith("!"):
            return False
        room = dict(self.client.rooms).get(room_id)
        if room is None or self.is_dm(room):
            return False
        return user_id in self.config.admin_ids or self._room_admin(room, user_id)

    async def servers(self, user_key: str) -> list[ServerRef]:
        user_id = _id_of(user_key, MATRIX)
        if not user_id.startswith("@"):
            return []
        every = user_id in self.config.admin_ids
        return [ServerRef(f"{MATRIX}:{room.room_id}", room.display_name or room.room_id)
                for room in self._group_rooms() if every or self._room_admin(room, user_id)]


def discord_directory(adapter: DiscordAdapter) -> DiscordAdminDirectory:
    """The directory of a Discord adapter (its client, whose cache fills once it connects)."""
    return DiscordAdminDirectory(adapter.bot, adapter.config)


def matrix_directory(adapter: MatrixAdapter) -> MatrixAdminDirectory:
    """The directory of a Matrix adapter (its client's synced rooms, power levels by the adapter's rule)."""
    return MatrixAdminDirectory(adapter.client, adapter.config, adapter.power_level, adapter.is_dm)
