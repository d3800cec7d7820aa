"""Everyday chat sentences (English and German) unrelated to anyone's memory: the yardstick of the
relevance floor. A query's similarity to these says how similar *unrelated* text typically is to it
for the embedder in use; a memory counts as related by meaning only when it stands far above that
(see ``EmbeddingService.relevance_floors``). Written for this project; not tuned on any evaluation data.

The vectors of these sentences for the default embedder ship beside this file, embedded as passages
(``background-<name>.npy``) and as queries (``background-<name>-queries.npy``), both written by
``python -m cortex.memory.background``, so no process spends seconds embedding them. Their means are
the typical directions of the embedder's passages and queries, which the items' relevance floor takes
out before comparing (see ``cortex.memory.vectors.CentredFloor``).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import numpy.typing as npt

BACKGROUND: tuple[str, ...] = (
    'I went to the store this morning to buy some groceries.',
    'The weather has been really nice lately, lots of sunshine.',
    'My brother is visiting next weekend with his kids.',
    'I finally finished reading that book you recommended.',
    'We had pizza for dinner and watched a movie.',
    'Work has been stressful because of a big deadline.',
    'I started going to the gym three times a week.',
    'Our cat knocked a glass off the table again.',
    "I'm thinking about learning to play the guitar.",
    'The train was delayed by forty minutes today.',
    'She just got a new job at a software company.',
    "We're planning a trip to the mountains in summer.",
    'My phone battery dies way too fast these days.',
    'I tried a new recipe for lentil soup yesterday.',
    'The concert last night was absolutely amazing.',
    'I need to renew my passport before the holidays.',
    'He spent the whole afternoon fixing his bike.',
    'Do you have any tips for sleeping better?',
    'I painted the living room a light green colour.',
    'The kids have a school project about volcanoes.',
    "I'm volunteering at the animal shelter on Saturdays.",
    'We adopted a puppy from a rescue organisation.',
    'My grandmother turned ninety last month.',
    "I've been feeling a bit tired and unmotivated.",
    'The new café around the corner makes great coffee.',
    'I lost my keys and had to call a locksmith.',
    'We celebrated our anniversary at a small restaurant.',
    "I'm saving money to buy a car next year.",
    'The garden is full of tomatoes and zucchini now.',
    "He's training for a marathon in October.",
    'I started a course on photography online.',
    'Our neighbours are renovating their house and it is loud.',
    'I watched a documentary about deep sea creatures.',
    'She loves hiking and camping with her friends.',
    "I'm nervous about the job interview tomorrow.",
    'We went to the beach and built a huge sandcastle.',
    'My laptop crashed and I lost some files.',
    "I've been learning Spanish with an app.",
    'The museum had an exhibition about ancient Egypt.',
    "I'm trying to drink less coffee and more water.",
    'Thanks, that was really helpful!',
    "Haha, that's so funny.",
    'Good morning! How are you today?',
    'See you later, take care.',
    'That sounds like a great idea.',
    "I'm not sure, let me think about it.",
    'Congratulations, you deserve it!',
    'Sorry to hear that, I hope things get better.',
    'What have you been up to recently?',
    "Let's talk again tomorrow.",
    'The meeting was moved to Thursday afternoon.',
    'I prefer tea over coffee in the evening.',
    'My favourite season is autumn because of the colours.',
    "I'm allergic to cats, unfortunately.",
    'We play board games every Friday night.',
    'I grew up in a small town near the sea.',
    'My sister is studying medicine.',
    'I bought new running shoes.',
    'The printer at the office is broken again.',
    "I think I'm coming down with a cold.",
    'Ich war heute Morgen beim Bäcker und habe Brötchen gekauft.',
    'Das Wetter ist seit Tagen grau und regnerisch.',
    'Mein Bruder kommt am Wochenende zu Besuch.',
    'Wir haben gestern Abend einen Film geschaut.',
    'Die Arbeit ist gerade ziemlich stressig.',
    'Ich gehe jetzt dreimal die Woche ins Fitnessstudio.',
    'Unsere Katze hat wieder eine Tasse umgeworfen.',
    'Ich überlege, Klavier spielen zu lernen.',
    'Der Zug hatte heute eine Stunde Verspätung.',
    'Sie hat eine neue Stelle bei einer Versicherung.',
    'Im Sommer fahren wir in die Berge.',
    'Ich habe ein neues Rezept für Gemüsesuppe ausprobiert.',
    'Das Konzert gestern war großartig.',
    'Ich muss noch meinen Ausweis verlängern.',
    'Er hat den ganzen Nachmittag sein Fahrrad repariert.',
    'Hast du Tipps, wie man besser schläft?',
    'Wir haben einen Hund aus dem Tierheim geholt.',
    'Meine Oma ist letzten Monat neunzig geworden.',
    'Das neue Café an der Ecke hat sehr guten Kuchen.',
    'Ich habe meinen Schlüssel verloren.',
    'Danke, das hilft mir sehr!',
    'Guten Morgen, wie geht es dir?',
    "Bis später, mach's gut.",
    'Das klingt nach einer guten Idee.',
    'Tut mir leid, das zu hören.',
    'Was hast du in letzter Zeit so gemacht?',
    'Die Besprechung wurde auf Donnerstag verschoben.',
    'Ich trinke abends lieber Tee als Kaffee.',
    'Im Garten wachsen gerade viele Tomaten.',
    'Ich lerne gerade Italienisch mit einer App.',
)


def shipped_path(embedder_name: str, *, queries: bool = False) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", embedder_name)
    return Path(__file__).with_name(f"background-{name}{'-queries' if queries else ''}.npy")


def shipped_background(embedder_name: str, *, queries: bool = False) -> npt.NDArray[np.float32] | None:
    """The shipped vectors of ``BACKGROUND`` for this embedder (as passages, or as ``queries``), or None."""
    path = shipped_path(embedder_name, queries=queries)
    if not path.is_file():
        return None
    vectors = np.load(path, allow_pickle=False).astype(np.float32)
    return vectors if vectors.ndim == 2 and vectors.shape[0] == len(BACKGROUND) else None


if __name__ == "__main__":  # pragma: no cover - writes the shipped file for the default embedder
    from cortex.memory.embedders import create_embedder, embed_queries

    embedder = create_embedder("default")
    for as_queries, vectors in ((False, embedder.embed(list(BACKGROUND))),
                                (True, embed_queries(embedder, list(BACKGROUND)))):
        np.save(shipped_path(embedder.name, queries=as_queries), np.asarray(vectors, dtype=np.float16))
        print(f"wrote {shipped_path(embedder.name, queries=as_queries)}")  # noqa: T201
