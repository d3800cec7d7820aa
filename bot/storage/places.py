"""A place (a server, a channel) replaced by another: a Matrix room upgrade makes a new room for an old one, and
what its admins set for the old one (keyed by its id) is set for the new one too, so that an upgrade does not
silently drop the room's guidelines, cortex settings or persona.

Only what the new place does not hold yet is copied: what its admins set there already stays.
"""

from __future__ import annotations

import time

from bot.storage.engine import Database
from bot.storage.personas import LATEST


class PlaceRepository:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def carry_over(self, old: str, new: str, *, author: str, reason: str) -> None:
        """Copy the guidelines and cortex settings of the server ``old`` (a key: ``matrix:!room``) and the persona
        picked for the channel ``old`` to ``new``, in one transaction. The guidelines come as version 1 of each
        text, only when ``new`` has none (not even a cleared one); the settings key by key."""
        now = time.time()
        async with self.db.transaction() as tx:
            await tx.execute(
                "INSERT INTO versioned_texts (kind, scope, name, version, content, position, enabled, author, reason,"
                " created_at) SELECT kind, ?, name, 1, content, position, enabled, ?, ?, CAST(? AS DOUBLE PRECISION)"
                f" FROM versioned_texts t WHERE kind = 'guidelines' AND scope = ? AND {LATEST} AND content <> ''"
                " AND NOT EXISTS (SELECT 1 FROM versioned_texts n WHERE n.kind = 'guidelines' AND n.scope = ?)"
                " ON CONFLICT DO NOTHING",
                (new, author, reason, now, old, new))
            # (the scope of cortex.settings.server_scope, the key of bot.storage.core.channel_persona_key)
            await tx.execute(
                "INSERT INTO cortex_settings (scope, key, value, updated_by, updated_at)"
                " SELECT ?, key, value, ?, CAST(? AS DOUBLE PRECISION) FROM cortex_settings WHERE scope = ?"
                " ON CONFLICT (scope, key) DO NOTHING",
                (f"server:{new}", author, now, f"server:{old}"))
            await tx.execute(
                "INSERT INTO settings (key, value, updated_at) SELECT ?, value, CAST(? AS DOUBLE PRECISION)"
                " FROM settings WHERE key = ? ON CONFLICT (key) DO NOTHING",
                (f"persona.channel.{new}", now, f"persona.channel.{old}"))
