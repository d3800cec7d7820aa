"""The token-budgeted history window of a channel.

Newest messages first until ``budget`` tokens are spent, whole messages only (a message that does not
fit ends the window; older, smaller ones are not slipped in, so the window is always one unbroken
stretch of the conversation), and never fewer than ``min_exchanges`` user messages, even over budget.

Messages are read page by page, newest first, through an index on (channel, id): the cost depends on
the size of the window, never on the length of the channel's history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bot.storage.base import Storage, StoredMessage
from bot.tokens import PER_MESSAGE_OVERHEAD, TokenEstimator

PAGE_SIZE = 64


@dataclass(frozen=True, slots=True)
class HistoryWindow:
    messages: list[StoredMessage] = field(default_factory=list)  # oldest first
    tokens: int = 0  # estimated (scaled) tokens of the messages in the window
    budget: int = 0
    trimmed: int = 0  # older messages of the channel left out (= the newest left-out message's seq)
    newest_evicted_id: int | None = None  # the newest message left out, if any

    @property
    def oldest_id(self) -> int | None:
        return self.messages[0].id if self.messages else None

    @property
    def over_budget(self) -> bool:
        return self.tokens > self.budget


def message_cost(message: StoredMessage, estimator: TokenEstimator) -> int:
    return estimator.scale(message.token_count + PER_MESSAGE_OVERHEAD)


async def build_window(
    storage: Storage,
    estimator: TokenEstimator,
    channel_id: int,
    *,
    budget: int,
    min_exchanges: int,
    before_id: int | None = None,
    size_hint: int = 0,
    viewer: tuple[int, str] | None = None,
) -> HistoryWindow:
    """The window of messages older than ``before_id`` (all when None); for ``viewer`` (user id, persona: the
    reply's), without others' incognito stretches (see ``Storage.recent_messages``).

    ``size_hint`` (how many messages the last window of this channel held) sizes the first read so
    that one query usually suffices; the result does not depend on it.
    """
    chosen: list[StoredMessage] = []
    tokens = 0
    user_messages = 0
    cursor = before_id
    page_size = size_hint + 8 if size_hint else PAGE_SIZE
    while True:
        page = await storage.recent_messages(channel_id, page_size, before_id=cursor, viewer=viewer)
        for message in page:
            cost = message_cost(message, estimator)
            if tokens + cost > budget and user_messages >= min_exchanges:
                chosen.reverse()
                # seq counts the channel's messages, so everything up to the evicted one is left out.
                return HistoryWindow(chosen, tokens, budget, trimmed=message.seq, newest_evicted_id=message.id)
            chosen.append(message)
            tokens += cost
            if message.role == "user":
                user_messages += 1
        if len(page) < page_size:
            chosen.reverse()
            return HistoryWindow(chosen, tokens, budget)
        cursor = page[-1].id
        page_size = max(page_size * 2, PAGE_SIZE)
