"""Commands of the conversation core: the channel's rolling summary and the reply metrics."""

from __future__ import annotations

from collections.abc import Sequence

from bot.commands import Command, CommandContext, CommandRegistry, CommandReply, operators
from bot.storage.base import ReplyMetrics, Storage
from bot.text import plural
from bot.tokens import TokenEstimator


def _metrics_lines(title: str, m: ReplyMetrics) -> list[str]:
    return [
        f"{title}: {plural(m.replies, 'reply')}",
        f"  token utilisation   {m.token_utilisation:6.1%}  (history tokens used / budget)",
        f"  trim rate           {m.trim_rate:6.1%}  (replies whose window left messages out)",
        f"  summary hit rate    {m.summary_hit_rate:6.1%}  (replies whose prompt carried a summary)",
        f"  summary generation  {m.summary_generation_rate:6.1%}  "
        f"({plural(m.summaries_written, 'summary')} written, {m.summaries_rejected} rejected)",
    ]


def register_core_commands(registry: CommandRegistry, storage: Storage, estimator: TokenEstimator) -> None:
    async def summary(context: CommandContext, args: Sequence[str]) -> str:
        if context.history_since_join and not context.is_dm:
            return ("This room shows its members only what was said since they joined, so I don't post a "
                    "summary of its earlier conversation here.")
        channel = await storage.get_channel(context.channel_key)
        latest = await storage.latest_summary(channel.id) if channel else None
        if channel is None or latest is None:
            return "This conversation has no rolling summary yet (one is written once older messages leave the window)."
        return (
            f"Rolling summary v{latest.version} ({latest.token_count} tokens, messages up to #{latest.covers_to_id}, "
            f"{latest.created_at:%Y-%m-%d %H:%M} UTC):\n{latest.text}"
        )

    async def stats(context: CommandContext, args: Sequence[str]) -> str | CommandReply:
        channel = await storage.get_channel(context.channel_key)
        lines: list[str] = []
        if channel is not None:
            lines += _metrics_lines("This conversation", await storage.reply_metrics(channel.id))
        if not context.is_bot_admin:  # (the whole bot's figures are its admins': a room's admin sees its own room's)
            return "\n".join(lines or ["This conversation has no replies yet."])
        lines += _metrics_lines("All conversations", await storage.reply_metrics())
        jobs = await storage.job_counts()  # (one query: three counts showed a job that moved on meanwhile twice)
        lines.append(f"Background jobs: {jobs.get('queued', 0)} queued, {jobs.get('running', 0)} running, "
                     f"{jobs.get('failed', 0)} failed")
        lines.append(f"Token estimate calibration factor: {estimator.factor:.2f}")
        return operators(context, "\n".join(lines))

    registry.register(Command("summary", "show this conversation's rolling summary", summary))
    registry.register(Command("stats", "history window and summary metrics (bot admins: of the whole bot too, "
                                      "and its background jobs)", stats))
