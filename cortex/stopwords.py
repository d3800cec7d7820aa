"""Function words of the languages the personas mostly speak (English, German): matching them finds nothing.

Memory search leaves the function words of the persona's language out of its full-text queries
(:func:`search_stopwords`; bm25 scored every message holding "the"); the lore search leaves out those of
:func:`function_words`: an entry holding "the" came in for any message. Each language's own list matters: German's
"war", "die", "hat", "bin" and "den" are English words that say something ("tell me about the war").
"""

from __future__ import annotations

from bot.storage.textsearch import text_search_config

ENGLISH = frozenset("""
a about after again all also am an and any are as at be been before being but by can could did do does
doing down during each few for from had has have having he her here hers him his how i if in into is it
its just me more most my no nor not now of off on once only or other our out over own same she should
so some such than that the their them then there these they this those through to too under until up
very was we were what when where which while who whom why will with would you your yours
""".split())

GERMAN = frozenset("""
aber alle als also am an auch auf aus bei bin bis bist da damit dann das dass dem den der des die dies doch
du durch ein eine einem einen einer er es für hat hatte ich ihr im in ist ja kann mein mit nach nicht
noch nun nur ob oder sich sie sind so um und uns von vor war was wenn wer wie wir wird wo zu zum zur
""".split())

STOPWORDS = ENGLISH | GERMAN

# German function words that are English words with a meaning of their own: not dropped where the language is
# not known to be German.
_ENGLISH_TOO = frozenset({"war", "die", "hat", "bin", "den", "nun", "dies", "bis", "mit", "von", "des", "dem"})


_NOT_GERMAN = ENGLISH | (GERMAN - _ENGLISH_TOO)  # both lists, less the German ones English uses as words


def function_words(language: str) -> frozenset[str]:
    """The function words to leave out of a search in a persona's ``language`` ("English", "de", "Deutsch"…):
    its own list; for any other language both, less the German ones English uses as words."""
    config = text_search_config(language)
    if config == "english":
        return ENGLISH
    if config == "german":
        return GERMAN
    return _NOT_GERMAN


def search_stopwords(language: str) -> frozenset[str]:
    """The words a memory search in a persona's ``language`` leaves out: for an English persona both lists less
    the German ones English uses as words ("war", "hat", "mit": an English persona's search for them found
    nothing); for any other both, also for a language written in a way no configuration knows ("Deutsch
    (Österreich)"), where "war" and "mit" are most likely German. People write English or German to a persona of
    either language: "how are you?" and "wie geht es dir?" match nothing by their words with either."""
    return _NOT_GERMAN if text_search_config(language) == "english" else STOPWORDS
