"""The token-budgeted history window of a channel.

Newest messages first until ``budget`` tokens are spent, whole messages only (a message that does not
fit ends the window; older, smaller ones are not slipped in, so the window is always one unbroken
stretch of the conversation), and never fewer than ``min_exchanges`` user messages, even over budget.

Messages are read page by page, newest first, through an index on (channel, id): the cost depends on
the size of the window, never on the length of the channel's history. In the window each answer comes
right after the message it answers, where it was written, even when it was stored after later messages
(two people answered side by side, or a message sent while the answer before it was being written).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime

from bot.storage.base import Storage, StoredMessage
from bot.text import continued
from bot.tokens import PER_MESSAGE_OVERHEAD, TokenEstimator

PAGE_SIZE = 64


@dataclass(frozen=True, slots=True)
class HistoryWindow:
    messages: list[StoredMessage] = field(default_factory=list)  # oldest first
    tokens: int = 0  # estimated (scaled) tokens of the messages in the window
    budget: int = 0
    trimmed: int = 0  # older messages of the channel left out (= the newest left-out message's seq)
    newest_evicted_id: int | None = None  # the newest message left out, if any
    labelled: bool = True  # whether its turns carry speakers' labels (a group channel's), see message_cost

    @property
    def oldest_id(self) -> int | None:
        """The lowest id in the window (not always its first message: see :func:`in_reply_order`)."""
        return min(m.id for m in self.messages) if self.messages else None

    @property
    def over_budget(self) -> bool:
        return self.tokens > self.budget


ANOTHER_PERSONA = " (another persona, not you)"  # after the name of a reply another persona gave in a channel


def message_cost(message: StoredMessage, estimator: TokenEstimator, persona: str | None = None, *,
                 labelled: bool = True) -> int:
    """What a message costs in a prompt: a person's with the label it carries in a group channel's turns and in
    every transcript (see :func:`label_tokens`; unless not ``labelled``, a DM's window, whose turns are sent as
    written: its name is counted still, a few tokens to spare, but not the indentation of its further lines, which
    made a long pasted list cost an eighth more than it did). Its text alone was counted: many short messages under
    long names made a group's window and a summary's input several times their budgets. With ``persona`` (the one
    replying), a reply of another persona carries its label too (see :func:`by_another_persona`)."""
    if message.role == "user":
        label = label_tokens(message, estimator) if labelled else name_tokens(message, estimator)
    elif by_another_persona(message, persona):
        label = label_tokens(message, estimator) + estimator.raw_count(ANOTHER_PERSONA)
    else:
        label = 0
    return estimator.scale(message.token_count + label + PER_MESSAGE_OVERHEAD)


def by_another_persona(message: StoredMessage, persona: str | None) -> bool:
    """Whether ``message`` is a reply that a persona other than ``persona`` gave (the channel's persona was
    switched since): shown to ``persona`` as its own turn, it would take those words for its own."""
    return message.role == "assistant" and persona is not None and message.persona.casefold() != persona.casefold()


def name_tokens(message: StoredMessage, estimator: TokenEstimator) -> int:
    """The raw tokens of the author's name before a message's text ("Ann: ")."""
    return estimator.raw_count(message.author_name) + 1


def label_tokens(message: StoredMessage, estimator: TokenEstimator) -> int:
    """The raw tokens a message's text gains as a labelled turn or transcript entry: the author's name before it
    and the indentation of its further lines (:func:`bot.text.continued`; a line of CJK text can take 2 more)."""
    indented = continued(message.text)
    extra = 0 if indented == message.text else estimator.raw_count(indented) - estimator.raw_count(message.text)
    return name_tokens(message, estimator) + max(extra, 0)


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
    since: datetime | None = None,
    persona: str | None = None,
    labelled: bool = True,
) -> HistoryWindow:
    """The window of messages older than ``before_id`` (all when None); for ``viewer`` (user id, persona: the
    reply's), without others' incognito stretches (see ``Storage.recent_messages``); with ``since``, only what
    was said from then on (what the reply's author could see: ``IncomingMessage.history_from``). Costs are
    those of the turns shown to ``persona`` (else the viewer's; see :func:`message_cost`), ``labelled`` as a group
    channel's are (not a DM's).

    ``size_hint`` (how many messages the last window of this channel held) sizes the first read so
    that one query usually suffices; the result does not depend on it.
    """
    chosen: list[StoredMessage] = []
    tokens = 0
    user_messages = 0
    cursor = before_id
    page_size = size_hint + 8 if size_hint else PAGE_SIZE
    shown_to = persona or (None if viewer is None else viewer[1])  # (whose turns the costs are of)
    while True:
        page = await storage.recent_messages(channel_id, page_size, before_id=cursor, viewer=viewer,
                                             since=None if since is None else since.timestamp())
        for message in page:
            cost = message_cost(message, estimator, shown_to, labelled=labelled)
            if tokens + cost > budget and user_messages >= min_exchanges:
                chosen = in_reply_order(chosen[::-1])
                # seq counts the channel's messages, so everything up to the evicted one is left out.
                return HistoryWindow(chosen, tokens, budget, trimmed=message.seq, newest_evicted_id=message.id,
                                     labelled=labelled)
            chosen.append(message)
            tokens += cost
            if message.role == "user":
                user_messages += 1
        if len(page) < page_size:
            chosen.reverse()
            return HistoryWindow(in_reply_order(chosen), tokens, budget, labelled=labelled)
        cursor = page[-1].id
        page_size = max(page_size * 2, PAGE_SIZE)


def in_reply_order(messages: list[StoredMessage]) -> list[StoredMessage]:
    """``messages`` (oldest first) with each answer right after the user message it answers (after earlier
    answers to it); an answer to a message older than all of them comes first (its message went before
    them), and one whose message is missing for another reason (deleted, not shown) stays where it is."""
    if not messages:
        return messages
    asked = {m.id for m in messages if m.role == "user"}
    oldest = min(m.id for m in messages)
    answers: dict[int, list[StoredMessage]] = {}
    early: list[StoredMessage] = []
    rest: list[StoredMessage] = []
    for message in messages:
        if message.role == "assistant" and message.reply_to in asked:
            answers.setdefault(message.reply_to, []).append(message)
        elif message.role == "assistant" and message.reply_to is not None and message.reply_to < oldest:
            early.append(message)
        else:
            rest.append(message)
    if not answers and not early:
        return messages
    ordered: list[StoredMessage] = list(early)
    for message in rest:
        ordered.append(message)
        ordered.extend(answers.get(message.id, ()))
    return ordered


async def with_late_answers(
    storage: Storage, estimator: TokenEstimator, window: HistoryWindow, channel_id: int, message_id: int,
    viewer: tuple[int, str], min_exchanges: int = 0,
) -> HistoryWindow | None:
    """``window`` (of the messages before ``message_id``) with the answers to its messages that were stored
    after ``message_id`` (written while that message waited for its turn), each after its message; over the
    budget, the oldest messages make room for them as :func:`build_window` would have left them out. None:
    ``message_id`` is gone meanwhile (deleted on the platform, its author forgotten, its incognito stretch
    ended)."""
    asked = [m.id for m in window.messages if m.role == "user"]
    exists, late = await storage.answers_after(channel_id, message_id, asked, viewer)
    if not exists:
        return None
    if not late:
        return window
    merged = sorted((*window.messages, *late), key=lambda m: m.id)
    persona = viewer[1]
    return _within_budget(replace(window, messages=in_reply_order(merged),
                                  tokens=window.tokens + sum(message_cost(m, estimator, persona,
                                                                          labelled=window.labelled) for m in late)),
                          estimator, min_exchanges, persona)


def _within_budget(window: HistoryWindow, estimator: TokenEstimator, min_exchanges: int, persona: str
                   ) -> HistoryWindow:
    """``window`` without its oldest messages while it is over its budget, keeping ``min_exchanges`` user
    messages (those left out count as trimmed, for the summary)."""
    messages, tokens, users = list(window.messages), window.tokens, sum(m.role == "user" for m in window.messages)
    trimmed, evicted = window.trimmed, window.newest_evicted_id
    while tokens > window.budget and messages and not (messages[0].role == "user" and users <= min_exchanges):
        oldest = messages.pop(0)
        tokens -= message_cost(oldest, estimator, persona, labelled=window.labelled)
        users -= oldest.role == "user"
        trimmed, evicted = max(trimmed, oldest.seq), max(evicted or 0, oldest.id)
    return replace(window, messages=messages, tokens=tokens, trimmed=trimmed, newest_evicted_id=evicted)
