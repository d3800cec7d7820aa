"""Errors the core raises toward adapters. Each carries ``user_message``, safe to show in chat.

    UserFacingError
     ├── EmptyMessage      nothing to answer
     ├── MessageTooLong    over ``[bot] max_message_chars``; not stored, the user keeps their text
     └── StretchEnded      an incognito stretch ended while its message waited for its turn (deleted with it)

:class:`MessageWithdrawn` (not user-facing: nobody is left to tell) ends a reply to a message its author
took back on the platform before the bot got to it.

LLM failures are :class:`bot.llm.errors.LLMError` (also with ``user_message``); the user's message
is already stored when they happen.
"""

from __future__ import annotations

# A log record's attribute (``extra={USER_TOLD: True}``): the person saw this failure where their reply would have
# been. The operator's log keeps it; a terminal chat, where the operator is that person, leaves it out.
USER_TOLD = "user_told"


class UserFacingError(Exception):
    user_message = "Something went wrong."

    def __init__(self, user_message: str | None = None) -> None:
        if user_message:
            self.user_message = user_message
        super().__init__(self.user_message)


class EmptyMessage(UserFacingError):
    user_message = "There is nothing to answer: the message is empty."


class MessageTooLong(UserFacingError):
    pass


class StretchEnded(UserFacingError):
    """A message of an incognito stretch was still waiting for its turn when the stretch ended: it went with the
    stretch's other messages, unanswered."""

    user_message = ("Not answered: this message was part of your incognito stretch, which ended while it waited "
                    "for its turn, so it was deleted with the rest of the stretch.")


class MessageWithdrawn(Exception):
    """The message was deleted on its platform (its author, a moderator) before its reply was stored: the reply
    ends in silence, and nothing of the message is kept."""
