"""Full-text helpers shared by the engines: a persona language's PostgreSQL text-search configuration,
and user text turned into a safe query for FTS5 (SQLite) or ``to_tsquery`` (PostgreSQL)."""

from __future__ import annotations

import re

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


def tsquery(terms: list[str]) -> str:
    """FTS terms (as made by ``fts_query``: quoted words) as a ``to_tsquery`` text: the words OR-ed.
    Words are ``\\w+`` only, so quoting each is enough to keep the query's syntax intact."""
    words = [t.strip('"') for t in terms]
    return " | ".join(f"'{w}'" for w in words if _WORD.fullmatch(w))
