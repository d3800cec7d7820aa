"""``!dashboard``: a private, single-use login link to the web page, bound to the caller."""

from __future__ import annotations

from collections.abc import Sequence

from bot.commands import Command, CommandContext, CommandRegistry, CommandReply, flag
from bot.config import WebConfig
from bot.storage.web import WebLoginRepository
from bot.text import plural

LOGOUT_FLAG = "--logout"


def register_dashboard(registry: CommandRegistry, logins: WebLoginRepository, web: WebConfig) -> None:
    async def dashboard(ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        if LOGOUT_FLAG in args:  # works with the page switched off too: sessions may be left from before
            ended = await logins.end_sessions(ctx.user_key)
            if not web.enabled and not ended:
                return CommandReply("The web page is not switched on for this bot, and no session of yours was "
                                    "left from before (any login link you had not used is void too).", private=True)
            return CommandReply(f"Logged out of the web page everywhere: {plural(ended, 'session')} ended, and "
                                "any login link you had not used yet no longer works.", private=True)
        if not (web.enabled or web.public_url):  # (a process of a fleet whose page another one serves: its address)
            return CommandReply("The web page is not switched on for this bot (its operator sets [web] enabled = "
                                "true).", private=True)
        token = await logins.create_link(ctx.user_key, ctx.user_name, web.link_minutes * 60)
        where = (" (the bot's operator has not set its address, [web] public_url: open it with the bot's address "
                 "in place of the 0.0.0.0 or [::])" if web.links_unreachable else "")
        return CommandReply(
            f"Your login link to the web page (works once, for {web.link_minutes:g} minutes; it opens your own "
            f"memory, so don't share it){where}:\n{web.base_url}/login/{token}",
            private=True,
        )

    registry.register(Command(
        "dashboard", "a private login link to the web page (your memory, and admin views)", dashboard,
        (flag("logout", "instead, log out of the page everywhere (every browser, every unused link)"),),
        private=True))
