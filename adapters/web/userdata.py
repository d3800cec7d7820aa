"""Shared by the user routes: the caller's own user row and their pair with a persona, never anyone else's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adapters.web.auth import Caller
from adapters.web.errors import fail, not_found
from bot.config import ConfigError
from bot.storage.base import User
from bot.storage.engine import is_missing_reference
from cortex.store import Pair

if TYPE_CHECKING:
    from adapters.web.server import WebContext

MAX_NAME_CHARS = 200
SESSION_ENDED = "the session ended (forget-me, logout or its time ran out): send !dashboard in a chat for a new link"


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
    changed in chat since is kept). Made only while the session lasts: a forget-me that finished after
    this request's login check ended the session, and a 401 answers instead of a new row."""
    user = await ctx.app.storage.get_user(caller.user_key)
    if user is None or not user.display_name:  # (none, or the nameless row a forget-me during a pause kept)
        row = await ctx.app.storage.web.session_user(caller.session_id)
        if row is None:
            fail(401, SESSION_ENDED)
        user = User(*row)
    return user


async def own_pair(ctx: WebContext, caller: Caller, persona: str) -> tuple[User, Pair]:
    """The caller's pair with ``persona`` (made, with its files from the templates, on first use, as a chat
    command would)."""
    name = persona_name(ctx, persona)
    try:
        spec = ctx.app.personas.persona(name)
    except ConfigError:
        not_found(f"no persona called {persona[:80]!r}")
    user = await own_user(ctx, caller)
    store = ctx.app.cortex.store
    try:
        # Read first: most views are of a pair there is; made (a write) only on the first.
        pair = await store.get_pair(user.id, name) or await store.count_messages(user.id, name, 0)
        await ctx.app.cortex.files.ensure(pair, spec.language, user.display_name)
    except Exception as exc:
        if not is_missing_reference(exc):
            raise
        fail(401, SESSION_ENDED)  # a forget-me removed the user after the row was read: nothing comes back
    return user, pair
