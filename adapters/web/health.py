"""``GET /healthz`` for orchestrators and ``GET /metrics`` in the Prometheus text format."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from adapters.web.server import WebContext, ok
from bot import metrics

log = logging.getLogger(__name__)
GAUGE_SECONDS = 10.0  # the database gauges are read at most this often, however often /metrics is scraped


class _Gauges:
    """Reads the database gauges for a scrape unless they were read less than ``GAUGE_SECONDS`` ago:
    counting a big database's queue, items and embedding backlog is not free, and anyone who can reach
    ``/metrics`` could otherwise make the bot count as fast as they can ask. Concurrent scrapes share one
    read."""

    def __init__(self) -> None:
        self.read_at = -float("inf")
        self.lock = asyncio.Lock()

    async def refresh(self, ctx: WebContext) -> None:
        async with self.lock:
            if time.monotonic() - self.read_at >= GAUGE_SECONDS:
                await _refresh_gauges(ctx)
                self.read_at = time.monotonic()


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
    gauges = _Gauges()

    async def scrape(request: web.Request) -> web.Response:
        await gauges.refresh(ctx)
        response = web.Response(body=metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return [web.get("/metrics", scrape)]


def routes(ctx: WebContext, *, metrics: bool) -> list[web.RouteDef]:
    queue_counts: dict[str, int] = {}
    counted_at = -float("inf")

    async def queue() -> dict[str, int]:
        """The job queue's counts, read at most every ``GAUGE_SECONDS`` (the ping below is always live)."""
        nonlocal queue_counts, counted_at
        if time.monotonic() - counted_at >= GAUGE_SECONDS:
            found = await ctx.app.storage.health.queue()
            queue_counts = {s: found.by_status.get(s, 0) for s in ("queued", "running", "failed")}
            counted_at = time.monotonic()
        return queue_counts

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
