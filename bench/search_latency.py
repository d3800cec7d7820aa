"""Memory search latency at 10k and 100k items per pair, with real embeddings.

Fills one user-persona pair with synthetic memory items (templates over names, places, hobbies,
dates: "Ann's sister Mia moved to Lyon in March 2021") and times ``MemoryStore.search`` on them:

* **search**: the search itself (full text + vector + ranking) with a precomputed query vector;
* **embed**: the query's embedding alone (``EmbeddingService.embed_query``, the bot's query embedder);
* **end-to-end**: ``search`` embedding the query itself, as the reply path does.

Real vectors: the default embedder (multilingual-e5-small) manages only ~50 texts/s on 2 cores, so
embedding 100k items would take over half an hour. ``--real`` distinct item texts (default 2,000) are
really embedded; every other item is a variant of one of them (the same sentence with its date, day
or hour drawn anew) and gets that text's real vector plus small Gaussian noise, re-normalised (cosine
~0.97 to its source, about what e5 gives for such variants). The query vectors are real.

The first search of a pair loads its vectors into the cache: that load is timed on its own, and the
timed searches follow a warm-up. Memory: the target is the bot's RSS with the embedder loaded, so
after each bulk fill the benchmark frees its own setup data (and returns free heap to the OS with
glibc's malloc_trim), resets the process's peak RSS (Linux ``/proc/self/clear_refs``) and reports
the peak of the bot phase (both embedders loaded, vector cache load, searches); the process peak
including the setup is printed too. Sizes run in the given order in one process, each in a fresh
app and database; ratios are against the first size.

    python bench/search_latency.py [--sizes 10000 100000] [--queries 300] [--real 2000] [--json]
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
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.core_overhead import InstantProvider  # noqa: E402
from bot.app import App  # noqa: E402
from bot.config import parse_config  # noqa: E402
from cortex.memory.embedders import normalize  # noqa: E402
from cortex.memory.store import CATEGORIES  # noqa: E402

TARGET_P95_MS = {10_000: 5.0, 100_000: 20.0}  # search p95 on the 2-core machine
TARGET_RSS_MB = 350.0
NOISE = 0.0125  # per dimension: |noise| ≈ 0.25 over 384 dims, cosine ≈ 0.97 to the real vector
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
    await embeddings.embed_query("warm-up")


async def fill_pair(app: App, pair_id: int, size: int, sample: list[tuple[int, dict[str, str], str]],
                    vectors: np.ndarray, seed: int) -> float:
    """Bulk-insert ``size`` items (setup only): real texts and vectors first, then noisy variants."""
    embeddings = app.cortex.embeddings
    assert embeddings is not None
    model = embeddings.model
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    now = time.time()
    started = time.perf_counter()
    async with app.storage.transaction() as db:
        for start in range(0, size, FILL_CHUNK):
            stop = min(start + FILL_CHUNK, size)
            donors = np.arange(start, stop) % len(sample)
            chunk = vectors[donors]
            variant = np.arange(start, stop) >= len(sample)
            if variant.any():
                chunk[variant] += nrng.normal(0.0, NOISE, size=(int(variant.sum()), vectors.shape[1])).astype(
                    np.float32)
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
                created = now - rng.uniform(0, 730 * 86_400)
                rows.append((pair_id, rng.choice(CATEGORIES), "", text, rng.randint(1, 10), 0, "[]", "user", "",
                             created, created, chunk[n].tobytes(), model))
            await db.executemany(
                "INSERT INTO memory_items (pair_id, category, key, content, importance, pinned, tags, source,"
                " source_ref, created_at, updated_at, embedding, embedding_model)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            del rows, chunk
    await app.storage.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # measure on a settled database
    return time.perf_counter() - started


async def measure(size: int, args: argparse.Namespace, workdir: Path, state: dict[str, Any]) -> dict[str, Any]:
    config = parse_config({"storage": {"url": f"sqlite:///{workdir / f'search-{size}.db'}"}})
    app = App(config, llm=InstantProvider())
    await app.start(workers=False)  # no backfill: every item already has a vector of the current embedder
    result: dict[str, Any] = {"size": size}
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
        user = await app.storage.upsert_user("console:bench", "Bench")
        pair = await app.cortex.store.count_messages(user.id, PERSONA, 0)
        fill_seconds = await fill_pair(app, pair.id, size, state["sample"], state["vectors"], args.seed + size)
        result["fill_s"] = fill_seconds
        result["peak_reset"] = settle_memory()
        result["rss_bot_start_mb"] = rss_mb()

        started = time.perf_counter()
        block = await embeddings.index.items(pair.id)
        result["load_ms"] = (time.perf_counter() - started) * 1000
        result["cached_vectors"] = len(block.ids)
        result["rss_loaded_mb"] = rss_mb()
        print(f"{size:>7} items: filled in {fill_seconds:.1f} s; vector cache load {result['load_ms']:.0f} ms "
              f"({len(block.ids)} vectors, RSS {result['rss_bot_start_mb']:.0f} → {result['rss_loaded_mb']:.0f} MB)")

        queries: list[str] = state["queries"]
        embed_ms: list[float] = []
        vectors = []
        for query in queries:  # (b) the query embedding alone
            t0 = time.perf_counter()
            vector = await embeddings.embed_query(query)
            embed_ms.append((time.perf_counter() - t0) * 1000)
            assert vector is not None
            vectors.append(vector)
        for i in range(WARMUP):
            await memory.search(pair.id, queries[i % len(queries)], query_vector=vectors[i % len(queries)],
                                include_messages=False)
        search_ms: list[float] = []
        hits = 0
        for query, vector in zip(queries, vectors, strict=True):  # (a) the search with a precomputed vector
            t0 = time.perf_counter()
            found = await memory.search(pair.id, query, limit=10, query_vector=vector, include_messages=False)
            search_ms.append((time.perf_counter() - t0) * 1000)
            hits += len(found)
        e2e_ms: list[float] = []
        for query in queries:  # (c) end to end: the search embeds the query itself
            t0 = time.perf_counter()
            await memory.search(pair.id, query, limit=10, include_messages=False)
            e2e_ms.append((time.perf_counter() - t0) * 1000)
        result["search"] = p50_p95(search_ms)
        result["embed"] = p50_p95(embed_ms)
        result["e2e"] = p50_p95(e2e_ms)
        result["hits_per_query"] = hits / len(queries)
        result["rss_end_mb"] = rss_mb()
        result["rss_bot_peak_mb"] = rss_mb("VmHWM") if result["peak_reset"] else float("nan")
        return result
    finally:
        await app.stop()


def print_report(results: list[dict[str, Any]], state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    print()
    print(f"{'items':>8} | {'search p50':>10} {'p95':>7} | {'embed p50':>9} {'p95':>7} | {'e2e p50':>8} {'p95':>7}"
          f" | {'load':>7} | {'RSS bot':>7} {'peak':>6}")
    for r in results:
        print(f"{r['size']:>8} | {r['search']['p50']:7.2f} ms {r['search']['p95']:7.2f} | "
              f"{r['embed']['p50']:6.2f} ms {r['embed']['p95']:7.2f} | {r['e2e']['p50']:5.2f} ms {r['e2e']['p95']:7.2f}"
              f" | {r['load_ms']:4.0f} ms | {r['rss_end_mb']:4.0f} MB {r['rss_bot_peak_mb']:4.0f} MB")
    print(f"({args.queries} queries per size after {WARMUP} warm-up searches; search = FTS + vector + ranking with a "
          f"precomputed query vector; embed = embed_query alone; e2e = search embedding the query itself; "
          f"load = first search's vector cache load; RSS bot = after the searches, peak = bot phase incl. the load)")
    base = results[0]
    ratios: dict[str, dict[str, float]] = {}
    for r in results[1:]:
        key = f"{r['size']}/{base['size']}"
        ratios[key] = {f"{part}_{q}": r[part][q] / base[part][q] for part in ("search", "embed", "e2e")
                       for q in ("p50", "p95")}
        ratios[key]["load"] = r["load_ms"] / base["load_ms"]
        ratio = ratios[key]
        print(f"ratio {key}: search p50 ×{ratio['search_p50']:.2f} p95 ×{ratio['search_p95']:.2f}   "
              f"embed p50 ×{ratio['embed_p50']:.2f}   e2e p50 ×{ratio['e2e_p50']:.2f} p95 ×{ratio['e2e_p95']:.2f}   "
              f"load ×{ratio['load']:.1f}")
    targets: dict[str, dict[str, Any]] = {}
    for r in results:
        limit = TARGET_P95_MS.get(r["size"])
        if limit is not None:
            ok = r["search"]["p95"] <= limit
            targets[f"search_p95_{r['size']}"] = {"value": r["search"]["p95"], "limit": limit, "pass": ok}
            print(f"target search p95 ≤ {limit:g} ms at {r['size']}: {r['search']['p95']:.2f} ms "
                  f"{'PASS' if ok else 'MISS'}   (end-to-end p95 {r['e2e']['p95']:.2f} ms, for information)")
    bot_peak = max(r["rss_bot_peak_mb"] for r in results)
    if bot_peak == bot_peak:  # not NaN: the peak could be reset after the setup
        ok = bot_peak <= TARGET_RSS_MB
        targets["rss_bot_peak"] = {"value": bot_peak, "limit": TARGET_RSS_MB, "pass": ok}
        print(f"target bot RSS with the embedder loaded ≤ {TARGET_RSS_MB:g} MB: peak {bot_peak:.0f} MB at "
              f"{max(results, key=lambda r: r['rss_bot_peak_mb'])['size']} items {'PASS' if ok else 'MISS'}   "
              f"(steady after the searches: {max(r['rss_end_mb'] for r in results):.0f} MB)")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"RSS with both embedders loaded, no items: {state['rss_embedder_mb']:.0f} MB; "
          f"process peak RSS incl. the benchmark's bulk fill: {peak_mb:.0f} MB")
    return {
        "real": len(state["sample"]), "embed_real_seconds": state["embed_real_seconds"], "queries": args.queries,
        "rss_embedder_mb": state["rss_embedder_mb"], "peak_rss_mb": peak_mb,
        "sizes": {str(r["size"]): {k: v for k, v in r.items() if k != "size"} for r in results},
        "ratios": ratios, "targets": targets,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000], help="items in the pair")
    parser.add_argument("--queries", type=int, default=300, help="measured queries per size (default 300)")
    parser.add_argument("--real", type=int, default=2000, help="distinct item texts really embedded (default 2000)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the synthetic texts and noise")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    args = parser.parse_args()
    if args.queries < 2 or args.real < 1 or min(args.sizes) < 1:
        parser.error("--queries must be at least 2, --real and --sizes positive")
    rng = random.Random(args.seed)
    state: dict[str, Any] = {"sample": real_texts(args.real, rng), "queries": query_texts(args.queries, rng)}
    print(f"load average before the run: {os.getloadavg()[0]:.2f} (2 cores: other work on the machine skews figures)")
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            results.append(await measure(size, args, Path(tmp), state))
            gc.collect()
    figures = print_report(results, state, args)
    print(f"total run time {time.perf_counter() - started:.0f} s; load average after it: {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    asyncio.run(main())
