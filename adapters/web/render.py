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


DIFF_WORK = 50_000  # line pairs difflib may weigh (repeated lines make it cubic): past that, one changed block


def side_by_side(old: str, new: str) -> list[dict[str, Any]]:
    """Rows of a two-column diff: ``op`` (equal, replace, delete, insert), each side's line number and text
    (None where that side has no line). The lines both versions start and end with are equal rows; the rest
    is diffed by difflib while it is small enough to be quick (a file of 4,000 repeated lines took minutes of
    CPU without its junk heuristic, and 2 s with it), else shown as one replaced block."""
    a, b = old.splitlines(), new.splitlines()
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    ends_a, ends_b = len(a) - tail, len(b) - tail
    if (ends_a - head) * (ends_b - head) <= DIFF_WORK:
        middle = [(op, i1 + head, i2 + head, j1 + head, j2 + head) for op, i1, i2, j1, j2 in
                  difflib.SequenceMatcher(a=a[head:ends_a], b=b[head:ends_b]).get_opcodes()]
    else:
        middle = [("replace", head, ends_a, head, ends_b)]
    opcodes = [("equal", 0, head, 0, head), *middle, ("equal", ends_a, len(a), ends_b, len(b))]
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
