"""The "persistent knowledge" section of a reply prompt (DESIGN.md §4, slot 5).

Pinned items first, then the items most relevant to the new message, with a recency gradient: items
younger than ``recent_days`` in full, older ones compressed to one short line, and what no longer
fits the budget only counted. Items put in as relevant count as accessed. In group channels the
section follows the same rule as the cortex files (``cortex.use_in_groups``), since items hold what a
user said in private too.
"""

from __future__ import annotations

from datetime import UTC, timedelta

from bot.config import MemoryConfig
from bot.ports import PromptContext, PromptSection, SectionSlot
from bot.tokens import TokenEstimator
from cortex.memory.store import MemoryItem, MemoryStore
from cortex.settings import SettingsResolver

SHORT = 100


class KnowledgeSection:
    slot: SectionSlot = "knowledge"

    def __init__(
        self, memory: MemoryStore, estimator: TokenEstimator, config: MemoryConfig, resolver: SettingsResolver
    ) -> None:
        self.memory = memory
        self.estimator = estimator
        self.config = config
        self.resolver = resolver

    async def sections(self, context: PromptContext, budget: int) -> list[PromptSection]:
        if not await self.resolver.private_memory_allowed(context.persona, context.server_key, context.is_dm):
            return []
        pair_id, items = await self.memory.pair_with_items(context.user_db_id, context.persona)
        if pair_id is None or not items:
            return []  # the common case costs one query
        pinned = await self.memory.pinned(pair_id)
        relevant: list[MemoryItem] = []
        if self.config.relevant_items:
            hits = await self.memory.search(pair_id, context.message, limit=self.config.relevant_items,
                                            include_messages=False)
            seen = {i.id for i in pinned}
            relevant = [h.item for h in hits if h.item is not None and h.item.id not in seen]
        if not pinned and not relevant:
            return []
        remaining = min(budget, self.config.prompt_tokens)
        lines: list[str] = []
        used: list[int] = []
        left_out = 0
        recent = context.now - timedelta(days=self.config.recent_days)
        for item, is_relevant in [(i, False) for i in pinned] + [(i, True) for i in relevant]:
            line = self._line(item, full=item.pinned or item.created_at >= recent)
            cost = self.estimator.count(line + "\n")
            if cost > remaining:
                left_out += 1
                continue
            lines.append(line)
            remaining -= cost
            if is_relevant:
                used.append(item.id)
        if left_out:
            lines.append(f"(and {left_out} more related memories that did not fit here)")
        await self.memory.count_access(used)
        return [PromptSection("What you know", "Facts you remember about {user_name}:\n" + "\n".join(lines))]

    @staticmethod
    def _line(item: MemoryItem, *, full: bool) -> str:
        text = item.content if full or len(item.content) <= SHORT else item.content[:SHORT].rstrip() + "…"
        when = item.created_at.astimezone(UTC).strftime("%Y-%m-%d")
        return f"- {text} ({item.category}, {when}{', pinned' if item.pinned else ''})"


