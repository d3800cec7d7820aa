"""The memory tools a persona gets in its cortex update: ``remember``, ``search_memory``,
``update_memory`` and ``forget``.

Like the file tools, every call gets a tool result and never an exception: missing or mistyped
arguments, an unknown category, an importance outside 1-10, an item of another pair (it simply does
not exist for this one) or an item already corrected each get an error the model can act on. Nothing
is overwritten: ``update_memory`` writes a new item that supersedes the old one, ``forget`` archives.
An update may write at most ``max_writes`` items and forget at most ``max_forgets``, so a confused (or
misled) model cannot flood the store or empty it; a job retried after an outage keeps one limit over
all its attempts (:meth:`MemoryTools.count_earlier`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bot.llm.base import ToolCall, ToolSpec
from bot.text import quoted
from cortex.memory.store import CATEGORIES, AlreadyRemembered, MemoryError, MemoryItem, MemoryStore

DAY = 86_400.0

_CATEGORY = {"type": "string", "enum": list(CATEGORIES), "description": "What kind of memory this is."}
_EXPIRES: dict[str, Any] = {"type": "number", "exclusiveMinimum": 0,
                            "description": "For facts that stop being true (an exam on Friday)."}
_IMPORTANCE = {"type": "integer", "minimum": 1, "maximum": 10,
               "description": "1 = trivia, 5 = useful, 10 = must never be forgotten."}

MEMORY_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        name="remember",
        description=(
            "Store one discrete fact about the user or your shared history in your long-term memory, where you "
            "can find it again in later conversations. One fact per call, self-contained (names, dates), in your "
            "own words. Search first so you do not store the same fact twice."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "content": {"type": "string", "description": "The fact, self-contained."},
                "category": _CATEGORY,
                "importance": _IMPORTANCE,
                "key": {"type": "string", "description": "A short label, e.g. 'sister's name'."},
                "tags": {"type": "array", "items": {"type": "string"}},
                "expires_in_days": _EXPIRES,
            },
            "required": ["content", "category"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        name="search_memory",
        description="Search your long-term memory of this user. Returns matching items with their ids.",
        input_schema={
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 20},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        name="update_memory",
        description=(
            "Correct a memory item that is no longer right: stores the new content as a new item that replaces "
            "the old one (the old one is kept in the history). Pinned items are the user's: not these."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "id": {"type": "integer", "description": "The item to correct (from search_memory)."},
                "content": {"type": "string", "description": "The corrected fact, self-contained."},
                "category": _CATEGORY,
                "importance": _IMPORTANCE,
                "expires_in_days": {**_EXPIRES, "description": "From now; left out, the old item's expiry stays."},
            },
            "required": ["id", "content"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        name="forget",
        description="Archive a memory item that is wrong or no longer matters (the user can restore it).",
        input_schema={
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "reason": {"type": "string", "description": "Why it should be forgotten."},
            },
            "required": ["id", "reason"],
            "additionalProperties": False,
        },
    ),
)
MEMORY_TOOL_NAMES = frozenset(spec.name for spec in MEMORY_TOOLS)


@dataclass(frozen=True, slots=True)
class MemoryToolResult:
    content: str
    is_error: bool = False


log = logging.getLogger(__name__)
MAX_EXPIRY_DAYS = 36_500  # a hundred years: beyond that, a fact does not expire
MAX_TAG_CHARS = 50


class BadArguments(ValueError):
    pass


def _int(args: dict[str, Any], name: str, *, required: bool, low: int, high: int) -> int | None:
    value = args.get(name)
    if value is None:
        if required:
            raise BadArguments(f"'{name}' is required: a whole number")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BadArguments(f"'{name}' must be a whole number, got {type(value).__name__}")
    try:
        number = int(value) if not isinstance(value, float) or value.is_integer() else None
    except ValueError:
        number = None
    if number is None:
        raise BadArguments(f"'{name}' must be a whole number, got {quoted(value)}")
    if not low <= number <= high:
        raise BadArguments(f"'{name}' must be from {low} to {high}, got {number}")
    return number


def _days(args: dict[str, Any]) -> float | None:
    """``expires_in_days``: None when left out."""
    days = args.get("expires_in_days")
    if days is not None and (isinstance(days, bool) or not isinstance(days, (int, float))
                             or not math.isfinite(days) or not 0 < days <= MAX_EXPIRY_DAYS):
        raise BadArguments(
            f"'expires_in_days' must be a number of days above 0 and at most {MAX_EXPIRY_DAYS:,}; got {quoted(days)} "
            "(leave it out for a fact that does not expire)")
    return None if days is None else float(days)


def _text(args: dict[str, Any], name: str, *, required: bool) -> str:
    value = args.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise BadArguments(f"'{name}' must be a non-empty string")
    return value.strip()


def _category(args: dict[str, Any], default: str | None) -> str:
    value = args.get("category", default)
    if value not in CATEGORIES:
        raise BadArguments(f"'category' must be one of {', '.join(CATEGORIES)}; got {quoted(value)}")
    return str(value)


def _line(item: MemoryItem) -> str:
    return f"#{item.id} [{item.category}, importance {item.importance}, {item.created_at:%Y-%m-%d}] {item.content}"


def run_ref(run_id: int) -> str:
    """The ``source_ref`` of the items an update run stores."""
    return f"cortex update run {run_id}"


def forget_prefix(run_id: int) -> str:
    """How the archive reason of an item an update run forgets begins (the model's reason follows)."""
    return f"forgotten by the persona in update run {run_id}: "


@dataclass
class MemoryTools:
    memory: MemoryStore
    pair_id: int
    run_id: int
    max_writes: int = 20
    max_forgets: int = 5  # archiving is undone only by the user, one item at a time (!memory restore)
    written: list[int] = field(default_factory=list)
    forgotten: list[int] = field(default_factory=list)
    earlier_writes: int = 0  # by the earlier attempts of the same job (a retry after a 429 keeps its limits)
    earlier_forgets: int = 0

    async def count_earlier(self, run_ids: Sequence[int]) -> None:
        """Count what the runs ``run_ids`` (the job's earlier attempts) stored and forgot against this
        run's limits: a job retried after an outage may not store ``max_writes`` items once per attempt."""
        self.earlier_writes, self.earlier_forgets = await self.memory.repo.count_changes(
            self.pair_id, [run_ref(r) for r in run_ids], [forget_prefix(r) for r in run_ids])

    async def execute(self, call: ToolCall) -> MemoryToolResult:
        if call.arguments is None:
            return MemoryToolResult(
                f"{call.name} needs a JSON object as input; got: {call.raw_arguments[:200]!r}", True
            )
        try:
            if call.name == "search_memory":
                return await self._search(call.arguments)
            stored, forgot = len(self.written) + self.earlier_writes, len(self.forgotten) + self.earlier_forgets
            if call.name in ("remember", "update_memory") and stored >= self.max_writes:
                return MemoryToolResult(
                    f"you already stored {self.max_writes} items in this update{self._attempts(self.earlier_writes)};"
                    " that is the limit per update", True
                )
            if call.name == "remember":
                return await self._remember(call.arguments)
            if call.name == "update_memory":
                return await self._update(call.arguments)
            if call.name == "forget" and forgot >= self.max_forgets:
                return MemoryToolResult(
                    f"you already forgot {self.max_forgets} items in this update{self._attempts(self.earlier_forgets)};"
                    " that is the limit per update", True
                )
            if call.name == "forget":
                return await self._forget(call.arguments)
        except (BadArguments, MemoryError) as exc:
            return MemoryToolResult(f"{call.name}: {exc}", True)
        except Exception:  # one bad call must not end the whole update
            log.exception("memory tool %s failed unexpectedly (run %d)", call.name, self.run_id)
            return MemoryToolResult(f"{call.name} failed because of an internal error; nothing was stored by this "
                                    "call. Go on without it.", True)
        return MemoryToolResult(f"unknown memory tool {quoted(call.name)}", True)

    @staticmethod
    def _attempts(earlier: int) -> str:
        return f" ({earlier} of them in its earlier attempts)" if earlier else ""

    @property
    def _source_ref(self) -> str:
        return run_ref(self.run_id)

    async def _search(self, args: dict[str, Any]) -> MemoryToolResult:
        query = _text(args, "query", required=True)
        limit = _int(args, "limit", required=False, low=1, high=20) or 10
        hits = await self.memory.search(self.pair_id, query, limit=limit, include_messages=False, patient=True)
        items = [h.item for h in hits if h.item is not None]
        if not items:
            return MemoryToolResult("no memory items match")
        return MemoryToolResult("\n".join(_line(i) for i in items))

    async def _remember(self, args: dict[str, Any]) -> MemoryToolResult:
        content = _text(args, "content", required=True)
        category = _category(args, None)
        importance = _int(args, "importance", required=False, low=1, high=10) or 5
        days = _days(args)
        tags = args.get("tags", [])
        if not isinstance(tags, list) or not all(isinstance(t, str) and len(t) <= MAX_TAG_CHARS for t in tags):
            raise BadArguments(f"'tags' must be a list of short strings (at most {MAX_TAG_CHARS} characters each)")
        try:
            item = await self.memory.remember(
                self.pair_id, content, category=category, key=_text(args, "key", required=False),
                importance=importance, tags=tags[:10], expires_at=self.memory.clock() + days * DAY if days else None,
                source="model", source_ref=self._source_ref, once=True,
            )
        except AlreadyRemembered as same:  # (a second item of the same words would only crowd the prompt)
            return MemoryToolResult(f"#{same.item.id} says that already: nothing new was stored")
        self.written.append(item.id)
        return MemoryToolResult(f"remembered as #{item.id}")

    async def _update(self, args: dict[str, Any]) -> MemoryToolResult:
        item_id = _int(args, "id", required=True, low=1, high=2**62)
        assert item_id is not None
        days = _days(args)  # (a correction of "the exam is on Friday" still expires: the old item's time, or anew)
        old = await self.memory.get(self.pair_id, item_id, count_access=False)
        if old.archived_at is not None:
            raise MemoryError(f"item #{item_id} is archived; use remember for a new fact")
        if old.pinned:  # a correction would replace it (and its pin) as surely as forget would drop it
            raise MemoryError(f"item #{item_id} is pinned by the user; only they can change, unpin or forget it. "
                              "Use remember for what is new beside it")
        content = _text(args, "content", required=True)
        expires = self.memory.clock() + days * DAY if days else (
            old.expires_at.timestamp() if old.expires_at is not None and old.visible else None)
        item = await self.memory.remember(
            self.pair_id, content, category=_category(args, old.category),
            importance=_int(args, "importance", required=False, low=1, high=10) or old.importance,
            key=old.key, tags=old.tags, source="model", source_ref=self._source_ref, expires_at=expires,
            # Private, as every item the update writes: it reads the pair's DMs (and files made from them), so a
            # correction of a shared item may carry what was said there into group channels' prompts.
            supersedes=old.id, scope="private",
        )
        self.written.append(item.id)
        return MemoryToolResult(f"saved #{item.id}, replacing #{old.id}")

    async def _forget(self, args: dict[str, Any]) -> MemoryToolResult:
        item_id = _int(args, "id", required=True, low=1, high=2**62)
        assert item_id is not None
        reason = _text(args, "reason", required=True)
        item = await self.memory.get(self.pair_id, item_id, count_access=False)
        if item.pinned:
            raise MemoryError(f"item #{item_id} is pinned by the user; only they can unpin or forget it")
        await self.memory.archive(self.pair_id, item_id, f"{forget_prefix(self.run_id)}{reason}"[:300])
        self.forgotten.append(item_id)
        return MemoryToolResult(f"archived #{item_id}")
