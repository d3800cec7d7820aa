"""The storage port: records the core reads and writes, and the interface it reads and writes them by.

The core only talks to :class:`Storage`; ``bot.storage.core.Storage`` implements it once for both
engines (SQLite, PostgreSQL), and ``tests/test_storage.py`` runs against it on each engine.

Times are UTC ``datetime`` objects at the interface; engines store them as they see fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from bot.storage.incognito import IncognitoRepository
    from bot.storage.sources import SourceRepository
    from bot.storage.undo import UndoOfferRepository

MessageRole = Literal["user", "assistant"]
JobStatus = Literal["queued", "running", "done", "failed"]
SummaryStatus = Literal["ok", "rejected"]


@dataclass(frozen=True, slots=True)
class User:
    id: int
    key: str  # "platform:id", e.g. "discord:1234", "console:ann"
    display_name: str


@dataclass(frozen=True, slots=True)
class Channel:
    id: int
    key: str  # "platform:id" of the channel/room/DM
    name: str
    is_dm: bool


@dataclass(frozen=True, slots=True)
class StoredMessage:
    id: int
    channel_id: int
    user_id: int | None  # the human author; for assistant messages the user addressed
    persona: str
    role: MessageRole
    author_name: str
    text: str
    token_count: int
    seq: int  # 1-based position in the channel when it was stored
    created_at: datetime
    reply_to: int | None = None  # an answer: the message it answers (stored before it, not always just before)


@dataclass(frozen=True, slots=True)
class Summary:
    id: int
    channel_id: int
    version: int
    text: str
    covers_from_id: int  # first message folded into this summary (over all versions)
    covers_to_id: int  # last message folded in; messages after it are not covered
    covers_to_seq: int  # that message's position in the channel
    token_count: int
    model: str
    status: SummaryStatus
    reason: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class SummarySources:
    """What a new summary was made from: the summary it continues (None: the first) and the messages it
    folds in (ids)."""

    previous: int | None
    messages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    kind: str
    key: str  # at most one job per key runs at a time (e.g. "channel:7", "pair:3:Cora")
    payload: dict[str, Any]
    status: JobStatus
    attempts: int
    max_attempts: int
    run_after: datetime
    last_error: str
    locked_by: str
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class LLMCallRecord:
    purpose: str  # "reply", "summary", "doctor", ...
    model: str
    input_tokens: int
    output_tokens: int
    duration_ms: int
    error: str = ""
    estimated_input_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ReplyStats:
    channel_id: int
    message_id: int  # the stored reply
    history_tokens: int  # tokens of the history window as sent
    history_budget: int
    window_messages: int
    trimmed_messages: int  # stored messages of the channel left out of the window
    summary_used: bool
    prompt_tokens: int  # estimated tokens of the whole prompt


@dataclass(frozen=True, slots=True)
class ReplyMetrics:
    """The four numbers the history design is judged by (all 0.0 when there were no replies)."""

    replies: int
    token_utilisation: float  # mean history tokens / history budget
    trim_rate: float  # share of replies whose window left messages out
    summary_hit_rate: float  # share of replies whose prompt carried a rolling summary
    summary_generation_rate: float  # good summaries written per reply
    summaries_written: int
    summaries_rejected: int


class Storage(Protocol):
    """Everything the core persists. All methods are coroutines and safe to call concurrently."""

    @property
    def sources(self) -> SourceRepository:
        """What shaped each reply (``bot.storage.sources``)."""

    @property
    def incognito(self) -> IncognitoRepository:
        """Incognito stretches (``bot.storage.incognito``)."""

    @property
    def undo_offers(self) -> UndoOfferRepository:
        """Which confirmations offer an undo, for whom (``bot.storage.undo``)."""

    async def migrate(self) -> list[int]:
        """Apply pending migrations; return the versions applied (empty when up to date)."""

    async def pending_migrations(self) -> list[int]: ...

    async def close(self) -> None: ...

    # users, personas, channels
    async def upsert_user(self, key: str, display_name: str) -> User:
        """Create or rename the user. Engines may answer repeated identical calls from a cache."""

    async def get_user(self, key: str) -> User | None: ...

    async def upsert_persona(self, name: str) -> None: ...

    async def upsert_channel(self, key: str, name: str, is_dm: bool) -> Channel:
        """Create or rename the channel. Engines may answer repeated identical calls from a cache."""

    async def get_channel(self, key: str) -> Channel | None: ...

    async def count_messages(self, channel_id: int) -> int: ...

    # messages
    async def add_message(
        self,
        channel_id: int,
        user_id: int | None,
        persona: str,
        role: MessageRole,
        author_name: str,
        text: str,
        token_count: int,
        created_at: datetime | None = None,
        reply_to: int | None = None,
        outside_stretch_from: datetime | None = None,
    ) -> StoredMessage:
        """Store a message; ``reply_to``: the message an answer answers. ``outside_stretch_from`` (an answer
        to a message outside any incognito stretch: its message's time): when a stretch of the user with the
        persona began after that time, the answer is stamped at it, with its message, outside the stretch (the
        pause came while it was written; it read nothing of the stretch), in the same statement."""

    async def recent_messages(
        self, channel_id: int, limit: int, before_id: int | None = None, *, viewer: tuple[int, str] | None = None,
        since: float | None = None,
    ) -> list[StoredMessage]:
        """Up to ``limit`` messages of the channel with id < ``before_id``, newest first; for a reply to ``viewer``
        (user id, persona), without what others said with other personas inside an incognito stretch of theirs;
        with ``since`` (a POSIX time), only those stored as said at or after it."""

    async def message_time(self, message_id: int) -> datetime | None:
        """When the stored message ``message_id`` was said, or None when it is not stored."""

    async def messages_between(
        self, channel_id: int, after_id: int, before_id: int, limit: int
    ) -> list[StoredMessage]:
        """Messages with ``after_id`` < id < ``before_id``, oldest first, at most ``limit``."""

    async def answers_after(
        self, channel_id: int, message_id: int, asked: Sequence[int], viewer: tuple[int, str]
    ) -> tuple[bool, list[StoredMessage]]:
        """Whether message ``message_id`` is still stored, and the answers to the messages ``asked`` stored after
        it (oldest first), as :meth:`recent_messages` shows them to ``viewer``."""

    async def count_messages_between(self, channel_id: int, after_id: int, before_id: int) -> int: ...

    # rolling summaries
    async def latest_summary(self, channel_id: int) -> Summary | None:
        """The newest summary with status "ok"."""

    async def add_summary(
        self,
        channel_id: int,
        text: str,
        covers_from_id: int,
        covers_to_id: int,
        token_count: int,
        model: str,
        status: SummaryStatus = "ok",
        reason: str = "",
        *,
        made_from: SummarySources | None = None,
    ) -> Summary | None:
        """Store a summary; with ``made_from``, only while every message and the summary it was made from
        still exist (None otherwise: a forget-me deleted some of them while the model wrote it)."""

    async def list_summaries(self, channel_id: int) -> list[Summary]: ...

    # durable jobs
    async def enqueue_job(
        self,
        kind: str,
        key: str,
        payload: dict[str, Any],
        max_attempts: int,
        *,
        dedupe: bool = True,
        run_after: datetime | None = None,
    ) -> Job | None:
        """Queue a job; with ``dedupe``, return None when a queued job of the same kind and key exists."""

    async def claim_job(self, worker: str, kinds: Sequence[str], lease_seconds: float) -> Job | None:
        """Atomically take the oldest runnable queued job whose key has no running job."""

    async def renew_lease(self, job_id: int, worker: str, lease_seconds: float, *, attempt: int | None = None
                          ) -> bool: ...

    # Fenced: with ``worker``, a job changes only while that worker holds it under a live lease (a
    # worker whose lease ran out, or whose job went to another, changes nothing and gets False); with
    # ``attempt`` too, only while it runs that claim (``Job.attempts`` as claimed): the worker loops of
    # one pool share a worker id, and one may have claimed the job again after another's lease ran out.
    async def finish_job(self, job_id: int, worker: str | None = None, *, attempt: int | None = None) -> bool: ...

    async def retry_job(self, job_id: int, error: str, run_after: datetime, worker: str | None = None, *,
                        attempt: int | None = None) -> bool: ...

    async def fail_job(self, job_id: int, error: str, worker: str | None = None, *, attempt: int | None = None
                       ) -> bool: ...

    async def release_job(self, job_id: int, worker: str | None = None, *, attempt: int | None = None) -> bool:
        """Put a running job back in the queue untouched (clean shutdown)."""

    async def recover_jobs(self, is_worker_dead: Callable[[str], bool] | None = None) -> list[Job]:
        """Requeue running jobs whose lease expired (or whose worker ``is_worker_dead(worker)``); one
        interrupted on its last attempt fails instead. The jobs as they are now."""

    async def get_job(self, job_id: int) -> Job | None: ...

    async def active_job(self, key: str) -> Job | None:
        """A queued or running job with this key, if any."""

    async def recent_jobs(self, key: str, limit: int = 5) -> list[Job]:
        """The newest jobs of one key, newest first."""

    async def list_jobs(self, status: JobStatus | None = None, limit: int = 100, *, by_change: bool = False,
                        before: int | None = None) -> list[Job]: ...

    async def delete_old_jobs(self, *, done_before: float | None, failed_before: float | None) -> int: ...

    async def delete_old_llm_calls(self, before: float) -> int:
        """Delete the audit rows of model calls made before ``before`` (UNIX seconds); how many went."""

    async def prune_forgotten(self) -> int:
        """Delete what forget-mes kept of the users' use of the daily limits once older than two days (see
        ``bot.storage.forgotten``); how many rows went."""

    async def job_counts(self) -> dict[str, int]:
        """How many jobs are in each status, read at one moment."""

    async def count_jobs(self, statuses: Sequence[JobStatus], kinds: Iterable[str] | None = None, *,
                         due_by: float | None = None) -> int: ...

    # audit and metrics
    async def record_llm_call(self, record: LLMCallRecord) -> None: ...

    async def record_reply_stats(self, stats: ReplyStats) -> None: ...

    async def reply_metrics(self, channel_id: int | None = None) -> ReplyMetrics: ...

    async def withdraw_message(self, key: str, now: float, author_key: str | None = None) -> tuple[bool, int]:
        """Delete the user's message the platform message ``key`` was, archive items remembered from it."""

    async def withdraw_channel(self, channel_key: str, now: float) -> tuple[int, int]:
        """Delete the messages and summaries of a channel deleted on its platform, archive items from them."""

    async def delete_message(self, message_id: int) -> None:
        """Delete one message with what points at it."""

    async def scrub_soon(self) -> None:
        """Leave no trace of deleted rows in the database's files, now or (spaced) a little later."""

    async def now(self) -> float:
        """The time (UNIX seconds) the processes sharing this database agree on: for marks other processes
        compare with their own time (a shared database's server clock)."""

    def unavailable(self, exc: BaseException) -> str | None:
        """For the log: why the database could not be used for what raised ``exc`` (a lock held elsewhere, a full
        disk, no write access, a server gone), naming it; None when that is not the cause."""

    # small persistent settings (e.g. tokenizer calibration)
    def forget_cached(self, *, user_key: str, channel_ids: Sequence[int] = ()) -> None:
        """Drop what this process cached of a user (and channels' summaries), e.g. after another process
        deleted them."""

    async def get_setting(self, key: str) -> str | None: ...

    async def set_setting(self, key: str, value: str) -> None: ...

    async def delete_setting_if(self, key: str, value: str) -> bool: ...
