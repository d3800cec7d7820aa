"""Builds the object graph once (config → storage → llm → core → workers) and owns its lifetime.

Tests and benchmarks build the same graph with a different provider (``llm=``) or storage path.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from bot.commands import CommandError, CommandRegistry
from bot.commands.core import register_core_commands
from bot.commands.dashboard import register_dashboard
from bot.config import Config, ConfigError, read_secret
from bot.conversation import ConversationCore
from bot.fleet import HEARTBEAT_SECONDS, Fleet
from bot.jobs import JobQueue, WorkerPool, local_host
from bot.llm import create_provider
from bot.llm.base import LLMProvider
from bot.router import Router
from bot.scheduler import Scheduler
from bot.storage import Storage, open_storage
from bot.storage.copy import note_use, unfinished_copy
from bot.storage.engine import StorageError
from bot.summary import JOB_KIND as SUMMARY_JOB
from bot.summary import SummaryEngine
from bot.tokens import BPETokenEstimator
from cortex import build_cortex
from cortex.memory.embedders import Embedder
from cortex.memory.upkeep import end_expired_incognito, expire_old_messages
from cortex.personas.card_commands import CardCommands
from cortex.personas.commands import PersonaCommands, check_persona_name
from cortex.personas.guidelines import GuidelinesCommands, RulesCommands
from cortex.personas.lore import LoreIndex, LoreSection
from cortex.personas.lore_commands import LoreCommands
from cortex.personas.registry import PersonaRegistry
from cortex.personas.sections import GuidelinesSection, RulesSection
from cortex.skills.builtin import Builtins
from cortex.skills.setup import Skills
from cortex.tiers import JOB_KIND as CORTEX_JOB

log = logging.getLogger(__name__)

PRUNE_AFTER_START = 300.0  # seconds: a bot that restarts daily still prunes
BACKFILL_FIRST_AFTER = 5.0  # seconds from the start to the first background embedding run
INCOGNITO_CHECK_SECONDS = 600.0
RETENTION_SECONDS = 86_400.0
# Days the audit row of each model call is kept: the web page shows the last 14 days' spending, and a row per call
# kept for good grew the database by every reply, summary and cortex round of a bot's whole life.
LLM_CALLS_KEPT_DAYS = 90
SCRUB_CHECK_SECONDS = 3600.0  # how soon the words of a message taken back leave the database's files
RATE_PRUNE_SECONDS = 3600.0
SETTINGS_RELOAD_SECONDS = 5.0  # how soon admin changes saved by another process reach this one
SHARED_CACHE_SECONDS = 60.0  # SQLite shared by several processes: cached vectors are read again this often
CALIBRATION_SETTING = "tokens.calibration.{provider}.{model}"


def build_provider(config: Config, env: Mapping[str, str] | None = None) -> LLMProvider:
    """The configured provider with its API key read from the environment (never from the file)."""
    llm = config.llm
    key = read_secret(llm.key_env_name, env)
    if key is None:
        if not llm.key_required:
            key = "not-needed"  # local OpenAI-compatible servers (Ollama, vLLM, llama.cpp) accept any key
        elif llm.api_key_env:
            raise ConfigError(f"the {llm.provider} API key is missing: [llm] api_key_env names the environment "
                              f"variable {llm.key_env_name}, which is not set")
        else:
            raise ConfigError(
                f"the {llm.provider} API key is missing: set the environment variable {llm.key_env_name} "
                f"(or name another variable with [llm] api_key_env)"
            )
    return create_provider(
        llm.provider,
        api_key=key,
        base_url=llm.base_url,
        timeout_seconds=llm.timeout_seconds,
        connect_timeout_seconds=llm.connect_timeout_seconds,
        max_retries=llm.max_retries,
    )


class App:
    def __init__(self, config: Config, *, llm: LLMProvider | None = None, embedder: Embedder | None = None) -> None:
        self.config = config
        self._llm = llm
        self._embedder = embedder
        self._started = False
        self._shared_warned = False
        self.fleet_info: dict[str, Any] = {}  # what `cortexbot status` shows of this process from its first beat

    async def start(self, *, workers: bool = True) -> App:
        self.llm = self._llm or build_provider(self.config)
        url, password = self.config.storage.resolve()
        self.storage: Storage = await open_storage(url, password=password, pool_size=self.config.storage.pool_size)
        try:
            applied = await self.storage.migrate()
            if applied:
                log.info("database migrated to version %d", applied[-1])
            if (unfinished := await unfinished_copy(self.storage)) is not None:  # (part of another's data)
                raise StorageError(unfinished)
            # (a copy-data into it would undo what this process changes: it is refused from now on)
            await note_use(self.storage, f"a bot process (pid {os.getpid()} on {local_host()})")
            if await self.storage.scrub_if_pending():  # a process stopped after deleting words, before scrubbing
                log.info("scrubbed the database's files of words deleted before the last stop")
            self.personas = PersonaRegistry(self.config, self.storage)
            self._check_persona_names()  # (before the config's personas are written: a refused one stayed)
            await self.personas.start()
            self.estimator = BPETokenEstimator(
                margin=self.config.history.token_margin, factor=await self._load_calibration()
            )
            # Background jobs get a connection of their own, so replies never queue behind their queries.
            self.job_storage = await self.storage.sibling()
            self.queue = JobQueue(self.storage, self.config.jobs)
            self.summaries = SummaryEngine(self.config, self.job_storage, self.llm, self.estimator, self.queue,
                                           self.personas)
            self.cortex = build_cortex(
                self.config, self.storage, self.llm, self.estimator, self.queue, self.job_storage, self._embedder,
                self.personas,
            )
            self.lore = LoreIndex(self.storage)
            if self.cortex.embeddings is not None:
                self.cortex.embeddings.warm_up()
            self.skills = Skills(self.config, self.storage, Builtins(
                self.config, self.storage, self.cortex.store, self.cortex.memory,
                self.lore, self.personas, self.cortex.resolver))
            await self.skills.start()
            self.core = ConversationCore(
                self.config, self.storage, self.llm, self.estimator, self.summaries,
                section_providers=[RulesSection(self.personas, self.estimator),
                                   GuidelinesSection(self.personas, self.estimator), self.cortex.section,
                                   self.cortex.knowledge, LoreSection(self.lore, self.personas, self.estimator)],
                observers=[self.cortex.tiers],
                personas=self.personas,
                tools=self.skills.tools,
                preparers=[self.cortex.knowledge],
            )
            self.commands = CommandRegistry(unavailable=self.storage.unavailable)
            register_core_commands(self.commands, self.storage, self.estimator)
            self.cortex.commands.register(self.commands)
            self.cortex.memory_commands.register(self.commands)
            self.cortex.memory_admin.register(self.commands)
            for commands in (PersonaCommands, GuidelinesCommands, RulesCommands):
                commands(self.personas, self.storage).register(self.commands)
            LoreCommands(self.personas, self.storage, self.lore).register(self.commands)
            CardCommands(self.personas, self.storage).register(self.commands)
            self.skills.commands.register(self.commands)
            register_dashboard(self.commands, self.storage.web, self.config.web)
            self.cortex.commands.extra_stats = self._extra_stats
            self.cortex.commands.on_forget.append(lambda _user_key: self.core.forget_recent_texts())
            self.cortex.memory_commands.on_resume = self._forget_paused
            self.core.on_stretch_dropped = self._forget_paused
            await self.cortex.memory_admin.load()
            # The processes sharing a PostgreSQL count each user's rate limits there; SQLite's one process, in memory.
            shared = self.storage.rate_limits.count if self.storage.db.shared_across_hosts else None
            self.router = Router(self.config, self.storage, self.core, self.commands, self.personas, shared)
            self.fleet = Fleet(self.storage)
            self.fleet.info = dict(self.fleet_info)
            self.workers = WorkerPool(
                self.queue,
                {SUMMARY_JOB: self.summaries.run_job, CORTEX_JOB: self.cortex.updater.run_job},
                on_failed={CORTEX_JOB: self.cortex.tiers.after_failed_update},
                on_interrupted={CORTEX_JOB: self.cortex.updater.after_interrupted},
                storage=self.job_storage,
                pid_checks=not self.storage.db.shared_across_hosts,
                worker_id=self.fleet.process_id,
            )
            self.scheduler = Scheduler(gate=self.fleet.claim_period)
            self.cortex.memory_admin.scheduler = self.scheduler
            if workers:
                await self.fleet.heartbeat()
                self.scheduler.every(HEARTBEAT_SECONDS, "heartbeat", self.fleet.heartbeat, fleet_once=False)
                # Admin-tuned values another process saved reach this one within seconds.
                self.scheduler.every(SETTINGS_RELOAD_SECONDS, "reload-settings", self._reload, fleet_once=False)
                if self.storage.db.dialect == "sqlite":
                    self.scheduler.every(SHARED_CACHE_SECONDS, "shared-sqlite", self._shared_sqlite,
                                         fleet_once=False)
                await self.workers.start()
                self.scheduler.every(
                    self.config.jobs.lease_seconds, "requeue-abandoned-jobs", self.workers.recover
                )
                # Stretches whose hours ran out while no process ran end before the first message is read (a
                # failure here is logged, as the periodic check's: the check comes again in ten minutes).
                try:
                    await self._end_incognito()
                except Exception:
                    log.exception("could not end the incognito stretches that ran out while the bot was stopped")
                self.scheduler.every(INCOGNITO_CHECK_SECONDS, "end-incognito", self._end_incognito)
                # Messages their authors took back are not scrubbed one by one (a merge of the full-text indexes
                # each): their words leave the files within the hour.
                self.scheduler.every(SCRUB_CHECK_SECONDS, "scrub-deleted", self.storage.scrub_if_pending)
                if self.config.memory.keep_messages_days:
                    self.scheduler.every(RETENTION_SECONDS, "expire-old-messages", self._expire_messages,
                                         first_after=PRUNE_AFTER_START)
                self.scheduler.every(RETENTION_SECONDS, "prune-old-jobs", self._prune_jobs,
                                     first_after=PRUNE_AFTER_START)
                self.scheduler.every(RETENTION_SECONDS, "prune-old-llm-calls", self._prune_llm_calls,
                                     first_after=PRUNE_AFTER_START)
                self.scheduler.every(RETENTION_SECONDS, "prune-forgotten-usage", self.storage.prune_forgotten,
                                     first_after=PRUNE_AFTER_START)
                self.scheduler.every(RETENTION_SECONDS, "prune-dead-processes", self.storage.fleet.prune_processes,
                                     first_after=PRUNE_AFTER_START)
                self.scheduler.every(RETENTION_SECONDS, "prune-text-versions", self.storage.personas.prune_versions,
                                     first_after=PRUNE_AFTER_START)
                # (a ❌ on a confirmation older than bot.storage.undo.KEPT_DAYS is told the undo expired)
                self.scheduler.every(RETENTION_SECONDS, "prune-undo-offers", self.storage.undo_offers.prune,
                                     first_after=PRUNE_AFTER_START)
                if shared is not None:  # (the rows of users who sent nothing for a minute)
                    self.scheduler.every(RATE_PRUNE_SECONDS, "prune-rate-limits", self.storage.rate_limits.prune)
                self.scheduler.every(self.config.memory.prune_every_hours * 3600, "prune-memory",
                                     self.cortex.pruner.prune, first_after=PRUNE_AFTER_START)
                if self.cortex.embeddings is not None:
                    # The first run soon after the start: a short session (a terminal chat) is searchable by
                    # meaning before it ends, not only after a minute.
                    self.scheduler.every(
                        self.config.memory.backfill_seconds, "embed-backfill", self.cortex.embeddings.backfill,
                        first_after=min(BACKFILL_FIRST_AFTER, self.config.memory.backfill_seconds),
                    )
                self.scheduler.start()
        except BaseException:
            # Whatever started stops before the database it uses closes.
            if getattr(self, "scheduler", None) is not None:
                await self.scheduler.aclose()
            if getattr(self, "workers", None) is not None:
                await self.workers.stop(0)
            if getattr(self, "job_storage", None) is not None:
                await self.job_storage.close()
            if getattr(self, "skills", None) is not None:
                await self.skills.aclose()
            await self.storage.close()
            raise
        self._started = True
        return self

    async def carry_over_place(self, old: str, new: str, *, author: str) -> None:
        """What admins set for the place ``old`` (a server and channel key: a Matrix room) is set for ``new``, which
        replaces it (an upgraded room), where ``new`` has nothing of its own yet: its guidelines, cortex settings,
        channel persona and skill switches. (The access lists are the config's: they name rooms themselves.)"""
        reason = f"carried over from {old}, which {new} replaces"
        await self.storage.places.carry_over(old, new, author=author, reason=reason)
        for persona in self.personas.names():
            for scope in ("server", "channel"):
                await self.skills.tools.policy.copy_scope(persona, f"{scope}:{old}", f"{scope}:{new}")
        await self.personas.load()  # (the guidelines are read from the registry's copy)

    def _check_persona_names(self) -> None:
        """The config's persona names against the ``!persona`` subcommands (those of the commands that declare
        them, registered on their own), before anything is seeded: a refused name was written to the database
        first, and stayed there after the config was fixed."""
        probe = CommandRegistry()
        for commands in (PersonaCommands, CardCommands):
            commands(self.personas, self.storage).register(probe)
        check_persona_names(self.config, probe)

    async def _extra_stats(self) -> list[str]:
        return await self.cortex.memory_admin.stats_lines() + await self.skills.commands.stats_lines()

    async def _prune_jobs(self) -> None:
        """Rows of jobs finished or failed longer ago than ``[jobs] keep_done_days`` / ``keep_failed_days``."""
        jobs, now = self.config.jobs, time.time()
        deleted = await self.job_storage.delete_old_jobs(
            done_before=now - jobs.keep_done_days * 86_400 if jobs.keep_done_days else None,
            failed_before=now - jobs.keep_failed_days * 86_400 if jobs.keep_failed_days else None)
        if deleted:
            log.info("deleted the rows of %d old finished or failed job(s)", deleted)

    async def _prune_llm_calls(self) -> None:
        """Audit rows of model calls older than ``LLM_CALLS_KEPT_DAYS``."""
        deleted = await self.job_storage.delete_old_llm_calls(time.time() - LLM_CALLS_KEPT_DAYS * 86_400)
        if deleted:
            log.info("deleted the audit rows of %d model call(s) older than %d days", deleted, LLM_CALLS_KEPT_DAYS)

    async def _expire_messages(self) -> None:
        await expire_old_messages(self.job_storage, self.config.memory.keep_messages_days)

    async def _end_incognito(self) -> None:
        if await end_expired_incognito(self.job_storage, self.config.memory.incognito_hours):
            self._forget_paused()

    def _forget_paused(self) -> None:
        """After an incognito stretch ended: the texts of this process's recent messages and the kept query
        vectors may hold what was said in it (memory only, but it was to be kept nowhere)."""
        self.core.forget_recent_texts()
        self.cortex.memory.forget_search_words()
        if self.cortex.embeddings is not None:
            self.cortex.embeddings.forget_queries()
            self.cortex.embeddings.forget_marks()  # the messages after the deleted ones are embedded again

    async def _reload(self) -> None:
        await self.cortex.memory_admin.load()
        await self.personas.load()

    async def _shared_sqlite(self) -> None:
        """Another process on this SQLite file (a `cortexbot chat` beside `cortexbot run`) embeds and stores
        what this one's vector cache does not hold: while one lives, the cache is read again every
        :data:`SHARED_CACHE_SECONDS`, and the log says once that PostgreSQL is the engine for several."""
        others = [p for p in await self.fleet.live() if p.id != self.fleet.process_id]
        if not others or self.cortex.embeddings is None:
            return
        if not self._shared_warned:
            self._shared_warned = True
            log.warning("another bot process (pid %d on %s) uses this SQLite database; each process keeps its "
                        "own vector cache, read again every %.0f s while they share it. For several processes, "
                        "PostgreSQL is the engine (README: Growing past one machine)", others[0].pid,
                        others[0].host, SHARED_CACHE_SECONDS)
        self.cortex.embeddings.index.invalidate()

    @property
    def _calibration_key(self) -> str:
        return CALIBRATION_SETTING.format(provider=self.config.llm.provider, model=self.config.llm.model)

    async def _load_calibration(self) -> float:
        saved = await self.storage.get_setting(self._calibration_key)
        try:
            return float(saved) if saved else 1.0
        except ValueError:
            return 1.0

    async def stop(self, grace: float | None = None) -> None:
        if not self._started:
            return
        self._started = False
        try:
            await self.scheduler.aclose()
            await self.fleet.leave()
            if self.cortex.embeddings is not None:
                self.cortex.embeddings.close()
            await self.workers.stop(grace)
            await self.storage.set_setting(self._calibration_key, f"{self.estimator.factor:.4f}")
            # Deleted words not yet scrubbed from the files (a second forget-me within a minute of another, a
            # message taken back): gone before the files are left to a backup or a copy, not at the next start.
            try:
                await self.storage.scrub_if_pending()
            except Exception:
                log.warning("could not scrub deleted text from the database at the stop; the next start does",
                            exc_info=True)
        finally:
            await self.skills.aclose()
            await self.llm.aclose()
            await self.job_storage.close()
            await self.storage.close()

    async def __aenter__(self) -> App:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def check_persona_names(config: Config, commands: CommandRegistry) -> None:
    """A ``[[personas]]`` name that starts with a ``!persona`` subcommand ("List Buff") could never be
    picked: ``!persona List Buff`` (and Discord's ``/persona``, which becomes that line) runs ``list``.
    Refused at start (and by ``cortexbot doctor``), as ``!persona create`` and card imports refuse such a name."""
    for persona in config.personas:
        try:
            check_persona_name(persona.name, commands)
        except CommandError as exc:
            raise ConfigError(f"[[personas]] name = {persona.name!r}: {exc}; rename it in the config") from None
