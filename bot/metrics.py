"""Prometheus metrics of this process: counters the reply path, summaries and cortex updates bump as they
happen, and gauges read from the database when ``/metrics`` is scraped (queue, backlog, items).

No metric carries user text, user ids or channel ids: labels are purposes, outcomes and statuses only.
Each process keeps its own counters (Prometheus adds them up over the fleet); the gauges describe the
shared database, so every process reports the same values for them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from bot.storage.base import LLMCallRecord, ReplyStats

disable_created_metrics()  # type: ignore[no-untyped-call]  # the *_created series double every counter and no dashboard here uses them
REGISTRY = CollectorRegistry(auto_describe=True)

REPLIES = Counter("cortexbot_replies", "Replies sent.", registry=REGISTRY)
REPLY_OVERHEAD = Histogram(
    "cortexbot_reply_overhead_seconds",
    "Time a reply spent in the bot itself (storing, window, memory, prompt), the model and skills excluded.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
    registry=REGISTRY,
)
LLM_CALLS = Counter("cortexbot_llm_calls", "Model calls by purpose and outcome.", ("purpose", "outcome"),
                    registry=REGISTRY)
LLM_TOKENS = Counter("cortexbot_llm_tokens", "Tokens billed by purpose and direction.", ("purpose", "direction"),
                     registry=REGISTRY)
WINDOW_UTILISATION = Histogram(
    "cortexbot_history_window_utilisation", "History tokens sent / the window's budget, per reply.",
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), registry=REGISTRY,
)
TRIMMED_REPLIES = Counter("cortexbot_history_trimmed_replies",
                          "Replies whose history window left stored messages out.", registry=REGISTRY)
SUMMARIES = Counter("cortexbot_summaries", "Rolling summaries generated, by outcome (written, rejected).",
                    ("outcome",), registry=REGISTRY)
CORTEX_UPDATES = Counter("cortexbot_cortex_updates", "Cortex update runs by outcome.", ("outcome",),
                         registry=REGISTRY)
JOBS = Gauge("cortexbot_jobs", "Background jobs in the queue by status.", ("status",), registry=REGISTRY)
OLDEST_QUEUED = Gauge("cortexbot_job_oldest_queued_seconds", "Age of the oldest queued job (0: none).",
                      registry=REGISTRY)
EMBEDDING_BACKLOG = Gauge("cortexbot_embedding_backlog", "Messages and items not yet searchable by meaning.",
                          registry=REGISTRY)
MEMORY_ITEMS = Gauge("cortexbot_memory_items", "Memory items by state (active, archived).", ("state",),
                     registry=REGISTRY)
STORAGE_UP = Gauge("cortexbot_storage_up", "1 when the database answered the last scrape.", registry=REGISTRY)


def observe_llm_call(record: LLMCallRecord) -> None:
    LLM_CALLS.labels(record.purpose, "error" if record.error else "ok").inc()
    LLM_TOKENS.labels(record.purpose, "input").inc(record.input_tokens)
    LLM_TOKENS.labels(record.purpose, "output").inc(record.output_tokens)


def observe_reply(stats: ReplyStats, overhead_seconds: float) -> None:
    REPLIES.inc()
    REPLY_OVERHEAD.observe(max(overhead_seconds, 0.0))
    if stats.history_budget > 0:
        WINDOW_UTILISATION.observe(min(stats.history_tokens / stats.history_budget, 1.0))
    if stats.trimmed_messages:
        TRIMMED_REPLIES.inc()


def observe_summary(written: bool) -> None:
    SUMMARIES.labels("written" if written else "rejected").inc()


def observe_cortex_update(outcome: str) -> None:
    CORTEX_UPDATES.labels(outcome).inc()


def render() -> bytes:
    """The text exposition of every metric (call after the gauges were refreshed)."""
    return generate_latest(REGISTRY)
