"""What happened to the caller's pair with one persona: how each cortex file grew version by version, the
persona's update runs, and the token budgets of its replies' history window and summary."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from adapters.web.server import WebContext, ok
from adapters.web.userdata import own_pair
from bot.summary import budgets_for
from cortex.store import FILENAMES, CortexRun, FileVersion

MAX_RUNS = 50
CHARTED = 500  # newest versions of each file the size chart draws (their sizes only)


def version_json(v: FileVersion) -> dict[str, Any]:
    return {"version": v.version, "chars": v.chars, "created_at": v.created_at.isoformat(), "author": v.author}


def run_json(run: CortexRun, *, error: bool) -> dict[str, Any]:
    """A run as the page shows it: why it failed in words for people (``reason``); the error itself (an
    exception's text, for the log's reader: what the bot's code or its model's server said) to the bot's
    admins only."""
    return {
        "id": run.id, "tier": run.tier, "status": run.status, "started_at": run.started_at.isoformat(),
        "finished_at": None if run.finished_at is None else run.finished_at.isoformat(),
        "duration_ms": run.duration_ms, "input_tokens": run.input_tokens, "output_tokens": run.output_tokens,
        "files_written": run.files_written, "reason": run.reason, "error": run.error if error else "",
    }


def routes(ctx: WebContext) -> list[web.RouteDef]:
    store = ctx.app.cortex.store

    async def activity(request: web.Request) -> web.Response:
        caller = await ctx.auth.require(request)
        _, pair = await own_pair(ctx, caller, request.match_info["persona"])
        files = {name: [version_json(v) for v in reversed((await store.versions_listed(pair.id, name, CHARTED))[0])]
                 for name in FILENAMES}
        budgets = budgets_for(ctx.app.config, ctx.app.personas.persona(pair.persona))
        return ok({
            "persona": pair.persona, "files": files,
            "runs": [run_json(r, error=ctx.auth.is_bot_admin(caller)) for r in await store.runs(pair.id, MAX_RUNS)],
            "budgets": {"history_tokens": budgets.history_tokens, "summary_tokens": budgets.summary_tokens},
        })

    return [web.get("/api/me/personas/{persona}/activity", activity)]
