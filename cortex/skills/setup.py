"""The skills of one bot process, put together: built-ins, HTTP skills from config and MCP servers,
behind one :class:`SkillTools` provider for the core and one ``!skills`` command set."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bot.config import Config, ConfigError, HttpSkillConfig
from bot.storage.core import Storage
from cortex.skills.base import Skill
from cortex.skills.builtin import Builtins
from cortex.skills.commands import SkillCommands
from cortex.skills.http import HttpSkill
from cortex.skills.toolbox import SkillTools

if TYPE_CHECKING:
    from cortex.skills.mcp import McpSkills

log = logging.getLogger(__name__)


class Skills:
    def __init__(self, config: Config, storage: Storage, builtins: Builtins) -> None:
        self.config = config
        self._builtins: list[Skill] = list(builtins.skills())
        # Skills off: none is built, so no server starts and no secret is asked for (doctor checks none either).
        on = config.skills.enabled
        self.http = [self._http_skill(entry) for entry in config.skills.http] if on else []
        self.mcp = self._mcp(config) if on and config.skills.mcp else None
        self.tools = SkillTools(config.skills, storage, [self._builtin_skills, self._http_skills, self._mcp_skills])
        self.commands = SkillCommands(self.tools, storage, self._mcp_down)

    @staticmethod
    def _mcp(config: Config) -> McpSkills:
        # The MCP SDK takes ~1.4 s to import (pydantic models by the hundred): only a bot that has MCP
        # servers configured pays for it, at start, not every `cortexbot` command.
        from cortex.skills.mcp import McpSkills

        try:
            return McpSkills(config.skills.mcp)
        except ValueError as exc:  # a missing secret variable: one clear line at start, as for an HTTP skill
            raise ConfigError(str(exc)) from None

    @staticmethod
    def _http_skill(entry: HttpSkillConfig) -> HttpSkill:
        try:
            return HttpSkill(entry)
        except ValueError as exc:  # a missing secret variable, a bad schema or URL: one clear line at start
            raise ConfigError(str(exc)) from None  # the message already names [[skills.http]] and the skill

    def _builtin_skills(self) -> Sequence[Skill]:
        return self._builtins

    def _http_skills(self) -> Sequence[Skill]:
        return self.http

    def _mcp_down(self) -> list[tuple[str, str]]:
        return self.mcp.down() if self.mcp is not None else []

    def _mcp_skills(self) -> Sequence[Skill]:
        return self.mcp.skills() if self.mcp is not None else []

    async def start(self) -> None:
        """Start the MCP servers (each within its connect timeout; one that cannot start is retried in the
        background and never holds up the bot)."""
        if self.mcp is not None:
            await self.mcp.start()

    async def aclose(self) -> None:
        if self.mcp is not None:
            await self.mcp.aclose()
        for skill in self.http:
            await skill.aclose()
