"""Function words of the languages the personas mostly speak (English, German): matching them finds nothing.

Memory search leaves them out of its full-text queries (bm25 scored every message holding "the") and the lore
search out of the words a message shares with an entry (an entry holding "the" came in for any message)."""

from __future__ import annotations

STOPWORDS = frozenset("""
a about after again all also am an and any are as at be been before being but by can could did do does
doing down during each few for from had has have having he her here hers him his how i if in into is it
its just me more most my no nor not now of off on once only or other our out over own same she should
so some such than that the their them then there these they this those through to too under until up
very was we were what when where which while who whom why will with would you your yours
aber alle als also am an auch auf aus bei bin bis bist da damit dann das dass dem den der des die dies doch
du durch ein eine einem einen einer er es für hat hatte ich ihr im in ist ja kann mein mit nach nicht
noch nun nur ob oder sich sie sind so um und uns von vor war was wenn wer wie wir wird wo zu zum zur
""".split())
