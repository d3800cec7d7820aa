"""What a forget-me keeps of a user's use of the daily limits: no name, how much and when, under a digest.

Everything a forget-me deletes would otherwise start its daily limit afresh (a skill's calls per user, a
pair's cortex tokens), and forget-me in a loop would lift both. So before the rows go, their use of each limit
within ``KEPT_SECONDS`` is written to ``forgotten_usage``: when, how much, and a ``subject`` made of the
limit's kind, a digest of the user's key and the limit's name (the skill, the persona). The limits count those
rows beside the user's own; after two days they are deleted. (The bot's daily budget counts the forgotten
tokens of all users together, in ``forgotten_spending``.) A digest of a public id is pseudonymous, not anonymous:
whoever holds the database and knows someone's id can tell, for those two days, that they were forgotten and
what they used.
"""

from __future__ import annotations

import hashlib
import time
from typing import Literal

from bot.storage.engine import Tx

KEPT_SECONDS = 2 * 86_400.0  # a day's limit, and a spare day
USED_SINCE = "(SELECT coalesce(sum(amount), 0) FROM forgotten_usage WHERE subject = ? AND counted_at >= ?)"


def subject(kind: Literal["skill", "pair"], user_key: str, name: str = "") -> str:
    """The ``forgotten_usage`` subject of ``user_key``'s use of one limit (``name`` empty: its prefix)."""
    return f"{kind}:{hashlib.sha256(user_key.encode()).hexdigest()[:32]}:{name}"


async def keep_usage(tx: Tx, user_key: str) -> None:
    """Note the user's recent skill calls and cortex tokens before a forget-me deletes them (see above): per
    limit in ``forgotten_usage``, and the cortex tokens for the bot's daily budget in ``forgotten_spending``."""
    kept_since = time.time() - KEPT_SECONDS
    await tx.execute("INSERT INTO forgotten_usage (subject, counted_at, amount) SELECT CAST(? AS TEXT) || skill,"
                     " created_at, 1 FROM skill_executions WHERE user_key = ? AND created_at >= ?",
                     (subject("skill", user_key), user_key, kept_since))
    await tx.execute("INSERT INTO forgotten_usage (subject, counted_at, amount) SELECT CAST(? AS TEXT) || p.persona,"
                     " r.started_at, r.input_tokens + r.output_tokens FROM cortex_runs AS r"
                     " JOIN cortex_pairs AS p ON p.id = r.pair_id JOIN users AS u ON u.id = p.user_id"
                     " WHERE u.key = ? AND r.started_at >= ? AND r.input_tokens + r.output_tokens > 0",
                     (subject("pair", user_key), user_key, kept_since))
    await tx.execute("INSERT INTO forgotten_spending (started_at, tokens) SELECT r.started_at,"
                     " r.input_tokens + r.output_tokens FROM cortex_runs AS r"
                     " JOIN cortex_pairs AS p ON p.id = r.pair_id JOIN users AS u ON u.id = p.user_id"
                     " WHERE u.key = ? AND r.started_at >= ? AND r.input_tokens + r.output_tokens > 0",
                     (user_key, kept_since))
    await prune(tx)


async def prune(tx: Tx) -> int:
    """Delete what forget-mes kept (here and in ``forgotten_spending``) once it is older than ``KEPT_SECONDS``:
    at each forget-me and once a day (``Storage.prune_forgotten``); how many rows went."""
    kept_since = time.time() - KEPT_SECONDS
    usage = await tx.fetch_all("DELETE FROM forgotten_usage WHERE counted_at < ? RETURNING id", (kept_since,))
    spending = await tx.fetch_all("DELETE FROM forgotten_spending WHERE started_at < ? RETURNING id", (kept_since,))
    return len(usage) + len(spending)
