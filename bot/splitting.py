"""Splitting long replies at a platform's message limit without breaking Markdown code blocks.

Cuts prefer, in order: a paragraph break, a line break, a sentence end, a space, and only then a
hard cut. A cut inside a fenced code block closes the fence at the end of the piece and reopens it
(with the same info string, e.g. ```python) at the start of the next, so every piece renders.
As in CommonMark, a backtick fence's info string holds no backtick: ```ls -la``` on a line of its
own is inline code, not the start of a block. A reopened fence carries at most a short info string
(a language name), and a marker longer than ``MAX_MARKER`` opens nothing, so what is repeated on
every piece stays small.
"""

from __future__ import annotations

import re

_FENCE = re.compile(r"^\s*(```+|~~~+)(.*)$")
MAX_INFO = 24  # a longer info string is not repeated on the next piece (a language name is short)
MAX_MARKER = 16  # a longer opening marker opens nothing here
MIN_LIMIT = 2 * (MAX_MARKER + 1) + MAX_INFO + 8  # a piece holds a reopened fence, some text and the closing


def _open_fence_after(text: str, state: tuple[str, str] | None) -> tuple[str, str] | None:
    """The fence (marker, info) still open after ``text``, given the one open before it. The info kept is
    what a reopened piece repeats: empty when the line's was long."""
    for line in text.split("\n"):
        match = _FENCE.match(line)
        if not match:
            continue
        marker, info = match.group(1), match.group(2).strip()
        if state is None:
            if len(marker) <= MAX_MARKER and not (marker[0] == "`" and "`" in info):
                # (an info starting with the marker's character would lengthen the reopened marker: "~~~" and
                # "~python" make "~~~~python", which the closing "~~~" cannot close)
                state = (marker, info if len(info) <= MAX_INFO and not info.startswith(marker[0]) else "")
        elif marker.startswith(state[0][0]) and len(marker) >= len(state[0]) and not info:
            state = None  # a closing fence: the opener's character, at least as long, no info string
    return state


def closing_fence(text: str) -> str:
    """The line that closes a code block ``text`` leaves open ("```"), or "" when it leaves none open."""
    fence = _open_fence_after(text, None)
    return fence[0] if fence else ""


def _best_cut(text: str, limit: int) -> int:
    window = text[:limit]
    for separator in ("\n\n", "\n"):
        index = window.rfind(separator)
        if index >= limit // 3:
            return index + len(separator)
    sentence = max(window.rfind(". "), window.rfind("! "), window.rfind("? "))
    if sentence >= limit // 3 and not _starts_fence(text, sentence + 2):
        return sentence + 2
    space = window.rfind(" ")
    while space >= limit // 3 and _starts_fence(text, space + 1):
        space = window.rfind(" ", 0, space)
    if space >= limit // 3:
        return space + 1
    cut = limit
    while cut > 1 and _starts_fence(text, cut):  # (a character of the word before the marker goes with it)
        cut -= 1
    return cut


def _starts_fence(text: str, at: int) -> bool:
    """Whether a cut at ``at`` would start the next piece with a fence's marker: "```" inside a line (inline code)
    would open a code block there, and the rest of that piece would show as code."""
    return text[at:at + 16].lstrip(" \t").startswith(("```", "~~~"))  # (a marker may be indented)


def split_message(text: str, limit: int) -> list[str]:
    """Pieces of ``text`` each at most ``limit`` characters (an empty text gives no pieces)."""
    if limit < MIN_LIMIT:
        raise ValueError(f"limit must be at least {MIN_LIMIT}: room to close and reopen a code fence")
    pieces: list[str] = []
    rest = text
    fence: tuple[str, str] | None = None
    while rest:
        prefix = f"{fence[0]}{fence[1]}\n" if fence else ""
        body_limit = limit - len(prefix)
        if len(rest) <= body_limit:
            pieces.append((prefix + rest).rstrip())
            break
        cut = _best_cut(rest, body_limit)
        after = _open_fence_after(rest[:cut], fence)
        if after is not None:  # the cut falls inside a code block: leave room to close the fence
            cut = _best_cut(rest, body_limit - len(after[0]) - 1)
            after = _open_fence_after(rest[:cut], fence)
        piece_body, rest = rest[:cut], rest[cut:]
        fence = after
        piece = prefix + piece_body
        if fence:
            piece = piece.rstrip("\n") + f"\n{fence[0]}"
        pieces.append(piece.rstrip() if not fence else piece)
        rest = rest.lstrip("\n") if not fence else rest
    return [p for p in pieces if p.strip()]
