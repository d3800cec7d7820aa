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

PAGE_SIZE = 128


@dataclass(frozen=True, slots=True)
class HistoryWindow:
    messages: list[StoredMessage] = field(default_factory=list)  # oldest first
    tokens: int = 0  # estimated (scaled) tokens of the messages in the window
    budget: int = 0
    trimmed: int = 0  # older messages of the channel left out

    @property
    def oldest_id(self) -> int | None:
        return self.messages[0].id if self.messages else None

    @property
    def over_budget(self) -> bool:
        return self.tokens > self.budget


def message_cost(message: StoredMessage, estimator: TokenEstimator) -> int:
    return cost_of(message.token_count, estimator)


def cost_of(token_count: int, estimator: TokenEstimator) -> int:
    return estimator.scale(token_count + PER_MESSAGE_OVERHEAD)


async def build_window(
    storage: Storage,
    estimator: TokenEstimator,
    channel_id: int,
    *,
    budget: int,
    min_exchanges: int,
    before_id: int | None = None,
    total_before: int | None = None,
) -> HistoryWindow:
    """The window of messages older than ``before_id`` (all when None).

    First decides the cut from ``(id, role, token_count)`` alone, then loads just the chosen
    messages. ``total_before`` is how many messages the channel holds before ``before_id``; it is
    only used to report how many were trimmed.
    """
    chosen_ids: list[int] = []
    tokens = 0
    user_messages = 0
    cursor = before_id
    done = False
    while not done:
        page = await storage.recent_message_sizes(channel_id, PAGE_SIZE, before_id=cursor)
        for message_id, role, token_count in page:
            cost = cost_of(token_count, estimator)
            if tokens + cost > budget and user_messages >= min_exchanges:
                done = True
                break
            chosen_ids.append(message_id)
            tokens += cost
            if role == "user":
                user_messages += 1
        if len(page) < PAGE_SIZE:
            break
        cursor = page[-1][0]
    messages: list[StoredMessage] = []
    if chosen_ids:
        upper = before_id if before_id is not None else chosen_ids[0] + 1
        messages = await storage.messages_between(channel_id, chosen_ids[-1] - 1, upper, limit=len(chosen_ids))
    trimmed = max((total_before or 0) - len(messages), 0)
    return HistoryWindow(messages=messages, tokens=tokens, budget=budget, trimmed=trimmed)
