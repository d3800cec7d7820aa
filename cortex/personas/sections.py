"""Global rules and server guidelines in the reply prompt (slots 1 and 2 of the order in bot/prompt.py), each within
its token budget. Both come from the registry's cache: no query on the reply path."""

from __future__ import annotations

from bot.ports import PromptContext, PromptSection, SectionSlot
from bot.tokens import TokenEstimator, fit_to_budget
from cortex.personas.registry import PersonaRegistry

CUT_NOTE = "\n(… the rest did not fit here)"
RULES_SHARE = 0.5  # of the slot budget: rules and guidelines are short, and must not crowd out memory


class RulesSection:
    slot: SectionSlot = "rules"

    def __init__(self, registry: PersonaRegistry, estimator: TokenEstimator) -> None:
        self.registry = registry
        self.estimator = estimator

    async def sections(self, context: PromptContext, budget: int) -> list[PromptSection]:
        texts = [r.content.strip() for r in self.registry.rules() if r.enabled and r.content.strip()]
        if not texts:
            return []
        body = fit_to_budget(self.estimator, "\n".join(texts), int(budget * RULES_SHARE), CUT_NOTE)
        return [PromptSection("Rules", body)]


class GuidelinesSection:
    slot: SectionSlot = "guidelines"

    def __init__(self, registry: PersonaRegistry, estimator: TokenEstimator) -> None:
        self.registry = registry
        self.estimator = estimator

    async def sections(self, context: PromptContext, budget: int) -> list[PromptSection]:
        text, _ = self.registry.guidelines_for(context.server_key)
        if not text.strip():
            return []
        body = fit_to_budget(self.estimator, text.strip(), int(budget * RULES_SHARE), CUT_NOTE)
        title = "Guidelines of this server" if context.server_key else "Guidelines"
        return [PromptSection(title, body)]
