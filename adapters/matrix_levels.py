"""Room power levels as the homeserver holds them, for the admin checks (``MatrixAdapter.power_level``).

nio merges each new ``m.room.power_levels`` event into the room's levels (``users.update``): a user taken out of
the list (Element's ``/deop``, or any client that drops the entry to give them the default level) kept the level
they had, so a demoted room admin still ran the room's admin commands (until the bot restarted). Here each new
power levels event replaces the room's levels whole, as it does on the homeserver.
"""

from __future__ import annotations

from typing import Any

from nio import MatrixRoom
from nio.events.room_events import PowerLevels


class WholeLevels(PowerLevels):  # type: ignore[misc]  # (nio ships no types)
    """A room's power levels that a newer event replaces whole (nio's merge kept entries it no longer has)."""

    def update(self, new_levels: Any) -> None:
        if isinstance(new_levels, PowerLevels):
            self.defaults = new_levels.defaults
            self.users, self.events = dict(new_levels.users), dict(new_levels.events)


def replaced_whole(room: MatrixRoom | None) -> None:
    """Before nio reads a sync's state of a room it knows: its levels replaced whole by a newer event (a room new
    to it starts from empty levels, which its first events fill as they are)."""
    if room is not None and not isinstance(room.power_levels, WholeLevels):
        old = room.power_levels
        room.power_levels = WholeLevels(old.defaults, dict(old.users), dict(old.events))
