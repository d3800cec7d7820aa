"""Markdown to safe HTML (raw HTML in the text is shown as text, never run) and a side-by-side diff.

Links and images stay the text they were written as: what a memory holds is written by its user and by the
model, and a live link to another site on the bot's own page would lend that site the page's trust."""

from __future__ import annotations

import difflib
from typing import Any

from markdown_it import MarkdownIt

_md = MarkdownIt("commonmark", {"html": False, "linkify": False}).disable(["image", "link", "autolink", "reference"])


def markdown_html(text: str) -> str:
    html: str = _md.render(text)
    return html


def side_by_side(old: str, new: str) -> list[dict[str, Any]]:
    """Rows of a two-column diff: ``op`` (equal, replace, delete, insert), each side's line number and text
    (None where that side has no line)."""
    a, b = old.splitlines(), new.splitlines()
    rows: list[dict[str, Any]] = []
    # autojunk (difflib's default, as the chat's diff): without it a file of repeated lines ("a" 4,000 times
    # against "a", "b" 2,000 times, within the size cap) took minutes of CPU per request, one a second 1.3 s.
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b).get_opcodes():
        for k in range(max(i2 - i1, j2 - j1)):
            left = i1 + k if i1 + k < i2 else None
            right = j1 + k if j1 + k < j2 else None
            rows.append({
                "op": op,
                "left_no": None if left is None else left + 1, "left": None if left is None else a[left],
                "right_no": None if right is None else right + 1, "right": None if right is None else b[right],
            })
    return rows
