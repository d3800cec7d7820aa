"""``!skills list | enable NAME | disable NAME | reset NAME | stats``: which tools the persona in use may call here,
with each one's effective value and where it comes from; admins switch them per server (the default in
a server), per channel (``--channel``) or bot-wide for the persona (``--everywhere``, bot admins; the
only scope in a direct message)."""

from __future__ import annotations

import difflib
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bot.commands import Command, CommandContext, CommandError, CommandRegistry, CommandReply, flag, operators, word
from bot.storage.core import Storage
from bot.text import shown
from cortex.skills.base import Skill
from cortex.skills.toolbox import SkillTools

WEEK = 7 * 86_400.0


def _short(text: str, width: int = 120) -> str:
    """``text`` cut at a word and marked as cut (a first word longer than ``width``, a URL: cut inside it)."""
    cut = textwrap.shorten(text, width, placeholder=" …")
    return cut if cut != "…" else text[:width - 1] + "…"


@dataclass
class SkillCommands:
    tools: SkillTools
    storage: Storage
    down: Callable[[], list[tuple[str, str]]] = lambda: []  # configured MCP servers not connected now, and why
    prefix: str = "!"

    def register(self, registry: CommandRegistry) -> None:
        self.prefix = registry.prefix
        scope = (flag("channel", "only in this channel", token="--channel"),
                 flag("everywhere", "for this persona everywhere (bot admins)", token="--everywhere"))
        name = word("name", "the skill's name", required=True)
        registry.register(Command("skills list", "the skills this persona may use here, and why", self.list_skills,
                                  admin=True, aliases=("skills",)))
        registry.register(Command("skills enable", "let the persona use a skill", self.enable, (name, *scope),
                                  admin=True))
        registry.register(Command("skills disable", "stop the persona using a skill", self.disable, (name, *scope),
                                  admin=True))
        registry.register(Command("skills reset", "drop this scope's switch: the skill follows the wider one again",
                                  self.reset, (name, *scope), admin=True))
        # Private, as !cortex stats is: a skill's last error may quote what a call carried (from someone's DM).
        registry.register(Command("skills stats", "skill calls of the last 7 days, bot-wide: count, failures, time",
                                  self.stats, admin=True, bot_admin=True, private=True))

    async def list_skills(self, ctx: CommandContext, args: Sequence[str]) -> str | CommandReply:
        skills = self.tools.all()
        if not self.tools.config.enabled:
            return "Skills are switched off for the whole bot ([skills] enabled = false)."
        # A server that cannot be reached offers no tools: say so, or its skills would seem never configured.
        # Why is the operator's to know (paths, URLs): the bot's admins see it, a room's admins do not.
        down = [f"⚠️ MCP server {name} is not reachable" + (f" ({reason[:200]})" if ctx.is_bot_admin else "")
                + "; its tools come back once it answers" for name, reason in self.down()]
        told = operators if down and ctx.is_bot_admin else _as_is  # (why a server is down: the operator's)
        if not skills:
            return told(ctx, "\n".join(["No skills are available.", *down]))
        lines = [f"Skills of {ctx.persona} here (✅ on, ⛔ off; change with {self.prefix}skills enable|disable NAME):"]
        for skill in sorted(skills, key=lambda s: (s.info.origin, s.info.name)):
            info = skill.info
            effective = await self.tools.policy.effective(info, ctx.persona, ctx.server_key, ctx.channel_key,
                                                            ctx.parent_channel_key)
            notes = [info.origin + (f" {info.shown_key}" if info.server else ""), effective.source]
            if info.admin_only:
                notes.append("the bot's admins only" if info.for_bot_admins else "admins only")
            if info.triggers:
                notes.append("when a message says " + ", ".join(info.triggers[:5]))
            if info.group_triggers:
                notes.append("in group channels when a message says " + ", ".join(info.group_triggers[:2]) + " …")
            lines.append(f"{'✅' if effective.enabled else '⛔'} {info.name} ({'; '.join(notes)}): "
                         f"{_short(info.description)}")
        return told(ctx, "\n".join(lines + down))

    async def enable(self, ctx: CommandContext, args: Sequence[str]) -> str:
        return await self._switch(ctx, args, True)

    async def disable(self, ctx: CommandContext, args: Sequence[str]) -> str:
        return await self._switch(ctx, args, False)

    async def reset(self, ctx: CommandContext, args: Sequence[str]) -> str:
        return await self._switch(ctx, args, None)

    async def _switch(self, ctx: CommandContext, args: Sequence[str], enabled: bool | None) -> str:
        names = [a for a in args if not a.startswith("--")]
        known = _by_every_name(self.tools.all())
        if not names:
            raise CommandError(f"which skill? see {self.prefix}skills list")
        if names[0] not in known:
            near = difflib.get_close_matches(names[0].lower(), sorted(known), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise CommandError(f"unknown skill {shown(names[0])}{hint}; see {self.prefix}skills list")
        name, info, policy = names[0], known[names[0]].info, self.tools.policy
        scope, where = self._scope(ctx, args)
        if enabled and scope != "*" and await policy.locked(ctx.persona, info):
            why = ("[skills] disabled names it" if policy.default(info).source == "config (disabled)"
                   else "[skills] builtin leaves it out")
            raise CommandError(f"{name} is off in the bot's config ({why}): only the bot's admins switch it on, "
                               f"everywhere ({self.prefix}skills enable {name} --everywhere); then a server or "
                               "channel may switch it off")
        had = await policy.set(ctx.persona, scope, info, enabled)
        if enabled is None:
            now = await policy.effective(info, ctx.persona, ctx.server_key, ctx.channel_key, ctx.parent_channel_key)
            done = (f"{name} has no switch of its own for {ctx.persona} {where} any more" if had else
                    f"{name} had no switch of its own for {ctx.persona} {where}")
            return f"{done}; here it is {'on' if now.enabled else 'off'} ({now.source})."
        done = f"{name} is now {'on' if enabled else 'off'} for {ctx.persona} {where}."
        below = await policy.narrower(ctx.persona, info) if scope == "*" else []
        if below:  # a server's or channel's own switch wins over the bot-wide one
            shown_scopes = ", ".join(below[:5]) + (f" and {len(below) - 5} more" if len(below) > 5 else "")
            done += (f" Switched on their own (and so unchanged): {shown_scopes}; {self.prefix}skills reset {name} "
                     "there makes them follow this.")
        return done

    @staticmethod
    def _scope(ctx: CommandContext, args: Sequence[str]) -> tuple[str, str]:
        if "--channel" in args and "--everywhere" in args:
            raise CommandError("choose one of --channel and --everywhere")
        if "--channel" in args:
            return f"channel:{ctx.channel_key}", "in this channel"
        if "--everywhere" in args or not ctx.server_key:
            if not ctx.is_bot_admin:
                raise CommandError("switching a skill everywhere (and in direct messages) is for the bot's admins; "
                                   "server admins switch it for their server or with --channel")
            return "*", "everywhere"
        return f"server:{ctx.server_key}", "in this server"

    async def stats(self, ctx: CommandContext, args: Sequence[str]) -> str:
        lines = await self.stats_lines(ctx.persona)
        return "\n".join(lines) if lines else f"No skill calls by {ctx.persona} in the last 7 days."

    async def stats_lines(self, persona: str | None = None) -> list[str]:
        rows = await self.storage.skills.stats(time.time() - WEEK, persona)
        if not rows:
            return []
        lines = ["Skill calls, last 7 days" + (f" ({persona})" if persona else "") + ":"]
        for r in rows:
            line = f"  {r.skill}: {r.calls} calls, {r.failures} failed, average {r.average_ms:.0f} ms"
            lines.append(line + (f"; last error: {r.last_error[:120]}" if r.last_error else ""))
        return lines


def _by_every_name(skills: Sequence[Skill]) -> dict[str, Skill]:
    """Each skill under every name a switch of it may be given: its offered name, and an MCP tool's
    ``server/tool`` as its server spells it and as ``!skills list`` shows it (the first skill keeps a name)."""
    known: dict[str, Skill] = {}
    for skill in skills:
        for name in skill.info.switch_names:
            known.setdefault(name, skill)
    return known


def _as_is(_ctx: CommandContext, text: str) -> str:
    return text
