"""The caller's memory items over all their personas: list, filter and search, correct, pin, change scope,
forget and restore; the export zip and forget-me. An item id is looked up among the caller's own pairs
only: someone else's item and a missing one answer the same 404."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from adapters.web.auth import Caller
from adapters.web.errors import fail, not_found
from adapters.web.server import WebContext, ok, read_body
from adapters.web.userdata import own_user, persona_name
from bot.commands import MAX_NUMBER
from bot.storage.base import User
from cortex.export import ExportBusy, export_filename
from cortex.memory.store import (
    CATEGORIES,
    SCOPES,
    ItemFilters,
    MemoryConflict,
    MemoryError,
    MemoryItem,
    OwnedItem,
    Scope,
    stored_text,
)

PAGE = 25
SEARCH_LIMIT = 200  # hits per persona a search ranks; pages are cut from these
MAX_QUERY_CHARS = 500
FORGOTTEN = "forgotten by the user"
CONFIRM = "forget me"
ITEM_ROUTE = "/api/me/items/{id}"


class ItemChange(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    content: str | None = None
    pinned: bool | None = None
    scope: Literal["private", "shared"] | None = None


class ForgetMe(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    confirm: str = ""


@dataclass(frozen=True, slots=True)
class Listing:
    """What ``GET /api/me/items`` asks for."""

    filters: ItemFilters
    query: str
    page: int


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def item_json(owned: OwnedItem, score: float | None = None, *, scored: bool = False) -> dict[str, Any]:
    item = owned.item
    data: dict[str, Any] = {
        "id": item.id, "persona": owned.persona, "category": item.category, "content": item.content,
        "importance": item.importance, "pinned": item.pinned, "scope": item.scope, "source": item.source,
        "source_ref": item.source_ref, "created_at": iso(item.created_at), "updated_at": iso(item.updated_at),
        "archived_at": iso(item.archived_at), "archive_reason": item.archive_reason, "supersedes": item.supersedes,
        "superseded_by": item.superseded_by, "expires_at": iso(item.expires_at), "tags": item.tags,
    }
    if scored:
        data["score"] = None if score is None else round(score, 4)
    return data


def flag(query: Mapping[str, str], name: str) -> bool | None:
    value = query.get(name)
    if value is None or value == "":
        return None
    if value not in ("true", "false"):
        fail(400, f"{name} is true or false, not {value[:20]!r}")
    return value == "true"


def choice(query: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str | None:
    value = query.get(name) or None
    if value is not None and value not in allowed:
        fail(400, f"unknown {name} {value[:40]!r}; it is one of: {', '.join(allowed)}")
    return value


def number(text: str, what: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 10 or not 1 <= int(text) <= MAX_NUMBER:
        fail(400, f"{what} is a number from 1 up, not {text[:20]!r}")
    return int(text)


def listing(ctx: WebContext, query: Mapping[str, str]) -> Listing:
    """The list's parameters, each checked (a 400 naming the bad one)."""
    text = query.get("query", "").strip()
    if len(text) > MAX_QUERY_CHARS:
        fail(400, f"the search text is too long (at most {MAX_QUERY_CHARS} characters)")
    persona = query.get("persona") or None
    filters = ItemFilters(
        active=not flag(query, "archived"), persona=None if persona is None else persona_name(ctx, persona),
        category=choice(query, "category", CATEGORIES), pinned=flag(query, "pinned"),
        scope=choice(query, "scope", SCOPES))
    return Listing(filters, text, number(query.get("page", "1"), "page"))


def matches(item: MemoryItem, filters: ItemFilters) -> bool:
    return ((filters.category is None or item.category == filters.category)
            and (filters.pinned is None or item.pinned == filters.pinned))


def page_json(items: list[dict[str, Any]], total: int, page: int) -> dict[str, Any]:
    return {"items": items, "total": total, "page": page, "pages": max(1, -(-total // PAGE))}


def routes(ctx: WebContext) -> list[web.RouteDef]:
    auth, memory = ctx.auth, ctx.app.cortex.memory

    async def search(user: User, wanted: Listing) -> list[tuple[OwnedItem, float]]:
        """The store's hybrid search over the items of each of the user's pairs, best first."""
        filters = wanted.filters
        scopes = SCOPES if filters.scope is None else (filters.scope,)
        vector = await memory.query_vector(wanted.query)  # (once for every persona's search)
        found: list[tuple[OwnedItem, float]] = []
        for pair in await ctx.app.storage.export.pairs(user.id):
            persona = str(pair["persona"])
            if filters.persona is not None and persona != filters.persona:
                continue
            hits = await memory.search(int(pair["id"]), wanted.query, include_messages=False, limit=SEARCH_LIMIT,
                                       scopes=scopes, query_vector=vector, use_vectors=vector is not None,
                                       patient=True)  # (someone's own search: "The Who" by its words too)
            found += [(OwnedItem(persona, h.item), h.score) for h in hits
                      if h.item is not None and matches(h.item, filters)]
        return sorted(found, key=lambda f: f[1], reverse=True)

    async def list_items(request: web.Request) -> web.Response:
        caller = await auth.require(request)  # (first: who is not logged in learns nothing, not even personas)
        wanted = listing(ctx, request.query)
        if wanted.query:  # a search (the query embedded, and ranked per persona) counts as a view; a listing not
            auth.count_view(caller)
        user = await own_user(ctx, caller)
        start = (wanted.page - 1) * PAGE
        if wanted.query and wanted.filters.active:
            found = await search(user, wanted)
            shown = [item_json(o, score, scored=True) for o, score in found[start:start + PAGE]]
            return ok(page_json(shown, len(found), wanted.page))
        # Search covers active items only; among the others a query keeps those holding every word.
        filters = wanted.filters
        if wanted.query:
            filters = replace(filters, words=tuple(wanted.query.split()[:20]))
        items, total = await memory.user_items(user.id, filters, limit=PAGE, offset=start)
        return ok(page_json([item_json(o, scored=bool(wanted.query)) for o in items], total, wanted.page))

    async def owned(caller: Caller, request: web.Request) -> OwnedItem:
        item_id = number(request.match_info["id"], "an item id")
        user = await own_user(ctx, caller)
        found = await memory.user_item(user.id, item_id)
        if found is None:
            not_found(f"you have no memory item #{item_id}")
        return found

    async def change(request: web.Request) -> web.Response:
        caller = await auth.require(request)
        wanted = await read_body(request, ItemChange)
        if wanted.content is None and wanted.pinned is None and wanted.scope is None:
            fail(422, "send at least one of content, pinned, scope")
        found = await owned(caller, request)
        item = found.item
        if item.superseded_by is not None:
            fail(409, f"item #{item.id} was corrected by #{item.superseded_by}: change that one")
        if item.archived_at is not None:
            fail(409, f"item #{item.id} is archived: restore it first")
        try:
            # (both as they would be stored: a save of the editor's text unchanged, or of the same words spaced
            # otherwise, is no correction, also of an item stored as it came, imported or from before)
            if wanted.content is not None and stored_text(wanted.content) != stored_text(item.content):
                await may_correct(caller, found, wanted)
                item = await correct(item, wanted)
            else:
                item = await set_flags(item, wanted)
        except MemoryConflict as exc:  # another correction or a forget of this item landed first
            fail(409, str(exc))
        except MemoryError as exc:
            fail(422, str(exc))
        return ok(item_json(OwnedItem(found.persona, item)))

    async def may_correct(caller: Caller, found: OwnedItem, wanted: ItemChange) -> None:
        """A correction makes a new item, which the chat's `!memory remember` refuses during a pause (it would
        outlive the stretch) and beside an item in use with the same words (two would crowd the prompt)."""
        old = found.item
        user = await own_user(ctx, caller)
        if await ctx.app.storage.incognito.active(user.id, found.persona):
            fail(409, f"you are incognito with {found.persona}: nothing new is remembered until you send "
                      f"{ctx.app.commands.prefix}memory resume")
        assert wanted.content is not None
        checked = memory.checked(old.pair_id, wanted.content, category=old.category, importance=old.importance,
                                 source="user")
        scope: Scope = "shared" if (wanted.scope or old.scope) == "shared" else "private"
        twin = await memory.same_words(old.pair_id, checked, scope)
        if twin is not None and twin.id != old.id:
            fail(409, f"item #{twin.id} says that already: forget #{old.id} instead")

    async def correct(old: MemoryItem, wanted: ItemChange) -> MemoryItem:
        """A new item superseding ``old``, keeping its kind, weight and tags (the store's checks apply)."""
        assert wanted.content is not None
        return await memory.remember(
            old.pair_id, wanted.content, category=old.category, key=old.key, importance=old.importance,
            pinned=old.pinned if wanted.pinned is None else wanted.pinned, tags=old.tags, source="user",
            scope="shared" if (wanted.scope or old.scope) == "shared" else "private", source_ref="web",
            expires_at=old.expires_at.timestamp() if old.expires_at and old.visible else None, supersedes=old.id,
            once=True)  # (a twin made meanwhile, in another tab or process: a 409 as may_correct's)

    async def set_flags(item: MemoryItem, wanted: ItemChange) -> MemoryItem:
        if wanted.pinned is not None and wanted.pinned != item.pinned:
            item = await memory.set_pinned(item.pair_id, item.id, wanted.pinned)
        if wanted.scope is not None and wanted.scope != item.scope:
            item = await memory.set_scope(item.pair_id, item.id, wanted.scope)
        return item

    async def forget(request: web.Request) -> web.Response:
        caller = await auth.require(request)
        found = await owned(caller, request)
        try:
            item = await memory.archive(found.item.pair_id, found.item.id, FORGOTTEN)
        except MemoryError as exc:
            fail(409, str(exc))
        return ok(item_json(OwnedItem(found.persona, item)))

    async def restore(request: web.Request) -> web.Response:
        caller = await auth.require(request)
        found = await owned(caller, request)
        try:
            item = await memory.restore(found.item.pair_id, found.item.id)
        except MemoryError as exc:
            fail(409, str(exc))
        return ok(item_json(OwnedItem(found.persona, item)))

    async def export(request: web.Request) -> web.Response:
        caller = await auth.require(request, costly=True)
        user = await own_user(ctx, caller)
        try:
            _, data = await ctx.app.cortex.commands.exports.archive(user)
        except ExportBusy as exc:
            fail(409, str(exc))
        return web.Response(body=data, content_type="application/zip", headers={
            "Content-Disposition": f'attachment; filename="{export_filename(user)}"'})

    async def forget_me(request: web.Request) -> web.Response:
        caller = await auth.require(request)
        wanted = await read_body(request, ForgetMe)
        if wanted.confirm != CONFIRM:
            fail(422, f'this deletes everything the bot stores about you and cannot be undone; to go ahead, send '
                      f'{{"confirm": "{CONFIRM}"}}')
        report = await ctx.app.cortex.commands.forget_user(caller.user_key)  # (its on_forget drops the kept HTML)
        counts = ("messages", "versions", "items", "runs", "summaries", "pairs")
        response = ok({"deleted": {name: 0 if report is None else getattr(report, name) for name in counts},
                       "still_incognito": await ctx.app.cortex.commands.paused_personas(caller.user_key)})
        auth.clear_cookie(response)
        return response

    return [
        web.get("/api/me/items", list_items),
        web.patch(ITEM_ROUTE, change),
        web.post(ITEM_ROUTE + "/forget", forget),
        web.post(ITEM_ROUTE + "/restore", restore),
        web.get("/api/me/export", export),
        web.post("/api/me/forget-me", forget_me),
    ]

