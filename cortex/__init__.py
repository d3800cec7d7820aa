"""The cortex: per user-persona files the persona rewrites itself, in tiered background updates.

``build_cortex`` wires the parts; the core sees only two of them, through its ports: the prompt
section (:class:`cortex.section.CortexSection`) and the exchange observer
(:class:`cortex.tiers.TierEngine`). The job handler and the commands are registered in ``bot.app``.
"""

from __future__ import annotations

from dataclasses import dataclass

from bot.config import Config
from bot.jobs import JobQueue
from bot.llm.base import LLMProvider
from bot.storage.sqlite import SQLiteStorage
from bot.tokens import TokenEstimator
from cortex.commands import CortexCommands
from cortex.files import CortexFiles
from cortex.memory.commands import MemoryCommands
from cortex.memory.section import KnowledgeSection
from cortex.memory.store import MemoryStore, Weights
from cortex.section import CortexSection
from cortex.settings import SettingsResolver
from cortex.store import CortexStore
from cortex.tiers import TierEngine
from cortex.update import CortexUpdater


@dataclass(frozen=True, slots=True)
class Cortex:
    store: CortexStore
    files: CortexFiles
    resolver: SettingsResolver
    tiers: TierEngine
    updater: CortexUpdater
    section: CortexSection
    commands: CortexCommands
    memory: MemoryStore
    memory_commands: MemoryCommands
    knowledge: KnowledgeSection


def build_cortex(
    config: Config,
    storage: SQLiteStorage,
    llm: LLMProvider,
    estimator: TokenEstimator,
    queue: JobQueue,
    job_storage: SQLiteStorage | None = None,
) -> Cortex:
    """``storage`` serves the reply path and commands; ``job_storage`` (a sibling connection sharing its
    caches) serves the update jobs, so their queries never queue in front of a reply's."""
    store = CortexStore(storage)
    files = CortexFiles(store, config.cortex.file_max_chars)
    resolver = SettingsResolver(config.cortex, store)
    tiers = TierEngine(store, resolver, queue)
    job_store = CortexStore(job_storage) if job_storage is not None else store
    job_files = CortexFiles(job_store, config.cortex.file_max_chars)
    updater = CortexUpdater(config, job_store, job_files, SettingsResolver(config.cortex, job_store), llm, estimator)
    section = CortexSection(store, estimator, config.cortex.prompt_tokens, resolver)
    commands = CortexCommands(config, storage, store, files, resolver, tiers, updater)
    memory_config = config.memory
    weights = Weights(memory_config.weight_vector, memory_config.weight_text, memory_config.weight_importance,
                      memory_config.weight_recency, memory_config.weight_access)
    memory = MemoryStore(storage, weights=weights, half_life_days=memory_config.half_life_days,
                         candidates=memory_config.candidates)
    memory_commands = MemoryCommands(store, memory)
    knowledge = KnowledgeSection(memory, estimator, memory_config, resolver)
    return Cortex(store, files, resolver, tiers, updater, section, commands, memory, memory_commands, knowledge)
