"""``!dashboard``: a private, single-use login link to the web page, bound to the caller."""

from __future__ import annotations

from collections.abc import Sequence

from bot.commands import Command, CommandContext, CommandRegistry, CommandReply
from bot.config import WebConfig
from bot.storage.web import WebLoginRepository


def register_dashboard(registry: CommandRegistry, logins: WebLoginRepository, web: WebConfig) -> None:
    async def dashboard(ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        if not web.enabled:
            return CommandReply("The web page is not switched on for this bot (its operator sets [web] enabled = "
                                "true).", private=True)
        token = await logins.create_link(ctx.user_key, ctx.user_name, web.link_minutes * 60)
        return CommandReply(
            f"Your login link to the web page (works once, for {web.link_minutes:g} minutes; it opens your own "
            f"memory, so don't share it):\n{web.base_url}/login/{token}",
            private=True,
        )

    registry.register(Command("dashboard", "a private login link to the web page (your memory, and admin views)",
                              dashboard, private=True))
