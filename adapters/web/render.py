"""Markdown to safe HTML (raw HTML in the text is shown as text, never run) and a side-by-side diff.

Links and images stay the text they were written as: what a memory holds is written by its user and by the
model, and a live link to another site on the bot's own page would lend that site the page's trust."""

from __future__ import annotations

from typing import Any

from markdown_it import MarkdownIt

from cortex.diff import line_opcodes

_md = MarkdownIt("commonmark", {"html": False, "linkify": False}).disable(["image", "link", "autolink", "reference"])


def markdown_html(text: str) -> str:
    html: str = _md.render(text)
    return html


def side_by_side(old: str, new: str) -> list[dict[str, Any]]:
    """Rows of a two-column diff: ``op`` (equal, replace, delete, insert), each side's line number and text
    (None where that side has no line); bounded work, as :mod:`cortex.diff` says."""
    a, b = old.splitlines(), new.splitlines()
    opcodes = line_opcodes(a, b)
    rows: list[dict[str, Any]] = []
    for op, i1, i2, j1, j2 in opcodes:
        for k in range(max(i2 - i1, j2 - j1)):
            left = i1 + k if i1 + k < i2 else None
            right = j1 + k if j1 + k < j2 else None
            rows.append({
                "op": op,
                "left_no": None if left is None else left + 1, "left": None if left is None else a[left],
                "right_no": None if right is None else right + 1, "right": None if right is None else b[right],
            })
    return rows
