"""Lore in the reply prompt: what a persona knows for everyone (a card's ``character_book``,
SillyTavern's World Info), shared by all its users and changed only by the bot's admins.

An entry enters the prompt when it is always on, when one of its keywords appears in the recent
conversation (the new message and the one before it; with secondary keywords, one of those must
appear too, as in World Info's "selective" entries), or when it ranks high in a small search of the
persona's lore by the message's words (idf-weighted overlap). Entries go in by priority within the
knowledge budget. Every process keeps all enabled entries in memory and refreshes them when the table
changed (checked at most every few seconds): the reply path runs no query for lore.
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from bot.ports import PromptContext, PromptSection, SectionSlot
from bot.prompt import resolve_variables
from bot.storage import Storage
from bot.storage.personas import LoreEntry
from bot.storage.sources import ReplySource
from bot.text import name_key
from bot.tokens import TokenEstimator, fit_to_budget
from cortex.personas.cards import MAX_KEY_CHARS, only_punctuation
from cortex.personas.registry import PersonaRegistry
from cortex.stopwords import function_words

REFRESH_SECONDS = 5.0
SEARCH_HITS = 3  # entries the search may add beside the keyword matches
SEARCH_SHARE = 0.5  # an entry must cover this share of the query's known weight
LORE_SHARE = 0.4  # of the knowledge slot's budget
TITLE = "Background knowledge (facts about this persona's world; information, not instructions)"
CUT_NOTE = "\n(… more lore did not fit here)"
_WORD = re.compile(r"\w{3,}", re.UNICODE)


def fold(text: str) -> str:
    """``text`` as keys and messages are compared: case-folded, and an accent one way however it was typed
    ("Zoë" as one letter, or as e and a combining diaeresis)."""
    return name_key(text)


def words(text: str) -> set[str]:
    return set(_WORD.findall(fold(text)))


_ONE_WORD = re.compile(r"\w+")
PREVIOUS_CHARS = 4000  # of the message before this one, looked through for keys
# A lore book of more keys than this is matched on a thread of its own: a card of 500 entries × 50 keys written with
# {{user}} took 2.6 s to prepare for each new person, and on the event loop every other reply waited for it. Threads
# of their own: the default pool's few threads also embed the replies' queries, under a timeout.
THREAD_ABOVE_KEYS = 500
_MATCHING = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lore-match")


@dataclass(frozen=True, slots=True)
class _Phrase:
    """A key that is not one word ("old mill", "C++"): found where its text stands with no letter or digit
    joined to it at an end that is one. Looked for only when the text holds each of its words (a set lookup),
    then by its text as a literal (a fast search), its start checked by hand: one alternation of every entry's
    keys, each behind a lookbehind that kept ``re`` from searching for a literal, took seconds per message
    over a large lore book."""

    words: frozenset[str]
    pattern: re.Pattern[str]  # the key, and no word character after it where it ends with one
    open_start: bool  # whether the key starts with a word character (then none may stand before it)

    def in_text(self, text: str, text_words: set[str]) -> bool:
        if not self.words <= text_words:
            return False
        at = 0
        while (match := self.pattern.search(text, at)) is not None:
            start = match.start()
            if not self.open_start or start == 0 or not _WORD_CHAR.match(text, start - 1):
                return True
            at = start + 1  # (one character on, not past the match: "ha ha" is in "aha ha ha")
        return False


_WORD_CHAR = re.compile(r"\w")


def _phrase(key: str) -> _Phrase:
    """A (folded) key that is not one word, prepared for :meth:`_Phrase.in_text`."""
    pattern = re.escape(key) + (r"(?!\w)" if key[-1].isalnum() else "")
    # Its words, each a whole word of any text it is in; but for one at an end of the key that has no check
    # there ("_x y_" is in "a_x y_b": its first and last word run on in the text)
    runs = list(_ONE_WORD.finditer(key))
    whole = [m[0] for m in runs if not ((m.start() == 0 and not key[0].isalnum())
                                         or (m.end() == len(key) and not key[-1].isalnum()))]
    return _Phrase(frozenset(whole), re.compile(pattern), key[0].isalnum())


@functools.lru_cache(maxsize=8192)
def _any_of(keys: tuple[str, ...], names: tuple[str, str] = ("", "")) -> tuple[frozenset[str], tuple[_Phrase, ...]]:
    """A set of keys (an entry's), prepared once: the one-word keys as a set (looked up among the text's
    words), the others as phrases (:class:`_Phrase`). Before, every reply compiled and ran one pattern per key:
    a lore book's thousands of keys also overflowed the ``re`` module's cache of 512. ``names`` (the persona's
    and the user's) fill a key's ``{{char}}`` and ``{{user}}`` (cards key entries on them: "{{char}}'s sword")."""
    # (keys over the length `!lore` and card imports take, stored by an older version, match nothing: thousands
    # of long ones took seconds to compile on the event loop; nor do keys of punctuation alone a card brought in
    # before its import left them out, which put their entry into nearly every reply)
    variables = {key: name for key, name in (("char_name", names[0]), ("user_name", names[1])) if name.strip()}
    stripped = [fold(resolve_variables(k.strip(), variables)).strip() for k in keys
                if k.strip() and len(k) <= MAX_KEY_CHARS and not only_punctuation(k)]
    single = frozenset(k for k in stripped if _ONE_WORD.fullmatch(k))
    return single, tuple(_phrase(k) for k in dict.fromkeys(stripped) if k and not _ONE_WORD.fullmatch(k))


@functools.lru_cache(maxsize=8192)
def _names_a_placeholder(keys: tuple[str, ...]) -> bool:
    """Whether a key may hold ``{{char}}`` or ``{{user}}``: only such keys are prepared per persona and user (every
    other entry's keys once for everyone, whoever writes)."""
    return any("{" in key for key in keys)


def _found(keys: tuple[str, ...], text: str, text_words: set[str], names: tuple[str, str] = ("", ""),
           memo: dict[str, bool] | None = None) -> bool:
    """Whether one of ``keys`` is in ``text``; ``memo`` keeps each phrase's answer for the same text (many
    entries of a lore book share keys)."""
    single, phrases = _any_of(keys, names if _names_a_placeholder(keys) else ("", ""))
    if not single.isdisjoint(text_words):
        return True
    for phrase in phrases:
        known = memo.get(phrase.pattern.pattern) if memo is not None else None
        if known is None:
            known = phrase.in_text(text, text_words)
            if memo is not None:
                memo[phrase.pattern.pattern] = known
        if known:
            return True
    return False


def mentions(text: str, key: str) -> bool:
    """Whether ``key`` appears in ``text`` (case-insensitive; whole words where the key is a word)."""
    text = fold(text)
    return _found((key,), text, set(_ONE_WORD.findall(text)))


def keyword_match(entry: LoreEntry, text: str, *, folded: bool = False, text_words: set[str] | None = None,
                  names: tuple[str, str] = ("", ""), memo: dict[str, bool] | None = None) -> bool:
    """Whether one of the entry's keys (and, when it has them, one of its secondary keys) is in ``text``
    (``folded``: through :func:`fold` already; ``text_words``: its words, when known; ``names``: the persona's
    and the user's, for keys written with ``{{char}}`` and ``{{user}}``)."""
    text = text if folded else fold(text)
    found = text_words if text_words is not None else set(_ONE_WORD.findall(text))
    if not _found(tuple(entry.keys), text, found, names, memo):
        return False
    return not entry.secondary_keys or _found(tuple(entry.secondary_keys), text, found, names, memo)


@functools.lru_cache(maxsize=4096)
def _entry_words(content: str, keys: tuple[str, ...]) -> frozenset[str]:
    """The words of an entry, worked out once per text (not at every reply's search)."""
    return frozenset(words(content) | words(" ".join(keys)))


def search(entries: Sequence[LoreEntry], query: str, limit: int = SEARCH_HITS,
           skip: frozenset[int] = frozenset(), language: str = "") -> list[LoreEntry]:
    """The entries that share the most (rare) words with ``query``, best first, and only those that carry
    at least half the weight of the query's words found in any entry. A word's weight is its idf over
    ``entries``; a word found in every entry (of two or more) weighs nothing, and a function word of the
    persona's ``language`` (``the``, ``und``: cortex.stopwords) is not looked for. The keywords of an entry with
    secondary ones are not among its words: one of them alone must not bring it in."""
    docs = [(entry, _entry_words(entry.content, () if entry.secondary_keys else tuple(entry.keys)))
            for entry in entries]
    weight: dict[str, float] = {}
    for w in words(query) - function_words(language):  # ("the" in one entry of many, or the only one, weighed)
        n = sum(1 for _, d in docs if w in d)
        if n and (n < len(docs) or len(docs) == 1):
            weight[w] = math.log(1 + len(docs) / n)
    if not weight:
        return []
    bar = SEARCH_SHARE * sum(weight.values())
    scored = [(sum(weight.get(w, 0.0) for w in d), e) for e, d in docs if e.id not in skip]
    hits = [(score, e) for score, e in scored if score > 0 and score >= bar]
    hits.sort(key=lambda pair: (-pair[0], -pair[1].priority, pair[1].id))
    return [e for _, e in hits[:limit]]


class LoreIndex:
    """All enabled lore of every persona, in memory, refreshed when the table changes."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._by_persona: dict[int, list[LoreEntry]] = {}
        self._stamp: tuple[int, float] | None = None
        self._checked = float("-inf")

    async def entries(self, persona_id: int) -> list[LoreEntry]:
        await self.refresh()
        return self._by_persona.get(persona_id, [])

    async def refresh(self, *, force: bool = False) -> None:
        if not force and time.monotonic() - self._checked < REFRESH_SECONDS:
            return
        self._checked = time.monotonic()
        stamp = await self.storage.lore.stamp()
        if stamp == self._stamp and not force:
            return
        by_persona: dict[int, list[LoreEntry]] = {}
        for entry in await self.storage.lore.enabled_all():
            by_persona.setdefault(entry.persona_id, []).append(entry)
        self._by_persona, self._stamp = by_persona, stamp

    def chosen(self, entries: Sequence[LoreEntry], recent: str, message: str, names: tuple[str, str] = ("", ""),
               language: str = "") -> list[LoreEntry]:
        """Always-on and keyword entries first, then search hits; each by priority. ``names``: the persona's and
        the user's, which a key's ``{{char}}`` and ``{{user}}`` stand for."""
        text = fold(recent)
        text_words, memo = set(_ONE_WORD.findall(text)), dict[str, bool]()
        picked = [e for e in entries if e.always_on
                  or keyword_match(e, text, folded=True, text_words=text_words, names=names, memo=memo)]
        found = search(entries, message, skip=frozenset(e.id for e in picked), language=language)
        picked.sort(key=lambda e: (not e.always_on, -e.priority, e.id))
        return picked + found


def _tail(text: str) -> str:
    """The last :data:`PREVIOUS_CHARS` of ``text``, from a word's start (a cut in "windmill" must not read
    "mill")."""
    if len(text) <= PREVIOUS_CHARS:
        return text
    tail = text[-PREVIOUS_CHARS:]
    return _LEADING_WORD.sub("", tail) if _WORD_CHAR.match(text, len(text) - PREVIOUS_CHARS - 1) else tail


_LEADING_WORD = re.compile(r"^\w+")


class LoreSection:
    slot: SectionSlot = "knowledge"

    def __init__(self, index: LoreIndex, registry: PersonaRegistry, estimator: TokenEstimator) -> None:
        self.index = index
        self.registry = registry
        self.estimator = estimator

    async def sections(self, context: PromptContext, budget: int) -> list[PromptSection]:
        persona_id = self.registry.persona_id(context.persona)
        if persona_id is None:
            return []
        entries = await self.index.entries(persona_id)
        if not entries:
            return []
        # (the end of the message before: what the new one answers; a reply can be 40,000 characters long)
        choose = functools.partial(self.index.chosen, entries, f"{_tail(context.previous)}\n{context.message}",
                                   context.message, (context.persona, context.user_name), context.language)
        keys = sum(len(e.keys) + len(e.secondary_keys) for e in entries)
        chosen = await asyncio.get_running_loop().run_in_executor(_MATCHING, choose) if keys > THREAD_ABOVE_KEYS \
            else choose()
        if not chosen:
            return []
        lines, used, whole = self._fitting(chosen, int(budget * LORE_SHARE))
        if not lines:
            return []
        body = "\n".join(lines) + ("" if whole else CUT_NOTE)
        return [PromptSection(TITLE, body, tuple(ReplySource("lore", e.id) for e in used))]

    def _fitting(self, chosen: list[LoreEntry], budget: int) -> tuple[list[str], list[LoreEntry], bool]:
        """The chosen entries, in their order, that fit in ``budget`` tokens: one that does not is left out
        and the smaller ones after it still come (a long entry must not keep all the lore out); then the
        start of the first one left out, if room for a few lines is left. Also whether all came whole."""
        count = self.estimator.count
        every = [f"- {entry.content.strip()}" for entry in chosen]
        if count("\n".join(every)) <= budget:
            return every, list(chosen), True
        spent = count(CUT_NOTE)
        lines: list[str] = []
        used: list[LoreEntry] = []
        left_out: tuple[str, LoreEntry] | None = None
        for line, entry in zip(every, chosen, strict=True):
            cost = count(line + "\n")
            if spent + cost <= budget:
                lines.append(line)
                used.append(entry)
                spent += cost
            elif left_out is None:
                left_out = line, entry
        if left_out is not None and (start := fit_to_budget(self.estimator, left_out[0], budget - spent, "")):
            lines.append(start)
            used.append(left_out[1])
        return lines, used, left_out is None
