"""The cortex's view of storage: the cortex repository of ``bot.storage`` plus what commands need on top
(the user and their pair in one call, forget-me through the storage's one operation)."""

from __future__ import annotations

from bot.storage.base import User
from bot.storage.core import Storage
from bot.storage.cortex import (
    FILENAMES,
    Author,
    CortexRepository,
    CortexRun,
    FileVersion,
    ForgetReport,
    Pair,
    RunStats,
    RunStatus,
)

__all__ = [
    "FILENAMES", "Author", "CortexRun", "CortexStore", "FileVersion", "ForgetReport", "Pair", "RunStats", "RunStatus",
]


class CortexStore(CortexRepository):
    def __init__(self, storage: Storage) -> None:
        super().__init__(storage.db)
        self.storage = storage

    async def pair_for(self, user_key: str, user_name: str, persona: str) -> tuple[User, Pair]:
        """The user (created or renamed) and their pair with ``persona`` (created), for commands."""
        user = await self.storage.upsert_user(user_key, user_name)
        return user, await self.count_messages(user.id, persona, 0)

    async def forget_user(self, user_key: str) -> ForgetReport | None:
        """Everything about one user goes, in one transaction (see ``Storage.forget_user``)."""
        report = await self.storage.forget_user(user_key)
        self._prompt_files.clear()
        return report
