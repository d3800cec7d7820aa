"""``/api/me`` and the caller's cortex files: read, edit (with the version the edit is based on), versions,
side-by-side diff, revert and reset. Everything here works on the logged-in user's own pairs only: no
route takes a user id."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from adapters.web.errors import GONE, fail, not_found
from adapters.web.render import side_by_side
from adapters.web.server import WebContext, ok, read_body
from adapters.web.userdata import own_pair, own_user
from bot.commands import MAX_NUMBER
from cortex.files import FileConflict, FileError, NoSuchVersion
from cortex.store import FILENAMES, FileVersion, Pair

FILE_ROUTE = "/api/me/personas/{persona}/files/{file}"
VERSIONS_LISTED = 200  # newest versions a file's history lists (any older one is still shown and restored by number)


class FileEdit(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    content: str
    version: int = Field(ge=1, le=MAX_NUMBER, description="the version the edit is based on")


class Revert(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    version: int = Field(ge=1, le=MAX_NUMBER)


def version_json(v: FileVersion) -> dict[str, Any]:
    """What a version is, without its text (see ``shown`` in :func:`routes` for the text and its HTML)."""
    return {
        "file": v.filename, "version": v.version, "author": v.author, "reason": v.reason, "tier": v.tier,
        "run_id": v.run_id, "created_at": v.created_at.isoformat(), "chars": v.chars,
    }


def filename(request: web.Request) -> str:
    name = request.match_info["file"].lower()
    if not name.endswith(".md"):
        name += ".md"
    if name not in FILENAMES:
        not_found(f"no such file (files: {', '.join(FILENAMES)})")
    return name


def version_number(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 10 or not 1 <= int(text) <= MAX_NUMBER:
        fail(400, f"a version is a number from 1 up, not {text[:20]!r}")
    return int(text)


def routes(ctx: WebContext) -> list[web.RouteDef]:
    auth, store, files = ctx.auth, ctx.app.cortex.store, ctx.app.cortex.files
    # A diff (quadratic in the worst case) and Markdown's HTML are pure Python: off the event loop, which also
    # runs the chat adapters, a few at a time (see HtmlRenderer). File views, diffs and searches count against
    # the page's per-user limit of views (Auth.require's ``view``).
    renderer = ctx.renderer
    diffing = asyncio.Semaphore(2)  # diffs (bounded: cortex.diff.DIFF_WORK) apart: they never hold up a file view

    async def shown(v: FileVersion, owner: str) -> dict[str, Any]:
        """A version with its text and the text as HTML."""
        return version_json(v) | {"content": v.content, "html": await renderer.html(owner, v.content)}

    async def saved_or_current(pair: Pair, name: str, saved: FileVersion | None, owner: str) -> web.Response:
        """The version a change made, or the unchanged current one, with whether anything changed."""
        current = saved or await store.current(pair.id, name)
        if current is None:  # a forget-me took the files since
            fail(409, GONE)
        return ok(await shown(current, owner) | {"changed": saved is not None})

    async def me(request: web.Request) -> web.Response:
        caller = await auth.require(request)
        user = await own_user(ctx, caller)
        talked = await ctx.app.storage.export.personas_talked_to(user.id)
        personas = [{"name": n, "language": ctx.app.personas.persona(n).language, "talked": n in talked}
                    for n in ctx.app.personas.names()]
        servers = [{"key": s.key, "name": s.name} for s in await auth.servers(caller.user_key)]
        return ok({
            "user": {"key": caller.user_key, "name": user.display_name}, "csrf": caller.session.csrf,
            "is_bot_admin": auth.is_bot_admin(caller), "admin_servers": servers, "personas": personas,
            "files": list(FILENAMES), "file_max_chars": files.file_max_chars,
            "session_expires_at": caller.session.expires_at,
        })

    async def all_files(request: web.Request) -> web.Response:
        caller = await auth.require(request, view=True)
        _, pair = await own_pair(ctx, caller, request.match_info["persona"])
        current = await store.current_all(pair.id)
        if any(f not in current for f in FILENAMES):  # own_pair made every file: a forget-me since took them
            fail(409, GONE)
        return ok({"persona": pair.persona,
                   "files": [await shown(current[f], caller.user_key) for f in FILENAMES]})

    async def get_file(request: web.Request) -> web.Response:
        caller = await auth.require(request, view=True)
        name = filename(request)
        _, pair = await own_pair(ctx, caller, request.match_info["persona"])
        current = await store.current(pair.id, name)
        if current is None:  # own_pair made every file: a forget-me since took them
            fail(409, GONE)
        return ok(await shown(current, caller.user_key) | {"max_chars": files.file_max_chars})

    async def put_file(request: web.Request) -> web.Response:
        caller = await auth.require(request)
        name = filename(request)
        edit = await read_body(request, FileEdit)
        _, pair = await own_pair(ctx, caller, request.match_info["persona"])
        try:
            saved = await files.edit(pair, name, edit.content.strip() + "\n", based_on=edit.version)
        except FileConflict as exc:
            fail(409, str(exc))
        except FileError as exc:
            fail(422, str(exc))
        return await saved_or_current(pair, name, saved, caller.user_key)

    async def versions(request: web.Request) -> web.Response:
        caller = await auth.require(request)
        name = filename(request)
        _, pair = await own_pair(ctx, caller, request.match_info["persona"])
        found, total = await store.versions_listed(pair.id, name, VERSIONS_LISTED)
        return ok({"file": name, "versions": [version_json(v) for v in found], "total": total})

    async def one_version(request: web.Request) -> web.Response:
        caller = await auth.require(request, view=True)
        name, number = filename(request), version_number(request.match_info["version"])
        _, pair = await own_pair(ctx, caller, request.match_info["persona"])
        try:
            found = await files.get_version(pair, name, number)
        except FileError as exc:  # (which versions there are, and whether older ones are no longer kept)
            not_found(str(exc))
        return ok(await shown(found, caller.user_key))

    async def diff(request: web.Request) -> web.Response:
        caller = await auth.require(request, view=True)
        name = filename(request)
        first = version_number(request.query.get("from", ""))
        second = version_number(request.query.get("to", ""))
        _, pair = await own_pair(ctx, caller, request.match_info["persona"])
        try:
            a, b = await files.get_version(pair, name, first), await files.get_version(pair, name, second)
        except FileError as exc:
            not_found(str(exc))
        async with diffing:
            rows = await asyncio.to_thread(side_by_side, a.content, b.content)
        return ok({"file": name, "from": first, "to": second, "rows": rows})

    async def revert(request: web.Request) -> web.Response:
        caller = await auth.require(request)
        name = filename(request)
        wanted = await read_body(request, Revert)
        _, pair = await own_pair(ctx, caller, request.match_info["persona"])
        try:
            saved = await files.revert(pair, name, wanted.version)
        except NoSuchVersion as exc:
            not_found(str(exc))
        except FileError as exc:  # (one over today's size limit: it exists, the revert is refused)
            fail(422, str(exc))
        return await saved_or_current(pair, name, saved, caller.user_key)

    async def reset(request: web.Request) -> web.Response:
        caller = await auth.require(request)
        name = filename(request)
        user, pair = await own_pair(ctx, caller, request.match_info["persona"])
        language = ctx.app.personas.persona(pair.persona).language
        changed = await files.reset(pair, (name,), language, user.display_name)
        current = await store.current(pair.id, name)
        if current is None:  # a forget-me took the files since
            fail(409, GONE)
        return ok(await shown(current, caller.user_key) | {"changed": bool(changed)})

    return [
        web.get("/api/me", me),
        web.get("/api/me/personas/{persona}/files", all_files),
        web.get(FILE_ROUTE, get_file),
        web.put(FILE_ROUTE, put_file),
        web.get(FILE_ROUTE + "/versions", versions),
        web.get(FILE_ROUTE + "/versions/{version}", one_version),
        web.get(FILE_ROUTE + "/diff", diff),
        web.post(FILE_ROUTE + "/revert", revert),
        web.post(FILE_ROUTE + "/reset", reset),
    ]
