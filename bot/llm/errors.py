"""Errors an LLM provider raises, independent of the SDK behind it.

    LLMError                      base; ``user_message`` is safe to show to a chat user
     ├── LLMTransientError        worth retrying later (background jobs back off and retry)
     │    ├── LLMRateLimited      429
     │    ├── LLMOverloaded       529 / 503
     │    ├── LLMServerError      other 5xx
     │    ├── LLMTimeout          request timed out
     │    └── LLMConnectionError  server unreachable
     │         └── LLMBrokenOff   …or the connection broke while the answer came
     └── LLMPermanentError        retrying will not help
          ├── LLMAuthError        bad or missing API key (401/403)
          ├── LLMOutOfCredit      billing / quota exhausted (402, or 429 "insufficient_quota")
          ├── LLMBadRequest       the request was rejected (400/404/422: unknown model, too long, ...)
          └── LLMBadResponse      the server answered with something that is not a valid response
               ├── LLMRefused     …because the provider's content filter stopped it before any text
               ├── LLMOnlyThought …because a reasoning model only thought (its length ran out first)
               └── LLMDamagedResponse  …because it arrived damaged (cut off, HTML from a proxy): transient

Providers translate their SDK's exceptions into this tree (``bot.llm.anthropic``/``bot.llm.openai``);
nothing above the provider layer catches SDK exceptions. Messages never contain API keys.
"""

from __future__ import annotations

import re

from bot.text import plural


class LLMError(Exception):
    """Base class. ``str(err)`` is a technical description for logs; ``user_message`` is for users."""

    user_message = "The language model failed to answer."
    transient = False
    retry_after: float | None = None  # seconds the server asked to wait (Retry-After), when it said
    # The tokens a request that failed part way was billed for, as far as the stream had said (input, output):
    # a stream that breaks after its start has been billed for its whole input.
    billed: tuple[int, int] = (0, 0)

    def __init__(self, detail: str = "", *, status_code: int | None = None) -> None:
        super().__init__(detail or self.user_message)
        self.detail = detail or self.user_message
        self.status_code = status_code


class LLMTransientError(LLMError):
    transient = True


class LLMPermanentError(LLMError):
    transient = False


class LLMRateLimited(LLMTransientError):
    """A 429. Its message names the wait the server asked for when that is longer than a minute or so (a daily
    quota's Retry-After: 86400 is not "in a minute")."""

    _said: str | None = None

    @property
    def user_message(self) -> str:
        return self._said or f"The language model is rate-limited right now. Please try again {_in(self.retry_after)}."

    @user_message.setter
    def user_message(self, text: str) -> None:  # (set as on any LLMError: that text then)
        self._said = text


def _in(seconds: float | None) -> str:
    """A wait as people say it, roughly: "in a minute" up to 90 s (or when none was asked for)."""
    if seconds is None or seconds <= 90:
        return "in a minute"
    if (minutes := max(round(seconds / 60), 2)) < 60:
        return f"in about {plural(minutes, 'minute')}"
    if (hours := max(round(seconds / 3600), 1)) < 48:
        return f"in about {plural(hours, 'hour')}"
    return f"in about {plural(round(seconds / 86400), 'day')}"


class LLMOverloaded(LLMTransientError):
    user_message = "The language model is overloaded right now. Please try again shortly."


class LLMServerError(LLMTransientError):
    user_message = "The language model's server had an error. Please try again shortly."


class LLMTimeout(LLMTransientError):
    user_message = "The language model took too long to answer. Please try again."


class LLMConnectionError(LLMTransientError):
    user_message = "The language model's server cannot be reached. Please try again later."


class LLMBrokenOff(LLMConnectionError):
    """The connection broke while the answer came (the server closed it, a proxy reset it)."""

    user_message = "The language model's answer broke off before it was complete. Please try again."


class LLMAuthError(LLMPermanentError):
    user_message = "The bot's API key for the language model was rejected. An admin needs to fix it."


class LLMOutOfCredit(LLMPermanentError):
    user_message = "The bot's language-model account is out of credit. An admin needs to top it up."


class LLMBadRequest(LLMPermanentError):
    user_message = "The language model rejected the request."

    def __init__(self, detail: str = "", *, status_code: int | None = None) -> None:
        super().__init__(detail, status_code=status_code)
        # The server's own words say what to fix (an unknown model, a prompt too long): show them, as one line
        # (a proxy may send its whole traceback).
        said = _first_words(detail.split(": ", 1)[1]) if ": " in detail else ""
        if said or status_code:
            status = f"HTTP {status_code}" if status_code else ""
            reason = "; ".join(part for part in (status, said) if part)
            self.user_message = f"The language model rejected the request ({reason})."


SAID_CHARS = 300


HTML_PAGE = re.compile(r"<\s*(?:!doctype|html|head|body)\b", re.IGNORECASE)
# HTML's own tags (not "1 <= n <= 4096", "<class 'str'>" or "<provider>/<model>", which say what to fix)
_TAG = re.compile(r"</?(?:a|b|i|p|br|hr|em|h[1-6]|li|ol|ul|tr|td|th|div|pre|img|code|font|link|meta|span|small|style|"
                  r"table|title|center|script|strong|noscript)(?:\s[^<>]*)?/?>", re.IGNORECASE)


def _first_words(said: str) -> str:
    """A server's error text as one line for chat: before any traceback, without markup, whitespace collapsed,
    cut at ``SAID_CHARS``; nothing when it holds no words (a bare list or number) or is a web page (a proxy's
    error page: its title and server banner say nothing a person can act on, and its markup is no chat)."""
    if HTML_PAGE.search(said):
        return ""
    said = _TAG.sub(" ", said.split("Traceback (most recent call last)", 1)[0])
    said = " ".join(said.split())
    if not any(c.isalpha() for c in said):
        return ""
    return said if len(said) <= SAID_CHARS else said[:SAID_CHARS].rstrip() + "…"


class LLMBadResponse(LLMPermanentError):
    user_message = "The language model sent a response the bot could not read."


class LLMNoAnswer(LLMBadResponse):
    """Every round called tools, the last one too, though it was asked to answer in text (some compatible
    servers ignore ``tool_choice: none``)."""

    user_message = "The language model kept calling tools and wrote no answer. Please try again."


class LLMRefused(LLMBadResponse):
    """The provider's safety filter stopped the answer before any text (Anthropic's ``refusal``, OpenAI's
    ``content_filter``)."""

    user_message = "The language model's provider declined to answer that (its content filter)."


class LLMOnlyThought(LLMBadResponse):
    """A reasoning model's answer was all thinking, never closed: its length (``max_tokens``) ran out first."""

    user_message = ("The language model spent its whole answer thinking and wrote no reply. An admin may raise "
                    "[llm] max_tokens.")


class LLMDamagedResponse(LLMBadResponse):
    """An answer that arrived damaged: a body cut short, a stream that ended early, a proxy's HTML page in
    place of JSON. The server may well answer properly next time, so background jobs retry it (a wrong
    shape of an answer that did arrive whole stays permanent)."""

    user_message = "The language model's answer arrived damaged. Please try again."
    transient = True
