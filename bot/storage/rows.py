"""Row helpers shared by the repositories: times and the message columns."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from bot.storage.base import StoredMessage
from bot.storage.engine import Row

MESSAGE_COLUMNS = "id, channel_id, user_id, persona, role, author_name, text, token_count, seq, created_at, reply_to"
MESSAGE_COLUMN_COUNT = len(MESSAGE_COLUMNS.split(","))  # (a query's columns after them start at this index)


def ts(value: datetime | None) -> float:
    return time.time() if value is None else value.timestamp()


def dt(value: float) -> datetime:
    return datetime.fromtimestamp(float(value), tz=UTC)


def message_from_row(row: Row) -> StoredMessage:
    """A message from a row of ``MESSAGE_COLUMNS``, in that order."""
    return StoredMessage(int(row[0]), int(row[1]), None if row[2] is None else int(row[2]), row[3], row[4], row[5],
                         row[6], int(row[7]), int(row[8]), dt(row[9]), None if row[10] is None else int(row[10]))
