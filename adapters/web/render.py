"""Markdown to safe HTML (raw HTML in the text is shown as text, never run) and a side-by-side diff.

Links and images stay the text they were written as: what a memory holds is written by its user and by the
model, and a live link to another site on the bot's own page would lend that site the page's trust."""

from __future__ import annotations

import asyncio
import hashlib
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from markdown_it import MarkdownIt

from cortex.diff import line_opcodes

_md = MarkdownIt("commonmark", {"html": False, "linkify": False}).disable(["image", "link", "autolink", "reference"])


def markdown_html(text: str) -> str:
    html: str = _md.render(text)
    return html


ENTRY_COST = 256  # characters a kept HTML counts beyond its own: its key and the dictionary's share


class HtmlRenderer:
    """Markdown's HTML for the page. ``render`` is pure Python (about 7 µs a character: 50-60 ms for a file at
    the default cap, and the text is the user's own), so it runs on worker threads, ``slots`` at a time, and one
    at a time per user: one user's many requests queue behind each other and never take every slot. Each
    text's HTML is kept per user (the least recently shown dropped past ``max_chars`` in all, each counting
    ``ENTRY_COST`` more): a version never changes, so showing it again costs nothing. A user's forget-me
    drops theirs, and a render that was running then is not kept."""

    def __init__(self, render: Callable[[str], str], *, slots: int = 2, max_chars: int = 4_000_000) -> None:
        self._render = render
        self._slots = asyncio.Semaphore(slots)
        self._users: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._kept: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._chars = 0
        self._max_chars = max_chars
        self._forgotten: dict[str, int] = {}  # owner -> forget-mes so far (a render started before one is not kept)

    async def html(self, owner: str, text: str) -> str:
        key = (owner, hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest())
        lock = self._users.get(owner)
        if lock is None:  # (held here while used: the dictionary forgets it once no request holds it)
            lock = self._users[owner] = asyncio.Lock()
        async with lock:
            html = self._kept.get(key)
            if html is not None:
                self._kept.move_to_end(key)
                return html
            forgotten = self._forgotten.get(owner, 0)
            async with self._slots:
                html = await asyncio.to_thread(self._render, text)
            if self._forgotten.get(owner, 0) == forgotten:
                self._keep(key, html)
        return html

    def _keep(self, key: tuple[str, bytes], html: str) -> None:
        cost = len(html) + ENTRY_COST
        if cost > self._max_chars // 4:
            return
        self._kept[key] = html
        self._chars += cost
        while self._chars > self._max_chars:
            _, dropped = self._kept.popitem(last=False)
            self._chars -= len(dropped) + ENTRY_COST

    def forget(self, owner: str) -> None:
        """Drop what was kept of ``owner``'s texts (their forget-me, from the chat or the page)."""
        self._forgotten[owner] = self._forgotten.get(owner, 0) + 1
        for key in [k for k in self._kept if k[0] == owner]:
            self._chars -= len(self._kept.pop(key)) + ENTRY_COST


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
