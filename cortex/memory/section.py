"""The "persistent knowledge" section of a reply prompt (slot 5 of the order in bot/prompt.py).

Pinned items first, then the items most relevant to the new message, with a recency gradient: items
younger than ``recent_days`` in full, older ones compressed to one short line, and what no longer
fits the budget only counted. Items put in as relevant count as accessed. Then, in the same budget,
up to ``recalled_messages`` past messages of the pair that are not in the prompt's history window
(recall memory: what no update extracted), when they score close to the best hit. In group channels the
section follows the same rule as the cortex files (``cortex.use_in_groups``), since items hold what a
user said in private too.
"""

from __future__ import annotations

from datetime import timedelta, tzinfo

from bot.config import MemoryConfig
from bot.ports import IncomingMessage, PromptContext, PromptSection, SectionSlot
from bot.storage.sources import ReplySource
from bot.text import one_line_name
from bot.tokens import TokenEstimator
from cortex.memory.store import SCOPES, Hit, MemoryItem, MemoryStore
from cortex.settings import SettingsResolver

SHORT = 100
RECALL_CHARS = 400
RECALL_FLOOR = 0.6
PINNED_READ = 100  # pinned items a reply reads at most (more do not fit its memory budget anyway)


FOLLOW_UP_WORDS = 8


def search_text(message: str, previous: str) -> str:
    """What the section searches for: the new message, and for a short follow-up ("and her sister?")
    the message before it too, which names what the follow-up is about."""
    if len(message.split()) < FOLLOW_UP_WORDS and previous:
        return f"{_short(previous, RECALL_CHARS)}\n{message}"
    return message


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit].rstrip() + "…"


class KnowledgeSection:
    slot: SectionSlot = "knowledge"

    def __init__(
        self, memory: MemoryStore, estimator: TokenEstimator, config: MemoryConfig, resolver: SettingsResolver
    ) -> None:
        self.memory = memory
        self.estimator = estimator
        self.config = config
        self.resolver = resolver
        # (author, channel, persona) -> whether the last search for a reply there embedded its query
        self._searched_by_meaning: dict[tuple[str, str, str], bool] = {}

    def prepare(self, message: IncomingMessage, persona: str, text: str, previous: str) -> None:
        """Start the query's embedding now, while the core stores the message and builds the prompt
        (``ReplyPreparer``): the search below then finds it done or under way. Only where the last
        reply to this author here searched by meaning (there were vectors to compare with): a first
        message, or one whose author has nothing embedded, costs no embedding at all."""
        embeddings = self.memory.embeddings
        if embeddings is not None and self._searched_by_meaning.get((message.author_key, message.channel_key, persona)):
            embeddings.prefetch_query(search_text(text, previous))

    def _remember_search(self, context: PromptContext, by_meaning: bool) -> None:
        if len(self._searched_by_meaning) > 50_000:
            self._searched_by_meaning.clear()
        self._searched_by_meaning[(context.user_key, context.channel_key, context.persona)] = by_meaning

    async def sections(self, context: PromptContext, budget: int) -> list[PromptSection]:
        # In a group channel where the server keeps DM memory out, only the speaker's shared items go in
        # (no private items, no recalled messages); never anyone else's: the pair is the speaker's own.
        everything = await self.resolver.private_memory_allowed(context.persona, context.server_key, context.is_dm)
        scopes = SCOPES if everything else ("shared",)
        pair_id, items = await self.memory.pair_with_items(context.user_db_id, context.persona)
        if pair_id is None:
            return []  # nobody the persona knows yet: one query
        recall = self.config.recalled_messages if everything else 0
        if not items and not recall:
            return []
        # (a few hundred pinned items, as an import can bring, cost every reply: the most important ones only)
        # (the scope chosen in the query: a hundred private pins must not crowd a group channel's shared ones out)
        pinned = await self.memory.pinned(pair_id, PINNED_READ + 1, shared_only=not everything) if items else []
        unread = len(pinned) > PINNED_READ  # (more than a reply reads: the note below says so)
        pinned = pinned[:PINNED_READ]
        relevant: list[MemoryItem] = []
        recalled: list[Hit] = []
        if self.config.relevant_items or recall:
            query = search_text(context.message, context.previous)
            by_meaning = await self.memory.needs_query_vector(
                pair_id, context.user_db_id, context.persona, items=items, messages=recall > 0)
            self._remember_search(context, by_meaning)
            embeddings = self.memory.embeddings
            vector = await embeddings.embed_query(query) if by_meaning and embeddings is not None else None
            hits = await self.memory.search(
                pair_id, query, user_id=context.user_db_id, persona=context.persona,
                limit=self.config.relevant_items + recall, include_messages=recall > 0,
                exclude_messages=context.in_prompt, include_items=items, scopes=scopes,
                query_vector=vector, use_vectors=False,  # asked above: no second check, no second try
                about=context.message,  # the user's own words: "I" in the reply before a follow-up is the persona
            )
            seen = {i.id for i in pinned}
            relevant = [h.item for h in hits if h.item is not None and h.item.id not in seen]
            relevant = relevant[: self.config.relevant_items]
            best = max((h.score for h in hits), default=0.0)
            # Past messages only when they are about as relevant as the best hit: they cost tokens.
            recalled = [h for h in hits if h.kind == "message" and h.score >= RECALL_FLOOR * best][:recall]
        if not pinned and not relevant and not recalled:
            return []
        remaining = min(budget, self.config.prompt_tokens)
        lines: list[str] = []
        used: list[int] = []
        shown: list[ReplySource] = []
        left_out = 0
        recent = context.now - timedelta(days=self.config.recent_days)
        for item, is_relevant in [(i, False) for i in pinned] + [(i, True) for i in relevant]:
            line = self._line(item, full=item.pinned or item.created_at >= recent, zone=context.now.tzinfo)
            cost = self.estimator.count(line + "\n")
            if cost > remaining:
                left_out += 1
                continue
            lines.append(line)
            shown.append(ReplySource("item", item.id))
            remaining -= cost
            if is_relevant:
                used.append(item.id)
        if left_out or unread:
            lines.append(f"(and {'' if unread else f'{left_out} '}more memories that did not fit here)")
        sections = []
        if lines:
            body = f"Facts you remember about {one_line_name(context.user_name)}:\n" + "\n".join(lines)
            sections.append(PromptSection("What you know", body, tuple(shown), template=False))
        said, recalled_ids = [], []
        for hit in sorted(recalled, key=lambda h: h.created_at):
            line = f"- {hit.created_at.astimezone(context.now.tzinfo):%Y-%m-%d} {_short(hit.text, RECALL_CHARS)}"
            cost = self.estimator.count(line + "\n")
            if cost > remaining:
                break
            said.append(line)
            recalled_ids.append(ReplySource("message", hit.id))
            remaining -= cost
        if said:
            sections.append(PromptSection(
                "From earlier conversations", "Things said before that may matter now:\n" + "\n".join(said),
                tuple(recalled_ids), template=False,
            ))
        await self.memory.count_access(used)
        return sections

    @staticmethod
    def _line(item: MemoryItem, *, full: bool, zone: tzinfo | None) -> str:
        """An item as the prompt shows it, dated in ``zone``: the bot's, the one the prompt's "today" is in."""
        text = item.content if full else _short(item.content, SHORT)
        when = item.created_at.astimezone(zone).strftime("%Y-%m-%d")
        return f"- {text} ({item.category}, {when}{', pinned' if item.pinned else ''})"


