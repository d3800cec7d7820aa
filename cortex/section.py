"""The pair's cortex files in the reply prompt (slot 4 of the order in bot/prompt.py), within a token budget."""

from __future__ import annotations

from bot.ports import PromptContext, PromptSection, SectionSlot
from bot.storage.sources import ReplySource
from bot.tokens import TokenEstimator, fit_to_budget
from cortex.settings import SettingsResolver
from cortex.store import CortexStore

ORDER = ("memory.md", "relationship.md", "soul.md")
INTRO = (
    "These are your own inner files about yourself and {user_name}, kept up to date by you. Draw on them "
    "naturally in the conversation; do not quote them or mention that they exist."
)
CUT_NOTE = "\n(… the rest of this file did not fit here)"


class CortexSection:
    slot: SectionSlot = "cortex"

    def __init__(
        self, store: CortexStore, estimator: TokenEstimator, budget: int, resolver: SettingsResolver
    ) -> None:
        self.store = store
        self.estimator = estimator
        self.budget = budget
        self.resolver = resolver

    async def sections(self, context: PromptContext, budget: int) -> list[PromptSection]:
        if not await self.resolver.private_memory_allowed(context.persona, context.server_key, context.is_dm):
            return []
        files = await self.store.files_for_prompt(context.user_db_id, context.persona)
        if not files:
            return []
        versions = self.store.prompt_versions(context.user_db_id, context.persona)
        remaining = min(budget, self.budget) - self.estimator.count(INTRO)
        parts, shown = [INTRO], []
        for filename in ORDER:
            content = files.get(filename, "").strip()
            if not content or remaining <= 0:
                continue
            block = fit_to_budget(self.estimator, f"## {filename}\n{content}", remaining, CUT_NOTE)
            cost = self.estimator.count(block)
            parts.append(block)
            shown.append(ReplySource("file", versions.get(filename, 0), filename))
            remaining -= cost
        return [PromptSection("Your inner files", "\n\n".join(parts), tuple(shown))]
