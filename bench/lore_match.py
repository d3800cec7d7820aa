"""What a persona's lore costs a reply: choosing the entries whose keys the conversation mentions.

Builds ``--entries`` lore entries with ``--keys`` one-word keys each (plus two multi-word keys), as a large
imported character card's lore book has them, and times ``LoreIndex.chosen`` (keyword matches and the
word search) on a few hundred characters of conversation, against the way it matched before in the same
process (``baseline``: one regular expression per key and reply, the ``re`` module's cache of 512 patterns
overflowing, and each entry's words worked out again at every search). Prints the time per reply of both,
their ratio, and whether both chose the same entries.

    python bench/lore_match.py [--entries 500] [--keys 50] [--replies 20] [--phrases 2] [--text-chars N]

``--text-chars 44000 --phrases 50`` times a long conversation (the message before a new one can be a
40,000-character reply; the matching looks at its last 4,000) against the matching just before it (each
entry's keys of several words as one alternation behind lookbehinds: seconds per message).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bot.storage.personas import LoreEntry  # noqa: E402
from cortex.personas.lore import LoreIndex, search, words  # noqa: E402

TEXT = ("I was reading about key3_4 and the old harbour of New Harbour 7 yesterday, and my sister asked "
        "whether the dragons of the northern valley still guard word17. ") * 3


def baseline_chosen(entries: list[LoreEntry], recent: str, message: str) -> list[LoreEntry]:
    """The matching as it was: one pattern per key, compiled through ``re``'s cache."""
    def mentions(text: str, key: str) -> bool:
        key = key.strip()
        if not key:
            return False
        pattern = re.escape(key.casefold())
        if key[0].isalnum():
            pattern = r"(?<!\w)" + pattern
        if key[-1].isalnum():
            pattern += r"(?!\w)"
        return re.search(pattern, text.casefold()) is not None

    def keyword_match(entry: LoreEntry) -> bool:
        if not any(mentions(recent, k) for k in entry.keys):
            return False
        return not entry.secondary_keys or any(mentions(recent, k) for k in entry.secondary_keys)

    picked = [e for e in entries if e.always_on or keyword_match(e)]
    docs = [(e, words(e.content) | words(" ".join(e.keys))) for e in entries]  # the search, words anew
    found = search([e for e, _ in docs], message, skip=frozenset(e.id for e in picked))
    picked.sort(key=lambda e: (not e.always_on, -e.priority, e.id))
    return picked + found


def alternation_chosen(entries: list[LoreEntry], recent: str, message: str) -> list[LoreEntry]:
    """The matching before the phrases: each entry's keys of several words as one alternation of patterns,
    each behind a lookbehind (which keeps ``re`` from searching for a literal), over the whole text."""
    text = recent.casefold()
    text_words = set(re.findall(r"\w+", text))

    def pattern(key: str) -> str:
        out = re.escape(key)
        return (r"(?<!\w)" if key[0].isalnum() else "") + out + (r"(?!\w)" if key[-1].isalnum() else "")

    def found(keys: tuple[str, ...]) -> bool:
        folded = [k.strip().casefold() for k in keys if k.strip()]
        if any(re.fullmatch(r"\w+", k) and k in text_words for k in folded):
            return True
        others = [pattern(k) for k in folded if not re.fullmatch(r"\w+", k)]
        compiled = _ALTERNATIONS.get(tuple(others))
        if compiled is None:
            compiled = _ALTERNATIONS[tuple(others)] = re.compile("|".join(f"(?:{p})" for p in others))
        return bool(others) and compiled.search(text) is not None

    picked = [e for e in entries if e.always_on or (found(tuple(e.keys)) and (
        not e.secondary_keys or found(tuple(e.secondary_keys))))]
    hits = search(entries, message, skip=frozenset(e.id for e in picked))
    picked.sort(key=lambda e: (not e.always_on, -e.priority, e.id))
    return picked + hits


_ALTERNATIONS: dict[tuple[str, ...], re.Pattern[str]] = {}  # (compiled once, as the code did)


def lore(count: int, keys: int, rng: random.Random, phrases: int = 2) -> list[LoreEntry]:
    now = datetime.now(UTC)
    return [LoreEntry(i, 1, f"entry {i}", " ".join(f"word{rng.randrange(5000)}" for _ in range(80)),
                      (*(f"key{i}_{k}" for k in range(keys)), f"New Harbour {i}", f"old road {i}",
                       *(f"{rng.choice(NAMES)} {rng.choice(NAMES)} {i}_{p}" for p in range(phrases - 2))),
                      (), False, 0, True, "card", "", now) for i in range(count)]


NAMES = ("harbour", "valley", "dragon", "tower", "river", "mill", "forest", "king", "road", "sea")


def timed(choose: object, entries: list[LoreEntry], replies: int, text: str = TEXT) -> tuple[float, list[int]]:
    spent, chosen = [], []
    for _ in range(replies):
        started = time.perf_counter()
        chosen = [e.id for e in choose(entries, text, "tell me about word17 and word42")]  # type: ignore[operator]
        spent.append((time.perf_counter() - started) * 1000)
    return statistics.median(spent), chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=500)
    parser.add_argument("--keys", type=int, default=50, help="one-word keys per entry (two multi-word ones besides)")
    parser.add_argument("--replies", type=int, default=20)
    parser.add_argument("--phrases", type=int, default=2, help="keys of several words per entry (default 2)")
    parser.add_argument("--text-chars", type=int, default=0,
                        help="a conversation this long (the message before can be a 40,000-character reply) "
                             "against the matching with one alternation per entry, instead of the default")
    args = parser.parse_args()
    entries = lore(args.entries, args.keys, random.Random(7), max(args.phrases, 2))
    now = LoreIndex.__new__(LoreIndex).chosen
    keys = args.keys + max(args.phrases, 2)
    if args.text_chars:  # the long-text case, against the code just before
        rng = random.Random(3)
        text = (TEXT + " ".join(rng.choice(NAMES + ("the", "and", "of")) for _ in range(args.text_chars // 4)))
        text = text[:args.text_chars]
        timed(now, entries, 1, text)
        timed(alternation_chosen, entries, 1, text)
        before, before_ids = timed(alternation_chosen, entries, args.replies, text)
        after, after_ids = timed(now, entries, args.replies, text)
        print(f"{args.entries} lore entries × {keys} keys, {len(text):,} characters of conversation, "
              f"median of {args.replies} replies")
        print(f"baseline (an alternation per entry)  {before:8.2f} ms per reply")
        print(f"now (phrases, their words first)     {after:8.2f} ms per reply   ratio now/baseline "
              f"×{after / before:.3f}")
        print(f"same entries chosen: {before_ids == after_ids} ({len(after_ids)} chosen)")
        return
    timed(now, entries, 1)  # warm-up: the patterns are made once
    before, before_ids = timed(baseline_chosen, entries, args.replies)
    after, after_ids = timed(now, entries, args.replies)
    print(f"{args.entries} lore entries × {keys} keys, {len(TEXT)} characters of conversation, "
          f"median of {args.replies} replies")
    print(f"baseline (a pattern per key)   {before:8.2f} ms per reply")
    print(f"now (prepared once per entry)  {after:8.2f} ms per reply   ratio now/baseline ×{after / before:.3f}")
    print(f"same entries chosen: {before_ids == after_ids} ({len(after_ids)} chosen)")


if __name__ == "__main__":
    main()
