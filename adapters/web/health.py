"""``GET /healthz`` for orchestrators and ``GET /metrics`` in the Prometheus text format."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from adapters.web.server import WebContext, ok
from bot import metrics

log = logging.getLogger(__name__)
T = TypeVar("T")
GAUGE_SECONDS = 10.0  # the database gauges are read at most this often, however often /metrics is scraped


class _AtMostEvery(Generic[T]):
    """Runs ``read`` at most every ``GAUGE_SECONDS`` and answers with what it last returned; concurrent
    callers share one run. Counting a big database's queue, items and embedding backlog is not free, and
    anyone who can reach ``/metrics`` or ``/healthz`` could otherwise make the bot count as fast as they ask."""

    def __init__(self, read: Callable[[], Awaitable[T]]) -> None:
        self.read = read
        self.read_at = -float("inf")
        self.kept: tuple[T] | None = None  # the last answer (a tuple, so that None can be an answer)
        self.lock = asyncio.Lock()

    async def __call__(self) -> T:
        async with self.lock:
            if self.kept is None or time.monotonic() - self.read_at >= GAUGE_SECONDS:
                self.kept = (await self.read(),)
                self.read_at = time.monotonic()
            return self.kept[0]


async def _refresh_gauges(ctx: WebContext) -> None:
    storage = ctx.app.storage
    try:
        queue = await storage.health.queue()
        for status in ("queued", "running", "failed", "done"):
            metrics.JOBS.labels(status).set(queue.by_status.get(status, 0))
        metrics.OLDEST_QUEUED.set(0 if queue.oldest_queued_at is None else time.time() - queue.oldest_queued_at)
        for state, count in (await storage.health.item_states()).items():
            metrics.MEMORY_ITEMS.labels(state).set(count)
        embeddings = ctx.app.cortex.embeddings
        if embeddings is not None:
            metrics.EMBEDDING_BACKLOG.set((await embeddings.status()).pending)
        metrics.STORAGE_UP.set(1)
    except Exception as exc:  # a scrape must answer even when the database does not
        log.warning("metrics: the database did not answer (%s)", type(exc).__name__)
        metrics.STORAGE_UP.set(0)


def metrics_routes(ctx: WebContext) -> list[web.RouteDef]:
    gauges = _AtMostEvery(lambda: _refresh_gauges(ctx))

    async def scrape(request: web.Request) -> web.Response:
        await gauges()
        response = web.Response(body=metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return [web.get("/metrics", scrape)]


def routes(ctx: WebContext, *, metrics: bool) -> list[web.RouteDef]:
    async def count_queue() -> dict[str, int]:
        found = await ctx.app.storage.health.queue()
        return {s: found.by_status.get(s, 0) for s in ("queued", "running", "failed")}

    queue = _AtMostEvery(count_queue)  # the ping below is always live

    async def healthz(request: web.Request) -> web.Response:
        body: dict[str, object] = {"status": "ok", "database": True}
        try:
            await ctx.app.storage.health.ping()
            body["queue"] = await queue()
        except Exception as exc:
            body.update(status="unavailable", database=False, error=type(exc).__name__)
        adapters = {name: bool(connected()) for name, connected in ctx.adapters.items()}
        body["adapters"] = adapters
        if body["status"] == "ok" and not all(adapters.values()):
            body["status"] = "degraded"
        return ok(body, status=200 if body["database"] else 503)

    return [web.get("/healthz", healthz), *(metrics_routes(ctx) if metrics else [])]
