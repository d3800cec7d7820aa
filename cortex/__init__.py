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
from bot.persona import ConfigPersonas, PersonaSource
from bot.storage.core import Storage
from bot.tokens import TokenEstimator
from cortex.commands import CortexCommands
from cortex.files import CortexFiles
from cortex.memory.admin import MemoryAdminCommands
from cortex.memory.commands import MemoryCommands
from cortex.memory.embedders import Embedder
from cortex.memory.embedding import EmbeddingService, build_embedders, message_model
from cortex.memory.section import KnowledgeSection
from cortex.memory.store import MemoryStore, configured_weights
from cortex.memory.upkeep import Pruner
from cortex.memory.vectors import vector_search
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
    embeddings: EmbeddingService | None
    pruner: Pruner
    memory_admin: MemoryAdminCommands


def build_cortex(
    config: Config,
    storage: Storage,
    llm: LLMProvider,
    estimator: TokenEstimator,
    queue: JobQueue,
    job_storage: Storage | None = None,
    embedder: Embedder | None = None,
    personas: PersonaSource | None = None,
) -> Cortex:
    """``storage`` serves the reply path and commands; ``job_storage`` (a sibling connection sharing its
    caches) serves the update jobs, so their queries never queue in front of a reply's. ``embedder``
    replaces the configured one (tests pass a test double)."""
    personas = personas or ConfigPersonas(config)
    store = CortexStore(storage)
    files = CortexFiles(store, config.cortex.file_max_chars)
    resolver = SettingsResolver(config.cortex, store, llm)  # (the model an admin sets is checked with it)
    tiers = TierEngine(store, resolver, queue)
    job_store = CortexStore(job_storage) if job_storage is not None else store
    job_files = CortexFiles(job_store, config.cortex.file_max_chars)
    section = CortexSection(store, estimator, config.cortex.prompt_tokens, resolver)
    memory_config = config.memory
    pair_embedders = (embedder, embedder) if embedder is not None else build_embedders(memory_config)
    embeddings = None
    if pair_embedders is not None:
        name = pair_embedders[0].name
        index = vector_search(storage, name, message_model=message_model(name), max_vectors=memory_config.vector_cache)
        embeddings = EmbeddingService(job_storage or storage, *pair_embedders, index, memory_config)

    def memory_store(on: Storage) -> MemoryStore:
        return MemoryStore(on, weights=configured_weights(memory_config), half_life_days=memory_config.half_life_days,
                           candidates=memory_config.candidates, embeddings=embeddings,
                           max_chars=memory_config.max_item_chars)

    memory = memory_store(storage)
    job_memory = memory_store(job_storage or storage)
    updater = CortexUpdater(
        config, job_store, job_files, SettingsResolver(config.cortex, job_store), llm, estimator, job_memory,
        personas,
    )
    commands = CortexCommands(config, storage, store, files, resolver, tiers, updater, personas)
    memory_commands = MemoryCommands(store, memory, incognito_hours=memory_config.incognito_hours)
    knowledge = KnowledgeSection(memory, estimator, memory_config, resolver)

    def drop_vectors(pairs: set[int]) -> None:
        if embeddings is not None:
            for pair_id in pairs:
                embeddings.index.invalidate(("items", pair_id))

    def forget_words(_user_key: str) -> None:
        for store_ in (memory, job_memory):
            store_.forget_search_words()

    commands.on_forget.append(forget_words)
    pruner = Pruner(job_storage or storage, memory_config, on_archive=drop_vectors)
    memory_admin = MemoryAdminCommands(config, storage, [memory, job_memory], pruner, embeddings, store, resolver,
                                       personas)
    commands.extra_stats = memory_admin.stats_lines
    if embeddings is not None:
        def forget_vectors(user_key: str) -> None:  # ids are reused after a delete; kept queries hold a user's words
            embeddings.index.invalidate()
            embeddings.forget_queries()
            embeddings.forget_marks()  # the messages after theirs are embedded again at the next run

        commands.on_forget.append(forget_vectors)
        commands.embedding_backlog = embeddings.backlog_line
    return Cortex(
        store, files, resolver, tiers, updater, section, commands, memory, memory_commands, knowledge, embeddings,
        pruner, memory_admin,
    )
