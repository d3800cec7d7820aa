"""Shared by the user routes: the caller's own user row and their pair with a persona, never anyone else's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adapters.web.auth import Caller
from adapters.web.errors import not_found
from bot.config import ConfigError
from bot.storage.base import User
from cortex.store import Pair

if TYPE_CHECKING:
    from adapters.web.server import WebContext

MAX_NAME_CHARS = 200


def persona_name(ctx: WebContext, name: str) -> str:
    """The persona's canonical name, or a 404 for one the bot does not have."""
    if len(name) > MAX_NAME_CHARS:
        not_found("no such persona")
    wanted = name.casefold()
    for known in ctx.app.personas.names():
        if known.casefold() == wanted:
            return known
    not_found(f"no persona called {name[:80]!r}")


async def own_user(ctx: WebContext, caller: Caller) -> User:
    """The caller's user row (made on first use with the name from the chat that sent the link; a name
    changed in chat since is kept)."""
    user = await ctx.app.storage.get_user(caller.user_key)
    if user is None:
        user = await ctx.app.storage.upsert_user(caller.user_key, caller.session.user_name or caller.user_key)
    return user


async def own_pair(ctx: WebContext, caller: Caller, persona: str) -> tuple[User, Pair]:
    """The caller's pair with ``persona`` (made, with its files from the templates, on first use, as a chat
    command would)."""
    name = persona_name(ctx, persona)
    try:
        spec = ctx.app.personas.persona(name)
    except ConfigError:
        not_found(f"no persona called {persona[:80]!r}")
    known = await own_user(ctx, caller)
    user, pair = await ctx.app.cortex.store.pair_for(known.key, known.display_name, name)
    await ctx.app.cortex.files.ensure(pair, spec.language, user.display_name)
    return user, pair
