"""Which skills a persona may use where: the config's defaults, then admins' overrides per persona —
bot-wide, per server and per channel, the narrowest one winning — each reported with its source.

Overrides live in the settings table (one JSON value per persona: ``{"*": {...}, "server:KEY": {...},
"channel:KEY": {...}}`` mapping skills' keys to on/off: the name, ``server/tool`` for an MCP tool), read
through a short cache so every process sees a change within seconds.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from bot.config import SkillsConfig
from bot.storage.core import Storage
from cortex.skills.base import SkillInfo, model_name

CACHE_SECONDS = 5.0
Overrides = dict[str, dict[str, bool]]


def settings_key(persona: str) -> str:
    return f"skills:{persona.casefold()}"


@dataclass(frozen=True, slots=True)
class Effective:
    enabled: bool
    source: str  # "default", "config (disabled)", "bot-wide", "this server", "this channel"


class SkillPolicy:
    def __init__(self, config: SkillsConfig, storage: Storage) -> None:
        self.config = config
        self.storage = storage
        self._cache: dict[str, tuple[float, Overrides]] = {}
        self._disabled = frozenset(name.casefold() for name in config.disabled)

    def default(self, info: SkillInfo) -> Effective:
        # (an MCP tool named in `disabled` by its plain name stays off once a clash renames it `<server>_<tool>`:
        # another server offering a tool of that name switched it back on for everyone)
        plain = (info.tool, model_name(info.tool)) if info.tool else ()
        if any(name.casefold() in self._disabled for name in (*info.switch_names, *plain)):
            return Effective(False, "config (disabled)")
        if info.origin == "builtin" and info.name not in self.config.builtin:
            return Effective(False, "config (not in builtin)")
        return Effective(True, "default")

    async def overrides(self, persona: str) -> Overrides:
        key = settings_key(persona)
        cached = self._cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < CACHE_SECONDS:
            return cached[1]
        raw = await self.storage.get_setting(key)
        try:
            loaded = json.loads(raw) if raw else {}
        except ValueError:
            loaded = {}
        value: Overrides = {str(s): {str(n): bool(v) for n, v in m.items()} for s, m in loaded.items()
                            if isinstance(m, dict)} if isinstance(loaded, dict) else {}
        self._cache[key] = (time.monotonic(), value)
        return value

    async def effective(self, info: SkillInfo, persona: str, server_key: str | None, channel_key: str,
                        parent_key: str | None = None) -> Effective:
        """Whether the skill is on here: the narrowest switch wins (this channel, the channel a thread or
        forum post is in, the server, bot-wide), else the default."""
        found, default = await self.overrides(persona), self.default(info)
        # A skill the config turns off is switched on bot-wide only (by the bot's admins): on Matrix whoever
        # makes a room is its admin, and an operator's "off" must not be anyone's to lift.
        locked = _locked(found, default, info)
        for scope, label in ((f"channel:{channel_key}", "this channel"),
                             (f"channel:{parent_key}" if parent_key else "", "this thread's channel"),
                             (f"server:{server_key}" if server_key else "", "this server"), ("*", "bot-wide")):
            for name in info.switch_names:
                if scope and name in found.get(scope, {}) and not (locked and found[scope][name]):
                    return Effective(found[scope][name], label)
        return default

    async def set(self, persona: str, scope: str, info: SkillInfo, enabled: bool | None) -> bool:
        """Record an override (``scope``: ``*``, ``server:KEY`` or ``channel:KEY``), or remove it (``None``:
        the scope follows the wider ones again); whether there was one to remove. A read-modify-write of
        one small value: admins changing the same persona's skills in the same second may lose one."""
        self._cache.pop(settings_key(persona), None)
        found = dict(await self.overrides(persona))
        mine = {**found.get(scope, {})}
        had = any([mine.pop(name, None) is not None for name in info.switch_names])
        if enabled is not None:
            mine[info.key] = enabled
        if mine:
            found[scope] = mine
        else:
            found.pop(scope, None)
        await self.storage.set_setting(settings_key(persona), json.dumps(found, sort_keys=True))
        self._cache.pop(settings_key(persona), None)
        return had

    async def copy_scope(self, persona: str, old: str, new: str) -> None:
        """Give ``new`` the switches of ``old`` (scopes as :meth:`set` takes them: a Matrix room upgraded), when it
        has none of its own yet."""
        key = settings_key(persona)
        self._cache.pop(key, None)
        found = await self.overrides(persona)
        if old in found and new not in found:
            await self.storage.set_setting(key, json.dumps({**found, new: found[old]}, sort_keys=True))
        self._cache.pop(key, None)

    async def locked(self, persona: str, info: SkillInfo) -> bool:
        """Whether the config turns the skill off and the bot's admins have not switched it on everywhere (for
        ``persona``): then no server or channel may switch it on."""
        return _locked(await self.overrides(persona), self.default(info), info)

    async def narrower(self, persona: str, info: SkillInfo) -> list[str]:
        """The server and channel scopes with an override of this skill (they win over a bot-wide one)."""
        return sorted(scope for scope, values in (await self.overrides(persona)).items()
                      if scope != "*" and any(name in values for name in info.switch_names))


def _locked(found: Overrides, default: Effective, info: SkillInfo) -> bool:
    return not default.enabled and not any(found.get("*", {}).get(name) for name in info.switch_names)
