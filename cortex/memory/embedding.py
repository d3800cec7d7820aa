"""Embeddings for the memory store, computed in the background and at query time.

* **Backfill** (a scheduler job, every ``memory.backfill_seconds``): items without a vector of the
  current embedder, then the pairs' messages (newest first) when ``memory.embed_messages``, in
  batches on a thread of its own at lower CPU priority (the offline default embeds on every core,
  whose worker threads inherit that priority), for at most ``memory.backfill_max_seconds`` per run.
  New items are searchable by text at once and by meaning once the backfill reached them. A changed
  embedder makes every stored vector stale (each carries the embedder's name), so the same job
  re-embeds everything, reporting progress in the log and in :meth:`EmbeddingService.status`
  (``!cortex embedder``).
* **Queries** (the reply path and ``!memory search``): one embedding on a second embedder instance,
  so a query never queues behind a backfill batch; bounded by ``memory.query_timeout_seconds``, after
  which the search runs on full text alone. The offline default embeds a query on two threads (the
  backfill's run at a lower priority): about 40 % faster per query on a quiet machine, about the same
  as one thread on a busy one, since its threads wait without spinning. The reply path
  starts a query's embedding the moment its message arrives (:meth:`EmbeddingService.prefetch_query`),
  while the message is stored and the prompt is built; the search then picks up that very embedding
  (the last ``QUERY_CACHE`` queries are kept by text).

An embedder error (a server down, a bad answer) never reaches a user: the query falls back to text,
the backfill stops the run, keeps the error for the status and tries again next time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from bot.config import ConfigError, MemoryConfig, read_secret
from bot.storage.core import Storage
from bot.storage.engine import Row
from cortex.memory.background import BACKGROUND, shipped_background
from cortex.memory.embedders import Embedder, EmbedderError, create_embedder, embed_queries, usable_cores
from cortex.memory.vectors import CentredFloor, RelevanceFloors, VectorSearch

log = logging.getLogger(__name__)
Vector = npt.NDArray[np.float32]
T = TypeVar("T")

# With nothing to embed, finding that out read all of the users' messages at every run (every minute; 31-47 ms at
# 100k messages): a run reads those above the newest message id a complete run saw (less MARK_WINDOW, for inserts
# that committed after a later id), and only every FULL_SCAN_SECONDS all of them again (a deletion drops the vector
# of the message after the deleted one, to be embedded again with what is left before it: in another process too).
MARK_WINDOW = 1000
FULL_SCAN_SECONDS = 600.0
BATCH = 256  # texts the backfill reads and embeds at once: the more, the less padding (64: 105 texts/s, 256: 131)
QUERY_CACHE = 256  # query vectors kept by their text (a prefetched one, a repeated search)
# How long a search someone asked for (a command, the page, the persona's search tool) tries again for its query's
# vector after the reply path's memory.query_timeout_seconds ran out. The model's first load (its first query in
# a process) takes longer than a reply may wait: the first !memory search found only what matched by words.
PATIENT_QUERY_SECONDS = 30.0
# What a hit found by meaning alone needs (relevance_floors): its cosine to the query with the embedder's
# typical directions taken out of both (CentredFloor), for an item and for a past message.
ITEM_CENTRED = 0.21
MESSAGE_CENTRED = 0.15
BACKFILL_NICENESS = 10
BACKFILL_THREADS = 4
QUERY_THREADS = 2
QUERY_WORKERS = 4  # query embeddings (and the yardstick's check) started at once


@dataclass(frozen=True, slots=True)
class Yardstick:
    """The relevance yardstick of the embedder: the means of ``BACKGROUND`` as passages and as queries
    (the embedder's typical directions)."""

    mean_passage: npt.NDArray[np.float32]
    mean_query: npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class BackfillReport:
    items: int = 0
    messages: int = 0
    seconds: float = 0.0
    error: str = ""
    more: bool = False  # stopped by the time limit with work left


@dataclass(frozen=True, slots=True)
class EmbedderStatus:
    model: str
    items_total: int
    items_embedded: int
    messages_total: int
    messages_embedded: int
    last_run: BackfillReport | None
    last_run_at: float | None
    last_error: str
    texts_per_second: float

    @property
    def pending(self) -> int:
        return self.items_total - self.items_embedded + self.messages_total - self.messages_embedded


def _lower_priority() -> None:
    """Give the backfill's thread a lower CPU priority (Linux: per thread), so on a small machine the
    event loop and query embeddings win when they compete with bulk embedding."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKFILL_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


def build_embedders(config: MemoryConfig) -> tuple[Embedder, Embedder] | None:
    """Two instances of the configured embedder (backfill, queries), or None for ``embedder = "none"``."""
    if config.embedder == "none":
        return None
    if config.embedder == "openai":
        env = config.embedder_api_key_env  # ("": no key, for a server that takes none, as [llm] api_key_env)
        key = read_secret(env) if env else None
        named = bool(env) and env != MemoryConfig.model_fields["embedder_api_key_env"].default
        if key is None and (named or not config.embedder_base_url):  # OpenAI's own API (or a named key) needs one
            if not env:
                raise ConfigError("[memory] embedder = \"openai\" without embedder_base_url is OpenAI's own API, which "
                                  "needs a key: name the variable holding it in embedder_api_key_env")
            raise ConfigError(
                f"[memory] embedder = \"openai\" needs its API key in ${env}, which is not set"
                + ("" if named else " (a server that takes no key: set embedder_base_url)"))

        def make() -> Embedder:
            return create_embedder(
                "openai", model=config.embedder_model, base_url=config.embedder_base_url, api_key=key
            )

        return make(), make()
    # The backfill uses every core (up to BACKFILL_THREADS) at its lower priority; a query two.
    backfill = create_embedder("default", threads=min(BACKFILL_THREADS, usable_cores()), batches=True)
    return backfill, create_embedder("default", threads=min(QUERY_THREADS, usable_cores()))


class EmbeddingService:
    def __init__(
        self,
        storage: Storage,
        embedder: Embedder,
        query_embedder: Embedder,
        index: VectorSearch,
        config: MemoryConfig,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.storage = storage
        self.embedder = embedder
        self.query_embedder = query_embedder
        self.index = index
        self.config = config
        self.clock = clock
        self.last_run: BackfillReport | None = None
        # message model -> (the newest message id a complete backfill run saw, when the last full scan began)
        self._marks: dict[str, tuple[int, float]] = {}
        self.last_run_at: float | None = None
        self.last_error = ""
        self._rate = 0.0
        self._query_failures = 0
        self._executor: ThreadPoolExecutor | None = None  # the backfill's own, low-priority thread
        # Queries and the yardstick's check: not the loop's default executor, which asyncio.run waits for at the
        # end (a model still being built kept a stopped chat alive); dropped at close instead.
        self._query_executor: ThreadPoolExecutor | None = None
        self._background: asyncio.Future[Yardstick | None] | None = None  # relevance yardstick
        self._queries: OrderedDict[str, asyncio.Future[Vector | None]] = OrderedDict()  # by query text

    def close(self) -> None:
        # Not cancelled: a reply or job still waiting on one gets its vector (the thread runs anyway).
        self._queries.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self._query_executor is not None:
            self._query_executor.shutdown(wait=False)  # (a query still awaited at close gets its answer)
            self._query_executor = None

    def _in_query_thread(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self._query_executor is None:
            self._query_executor = ThreadPoolExecutor(QUERY_WORKERS, thread_name_prefix="embed-query")
        return asyncio.get_running_loop().run_in_executor(self._query_executor, fn, *args)

    @property
    def model(self) -> str:
        return self.embedder.name

    @property
    def message_model(self) -> str:
        """The tag of message vectors: the embedder and how a message's text is put together."""
        return message_model(self.embedder.name)

    async def backlog_line(self) -> str:
        """For someone who just added a lot (an import): found by words at once, by meaning when?"""
        status = await self.status()
        if not status.pending:
            return "All of it can be found by its words and by its meaning now."
        when = (f"in about {max(1, round(status.pending / status.texts_per_second / 60)):,} min"
                if status.texts_per_second > 0 else "as the background embedding gets to it")
        return f"All of it can be found by its words now, and by its meaning {when}."

    # -- queries ---------------------------------------------------------------------------------

    def forget_queries(self) -> None:
        """Drop the kept query vectors (a benchmark timing cold queries; nothing else needs it)."""
        self._queries.clear()

    def prefetch_query(self, text: str) -> None:
        """Start embedding ``text`` as a search query and return at once: a search for the same text
        soon after (the reply path's, see KnowledgeSection.prepare) waits only for what is left."""
        if text.strip():
            self._query(text)

    async def embed_query(self, text: str, *, patient: bool = False) -> Vector | None:
        """The query's vector, or None when the embedder fails or is slower than the timeout: the reply path's
        ``memory.query_timeout_seconds``, counted from the moment it was started (a prefetch); a search someone
        asked for (``patient``) tries once more for up to ``PATIENT_QUERY_SECONDS`` (the model's first load in
        a process takes longer than a reply may wait). A query embedded (or being embedded) a moment ago is
        not embedded again."""
        if not text.strip():
            return None
        # Shielded: a search given up (a cancelled reply) leaves the shared embedding to others.
        vector = await asyncio.shield(self._query(text))
        if vector is not None or not patient:
            return vector
        patient_one = self._query(text, timeout=PATIENT_QUERY_SECONDS)  # (the short one failed: dropped)
        return await asyncio.shield(patient_one)

    def _query(self, text: str, *, timeout: float | None = None) -> asyncio.Future[Vector | None]:
        future = self._queries.get(text)
        if future is not None and future.get_loop() is asyncio.get_running_loop():
            self._queries.move_to_end(text)
            return future
        future = asyncio.ensure_future(self._embed_query_now(text, timeout or self.config.query_timeout_seconds))
        self._queries[text] = future
        while len(self._queries) > QUERY_CACHE:
            self._queries.popitem(last=False)

        def drop_failure(done: asyncio.Future[Vector | None]) -> None:
            failed = done.cancelled() or done.exception() is not None or done.result() is None
            if failed and self._queries.get(text) is done:
                del self._queries[text]  # a failure is tried again by the next search

        future.add_done_callback(drop_failure)
        return future

    async def _embed_query_now(self, text: str, timeout: float) -> Vector | None:
        try:
            vectors = await asyncio.wait_for(self._in_query_thread(embed_queries, self.query_embedder, [text]), timeout)
        except (TimeoutError, EmbedderError) as exc:
            self._query_failed(str(exc) or f"slower than {timeout:g} s")
            return None
        vector: Vector = vectors[0]
        vector.setflags(write=False)  # shared by every search for this text
        return vector

    def _query_failed(self, why: str) -> None:
        self._query_failures += 1
        if self._query_failures in (1, 10, 100) or self._query_failures % 1000 == 0:
            log.warning("query embedding failed (%d so far), searching by text only: %s", self._query_failures, why)

    async def relevance_floors(self, query: npt.NDArray[np.float32]) -> RelevanceFloors:
        """The floors a candidate found by meaning alone must pass to count as related to ``query``: a
        centred cosine (:class:`CentredFloor`) of ``ITEM_CENTRED`` for an item, of ``MESSAGE_CENTRED``
        for a past message. No floors for an embedder without a measured yardstick. How they were
        chosen: see the README's "Relevance floor"."""
        yardstick = await self._yardstick()
        if yardstick is None or yardstick.mean_query.shape[0] != query.shape[0]:
            return RelevanceFloors()
        item = CentredFloor.of(query, yardstick.mean_query, yardstick.mean_passage, ITEM_CENTRED)
        return RelevanceFloors(item, replace(item, least=MESSAGE_CENTRED))

    def warm_up(self) -> None:
        """Check the relevance yardstick now, so the first search does not wait for it."""
        self._start_background()

    def _start_background(self) -> asyncio.Future[Yardstick | None]:
        """The yardstick's check, started once (again after a failure); its outcome is always retrieved."""
        if self._background is None:
            self._background = asyncio.ensure_future(self._load_background())
            self._background.add_done_callback(lambda f: f.cancelled() or f.exception())
        return self._background

    async def _yardstick(self) -> Yardstick | None:
        background = self._start_background()
        try:
            return await asyncio.shield(background)
        except EmbedderError as exc:  # retried by a later search
            self._background = None
            log.warning("could not check the relevance yardstick; searching without a floor: %s", exc)
            return None

    async def _load_background(self) -> Yardstick | None:
        """The yardstick's vectors, shipped for the default embedder (whose floors were measured) and
        checked against fresh embeddings of the first sentence as a passage and as a query, so changed
        weights are noticed. Other embedders have no floor: their levels were never measured."""
        passages = shipped_background(self.embedder.name)
        queries = shipped_background(self.embedder.name, queries=True)
        if passages is None or queries is None:
            return None
        first, first_query = await self._in_query_thread(self._first_of_background)
        if not all(fresh.ndim == 2 and fresh.shape[1] == shipped.shape[1] and float(fresh[0] @ shipped[0]) >= 0.999
                   for fresh, shipped in ((first, passages), (first_query, queries))):
            log.warning("the shipped relevance yardstick does not match %s; searching without a floor",
                        self.embedder.name)
            return None
        return Yardstick(passages.mean(axis=0), queries.mean(axis=0))

    def _first_of_background(self) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        return (np.asarray(self.query_embedder.embed([BACKGROUND[0]]), dtype=np.float32),
                np.asarray(embed_queries(self.query_embedder, [BACKGROUND[0]]), dtype=np.float32))

    # -- backfill --------------------------------------------------------------------------------

    async def backfill(self, max_seconds: float | None = None) -> BackfillReport:
        """Embed what lacks a current vector, items first, until done or ``max_seconds`` passed."""
        limit = self.config.backfill_max_seconds if max_seconds is None else max_seconds
        started = time.monotonic()
        items = messages = 0
        error = ""
        more = False
        try:
            deadline = started + limit
            while not (more := time.monotonic() >= deadline):
                done = await self._item_batch()
                if not done:
                    break
                items += done
            if not more and self.config.embed_messages:
                messages, more = await self._message_batches(deadline)
        except EmbedderError as exc:
            error = str(exc)
            if error != self.last_error:  # a lasting outage is logged once, not every minute
                log.warning("embedding backfill stopped, retried every run until it works: %s", error)
            self.last_error = error
        seconds = time.monotonic() - started
        report = BackfillReport(items, messages, seconds, error, more)
        if items or messages:
            self._rate = (items + messages) / seconds if seconds > 0 else 0.0
            status = await self.status()
            log.info("embedding backfill: %d items and %d messages in %.1f s; %d of %d embedded (%.0f%%)",
                     items, messages, seconds, status.items_embedded + status.messages_embedded,
                     status.items_total + status.messages_total, self._percent(status))
        if not error:
            self.last_error = ""
        self.last_run, self.last_run_at = report, self.clock()
        return report

    @staticmethod
    def _percent(status: EmbedderStatus) -> float:
        total = status.items_total + status.messages_total
        return 100.0 if not total else 100.0 * (total - status.pending) / total

    async def _embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="embed-backfill", initializer=_lower_priority)
        vectors = await asyncio.get_running_loop().run_in_executor(self._executor, self.embedder.embed, texts)
        if vectors.ndim != 2 or vectors.shape[0] != len(texts):
            raise EmbedderError(f"the embedder returned vectors of shape {vectors.shape} for {len(texts)} texts")
        return vectors.astype(np.float32)

    async def _item_batch(self) -> int:
        rows = await self.storage.memory.items_to_embed(self.model, BATCH)
        if not rows:
            return 0
        texts = [f"{r['key']}: {r['content']}" if r["key"] else str(r["content"]) for r in rows]
        vectors = await self._embed(texts)
        await self.storage.memory.ensure_vector_index(int(vectors.shape[1]))
        await self.storage.memory.store_item_vectors(
            self.model, [(int(r["id"]), vectors[n]) for n, r in enumerate(rows)])
        by_pair: dict[int, list[int]] = {}
        for n, r in enumerate(rows):
            by_pair.setdefault(int(r["pair_id"]), []).append(n)
        for pair_id, rows_of_pair in by_pair.items():
            self.index.add(("items", pair_id), [int(rows[n]["id"]) for n in rows_of_pair], vectors[rows_of_pair])
        return len(rows)

    async def _message_batches(self, deadline: float) -> tuple[int, bool]:
        """Messages without a vector, newest first, in batches until none is left or ``deadline`` (monotonic)
        passed: (messages embedded, whether time ran out first). While a batch is embedded on the backfill's
        thread, the one before it is stored and the next one read, so the database's work overlaps the
        embedding instead of leaving the cores idle."""
        done, late = 0, False
        model, began = self.message_model, time.monotonic()
        mark = self._marks.get(model)
        full = mark is None or began - mark[1] >= FULL_SCAN_SECONDS
        above = 0 if full or mark is None else max(mark[0] - MARK_WINDOW, 0)
        top = await self.storage.memory.newest_message_id()
        rows = await self._messages_to_embed(2**62, above)
        embedded: tuple[list[Row], Vector] | None = None  # not yet stored
        while rows:
            embedding = asyncio.ensure_future(self._embed([
                message_text(str(r["author_name"]), str(r["text"]), r["before_author"], r["before_text"])
                for r in rows]))
            try:
                late = time.monotonic() >= deadline
                _, following = await asyncio.gather(
                    self._store_messages(*embedded) if embedded else asyncio.sleep(0),
                    self._messages_to_embed(int(rows[-1]["id"]), above) if not late else asyncio.sleep(0, []))
                embedded = None
                embedded = (rows, await embedding)
            finally:
                embedding.cancel()  # (done: a no-op) a failure above must not leave it running unawaited
            done += len(rows)
            rows = following
        if embedded:
            await self._store_messages(*embedded)
        if not late:  # read to the end: what was there at its start is done, up to the last full scan's knowledge
            self._marks[model] = (top, began if full or mark is None else mark[1])
        return done, late

    def forget_marks(self) -> None:
        """Have the next run read all messages again: this process deleted some (forget-me, the end of an
        incognito stretch), and the messages after them lost their vectors, below the mark."""
        self._marks.clear()

    async def _messages_to_embed(self, below: int, above: int) -> list[Row]:
        return await self.storage.memory.messages_to_embed(self.message_model, below, BATCH, above=above)

    async def _store_messages(self, rows: list[Row], vectors: Vector) -> None:
        """Store a batch's vectors (those whose message, and the one before it, are still there) and add them to
        the index."""
        await self.storage.memory.ensure_vector_index(int(vectors.shape[1]))
        stored = set(await self.storage.memory.store_message_vectors(
            self.message_model,
            [(int(r["id"]), int(r["user_id"]), str(r["persona"]), vectors[n]) for n, r in enumerate(rows)],
            before=[int(r["before_id"]) for r in rows]))
        by_pair: dict[tuple[int, str], list[int]] = {}
        for n, r in enumerate(rows):
            if int(r["id"]) not in stored:  # its message, or the one before it, was deleted meanwhile
                continue
            by_pair.setdefault((int(r["user_id"]), str(r["persona"])), []).append(n)
        for (user_id, persona), rows_of_pair in by_pair.items():
            self.index.add(("messages", user_id, persona), [int(rows[n]["id"]) for n in rows_of_pair],
                           vectors[rows_of_pair])

    # -- status ----------------------------------------------------------------------------------

    async def status(self) -> EmbedderStatus:
        items, items_embedded, messages_total, messages_embedded = await self.storage.memory.embedding_counts(
            self.model, self.message_model, self.config.embed_messages)
        return EmbedderStatus(
            self.model, items, items_embedded, messages_total, messages_embedded, self.last_run, self.last_run_at,
            self.last_error, self._rate,
        )


CONTEXT_CHARS = 200


def message_model(embedder_name: str) -> str:
    """Message vectors are tagged with the embedder and the text recipe, so a change of either re-embeds."""
    return f"{embedder_name}|prev-turn"


def message_text(author: str, text: str, before_author: str | None = None, before_text: str | None = None) -> str:
    """What is embedded for a message: the message it answers (the channel's previous one, cut to
    ``CONTEXT_CHARS``) and then who said what. The context lets a bare answer ("Luna and Oliver!") be
    found by its question ("what are your pets' names?"): LoCoMo R@10 60.1 without it, 68.8 with."""
    said = f"{author}: {text}"
    if not before_text:
        return said
    before = before_text if len(before_text) <= CONTEXT_CHARS else before_text[:CONTEXT_CHARS].rstrip() + "…"
    return f"{before_author}: {before}\n{said}"
