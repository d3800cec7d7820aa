"""A reasoning model's private thinking, when an OpenAI-compatible server leaves it in the answer's text.

Qwen3, DeepSeek-R1 and their kin write ``<think>…</think>`` before the answer; Ollama, LM Studio or a
llama.cpp server without a reasoning parser pass it through as content. Shown, it put the model's notes about
the person (and whatever it weighed not saying) into the chat, into the stored reply, into every later
request and into summaries. Only a block at the very start counts as thinking: a ``<think>`` later in an
answer is text the model meant to write. (Some chat templates open the block themselves, and then only its end
arrives: that is not told apart from an answer that writes the tag.)
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


class ThinkingFilter:
    """Feeds a streamed answer through, holding back a leading ``<think>…</think>`` block (and the blank
    space after it); the rest passes as it comes."""

    def __init__(self) -> None:
        self._state = "start"  # start -> thinking -> after -> text
        self._held = ""

    def feed(self, piece: str) -> str:
        """The part of ``piece`` to show (may be "")."""
        if self._state == "text":
            return piece
        self._held += piece
        if self._state == "start":
            begun = self._held.lstrip()
            if not begun or (OPEN.startswith(begun) and begun != OPEN):
                return ""  # (maybe the start of "<think>": wait for more)
            if not begun.startswith(OPEN):
                return self._pass()
            self._state, self._held = "thinking", begun[len(OPEN):]
        if self._state == "thinking":
            end = self._held.find(CLOSE)
            if end < 0:
                self._held = self._held[-(len(CLOSE) - 1):]  # (only what may be the start of "</think>")
                return ""
            self._state, self._held = "after", self._held[end + len(CLOSE):]
        rest = self._held.lstrip()
        if not rest:
            return ""
        self._held = rest
        return self._pass()

    @property
    def unfinished(self) -> bool:
        """Whether a thinking block opened and never closed (the answer's length ran out while it thought)."""
        return self._state == "thinking"

    @property
    def thought(self) -> bool:
        """Whether a thinking block came, and nothing after it yet."""
        return self._state in ("thinking", "after")

    def end(self) -> str:
        """What was held back at the end that is answer (an unfinished "<th…" start was text after all)."""
        return self._held if self._state == "start" else ""

    def _pass(self) -> str:
        shown, self._held, self._state = self._held, "", "text"
        return shown


def without_thinking(text: str) -> str:
    """A whole answer without a ``<think>…</think>`` block at its start. (A ``</think>`` alone, from a block the
    chat template opened, is not taken as one: an answer may well write that tag, in code say.)"""
    begun = text.lstrip()
    if begun.startswith(OPEN) and CLOSE in begun:
        return begun[begun.index(CLOSE) + len(CLOSE):].lstrip()
    return text
