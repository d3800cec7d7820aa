"""Full-text helpers shared by the engines: a persona language's PostgreSQL text-search configuration,
user text turned into a safe query for FTS5 (SQLite, :func:`fts5_match`) or ``to_tsquery`` (PostgreSQL), and a
bm25-like score of rows whose matched words FTS5 marked (see :func:`marked_ranks`)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import product

from bot.storage.engine import Tx

_WORD = re.compile(r"\w+", re.UNICODE)

# PostgreSQL's built-in configurations, by English name, native name and ISO 639-1 code.
_CONFIGS: dict[str, str] = {}
for _config, _names in {
    "arabic": "arabic ar العربية", "armenian": "armenian hy", "basque": "basque eu euskara",
    "catalan": "catalan ca català", "danish": "danish da dansk", "dutch": "dutch nl nederlands",
    "english": "english en", "finnish": "finnish fi suomi", "french": "french fr français francais",
    "german": "german de deutsch", "greek": "greek el ελληνικά", "hindi": "hindi hi",
    "hungarian": "hungarian hu magyar", "indonesian": "indonesian id", "irish": "irish ga gaeilge",
    "italian": "italian it italiano", "lithuanian": "lithuanian lt", "nepali": "nepali ne",
    "norwegian": "norwegian no nb nn norsk", "portuguese": "portuguese pt português portugues",
    "romanian": "romanian ro română romana", "russian": "russian ru русский", "serbian": "serbian sr",
    "spanish": "spanish es español espanol castellano", "swedish": "swedish sv svenska",
    "tamil": "tamil ta", "turkish": "turkish tr türkçe turkce", "yiddish": "yiddish yi",
}.items():
    for _name in _names.split():
        _CONFIGS[_name] = _config


def text_search_config(language: str) -> str:
    """The PostgreSQL text-search configuration for a persona's language ("English", "Deutsch", "fr",
    "pt-BR"…), ``simple`` (no stemming, no stop words) when none fits."""
    words = language.strip().lower().replace("_", "-").split("-")
    return _CONFIGS.get(words[0].strip(), "simple") if words else "simple"


async def restem(tx: Tx, dialect: str, persona: str) -> None:
    """On PostgreSQL, in the transaction that changed the persona's text-search configuration: its messages'
    and memory items' words stemmed again by it. Their tsvectors are made by triggers when the text is written,
    so they kept the old language's stems, which a query in the new one no longer meets ("running" stored as
    English "run", searched as German "running": nothing found)."""
    if dialect != "postgres":
        return  # (SQLite stems English for every persona)
    await tx.execute("UPDATE messages SET ts = cortex_tsvector(cortex_ts_config(persona), author_name || ' ' || text)"
                     " WHERE lower(persona) = lower(?)", (persona,))
    await tx.execute("UPDATE memory_items SET ts = cortex_tsvector(cortex_ts_config(p.persona), memory_items.content"
                     " || ' ' || memory_items.key || ' ' || memory_items.tags) FROM cortex_pairs AS p"
                     " WHERE p.id = memory_items.pair_id AND lower(p.persona) = lower(?)", (persona,))


def tsquery(terms: list[str]) -> str:
    """FTS terms (as made by ``fts_query``: quoted words) as a ``to_tsquery`` text: the words OR-ed.
    Words are ``\\w+`` only, so quoting each is enough to keep the query's syntax intact."""
    words = [t.strip('"') for t in terms]
    return " | ".join(f"'{w}'" for w in words if _WORD.fullmatch(w))


_SHARP_S = re.compile("ss|ß")
_OTHER_SPELLING = {"ss": "ß", "ß": "ss"}


def fts5_match(terms: Iterable[str]) -> str:
    """FTS terms (as made by ``fts_query``: quoted words) as SQLite's ``MATCH`` expression: the words OR-ed, one
    holding "ss" or "ß" with its other spellings too. FTS5's tokenizer keeps the two apart ("Strasse" never found
    "Straße", "groß" never "GROSS"), where PostgreSQL's German configuration folds them."""
    return " OR ".join(_spelled(term) for term in terms)


def _spelled(term: str) -> str:
    found = _SHARP_S.findall(term)
    if not found:
        return term
    parts = _SHARP_S.split(term.strip('"'))  # (a quoted word is \w+ only: quoting each spelling is enough)
    # each "ss" and "ß" either way, of a word of one or two: four spellings at most; of more, all one way
    choices = product(*((s, _OTHER_SPELLING[s]) for s in found)) if len(found) <= 2 else (
        found, ["ß"] * len(found), ["ss"] * len(found))
    spellings = dict.fromkeys(parts[0] + "".join(c + p for c, p in zip(chosen, parts[1:], strict=True))
                              for chosen in choices)
    return "(" + " OR ".join(f'"{w}"' for w in spellings) + ")" if len(spellings) > 1 else term


MARK_OPEN, MARK_CLOSE = "\x01", "\x02"  # what FTS5's highlight() puts around a matched word
_MARKED = re.compile(f"{MARK_OPEN}(.*?){MARK_CLOSE}", re.DOTALL)
K1, B = 1.2, 0.75  # bm25's term-frequency saturation and length normalisation


def marked_ranks(marked: Sequence[str]) -> list[float]:
    """A bm25-like rank (negative, lower is better, as FTS5's ``bm25()``) of each text in ``marked``,
    where FTS5's ``highlight()`` marked the query's words: each matched word (as written, lower-cased)
    counts with bm25's saturation of its frequency and the text's length against the mean of these texts.

    For the newest matches of words that are all common (see ``MemoryStore._bounded``): FTS5's ``bm25()``
    first counts every row each word matches, for its idf, which costs as much as ranking all matches;
    the idf of such words is low and alike, so every word weighs the same here."""
    # The marks are no word characters: the words of a marked text are those of the text. A query word is
    # one phrase, so one mark holds one word (or the pieces of one, as "e-mail"): counted as one term.
    found = [(Counter(map(str.lower, _MARKED.findall(text))), len(_WORD.findall(text))) for text in marked]
    mean = sum(length for _, length in found) / len(found) if found else 1.0
    return [-sum((tf * (K1 + 1) / (tf + K1 * (1 - B + B * length / max(mean, 1.0))) for tf in words.values()), 0.0)
            for words, length in found]
