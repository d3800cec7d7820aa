"""Admin commands for the memory store: ``!cortex prune|weights|budgets|embedder``, and the background
jobs' lines in ``!cortex stats``.

They show counts and settings only, never anybody's memory content.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from bot.commands import Command, CommandContext, CommandError, CommandRegistry, CommandReply, operators, words
from bot.config import Config, ConfigError
from bot.persona import ConfigPersonas, PersonaSource
from bot.scheduler import Scheduler
from bot.storage.core import Storage
from bot.summary import Budgets, budgets_for
from bot.text import shown
from cortex.memory.embedding import EmbeddingService
from cortex.memory.store import MemoryStore, Weights, configured_weights
from cortex.memory.upkeep import Pruner
from cortex.settings import OPERATOR_KEYS, OVERRIDABLE, SettingsResolver
from cortex.store import CortexStore
from cortex.update import utc_midnight

WEIGHTS_SETTING = "memory.weights"
SIGNALS = tuple(f.name for f in fields(Weights))


def parse_weights(args: Sequence[str], current: Weights) -> Weights:
    """``vector=0.6 text=0.3`` (signals not named keep their value) as new weights."""
    changes: dict[str, float] = {}
    for arg in args:
        name, _, value = arg.partition("=")
        if name not in SIGNALS or not value:
            problem = (f"{shown(name)} is no signal. " if name not in SIGNALS and "=" in arg
                       else f"{shown(name)} has no value. " if name in SIGNALS else "")
            raise CommandError(f"{problem}Write signal=value, e.g. vector=0.6; signals: {', '.join(SIGNALS)}.")
        if name in changes:
            raise CommandError(f"{name} is given twice; give each signal once")
        try:
            number = float(value)
        except ValueError:
            raise CommandError(f"{name}: {shown(value)} is not a number") from None
        if not 0 <= number <= 10:
            raise CommandError(f"{name}: a weight is a number from 0 to 10")
        changes[name] = number
    weights = replace(current, **changes)
    if not any(getattr(weights, s) for s in SIGNALS if s != "author"):  # author only lifts what the others rank
        raise CommandError("At least one weight other than author must be above 0.")
    return weights


def _weights_line(weights: Weights) -> str:
    return ", ".join(f"{s} {getattr(weights, s):g}" for s in SIGNALS)


BUDGET_KEYS = ("daily_token_budget", "bot_daily_token_budget", "prompt_tokens", "history_tokens", "max_tokens",
               "max_rounds")


def budget_pointer(prefix: str, *, bot_admin: bool) -> str:
    """Where each budget shown is changed, for the one who asks: the settings command takes only its
    overridable keys, and of those only a bot admin changes what the operator pays for."""
    here = [key for key in BUDGET_KEYS if key in OVERRIDABLE and (bot_admin or key not in OPERATOR_KEYS)]
    theirs = [] if bot_admin else [key for key in BUDGET_KEYS if key in OPERATOR_KEYS]
    file_only = [key for key in BUDGET_KEYS if key not in OVERRIDABLE]
    parts = [f"Change {', '.join(here)} here with {prefix}cortex settings <key> <value>"] if here else []
    if theirs:
        parts.append(f"only the bot's admins change {', '.join(theirs)} (the operator pays for them)")
    parts.append(f"{', '.join(file_only)} and the reply prompt budgets ([history], [memory]) are set in the config "
                 "file.")
    return "; ".join(parts)


@dataclass
class MemoryAdminCommands:
    config: Config
    storage: Storage
    stores: Sequence[MemoryStore]  # every store whose ranking the weights change
    pruner: Pruner
    embeddings: EmbeddingService | None
    cortex_store: CortexStore
    resolver: SettingsResolver
    personas: PersonaSource | None = None  # (a persona's own reply budgets: None, the config's)
    scheduler: Scheduler | None = None  # set by the app once it runs its jobs
    prefix: str = "!"

    def register(self, registry: CommandRegistry) -> None:
        p = self.prefix = registry.prefix
        for name, summary, handler, params, bot_wide in (
            ("prune", "archive unused memory items now, bot-wide (report per category)", self.prune, (), True),
            ("weights", f"show or set the search weights ({p}cortex weights vector=0.6 …, or default)",
             self.weights, (words("values", "signal=value pairs, or default"),), False),
            ("budgets", "token budgets of prompts and cortex updates, and today's spending", self.budgets, (),
             False),
            ("embedder", "the embedder, how much is embedded, backfill progress and errors (bot-wide)",
             self.embedder, (), True),
        ):
            registry.register(Command(f"cortex {name}", summary, handler, params, admin=True, bot_admin=bot_wide))

    async def load(self) -> None:
        """Apply the weights an admin saved (they outlive restarts; the app reloads them every few seconds,
        so a change made through another process sharing the database arrives here too)."""
        saved = await self.storage.get_setting(WEIGHTS_SETTING)
        if not saved:
            self._apply(configured_weights(self.config.memory))
            return
        try:
            # A signal the saved weights lack (saved by an older version) keeps the config file's weight.
            self._apply(replace(configured_weights(self.config.memory),
                                **{k: float(v) for k, v in json.loads(saved).items() if k in SIGNALS}))
        except (ValueError, TypeError):
            pass

    def _apply(self, weights: Weights) -> None:
        for store in self.stores:
            store.weights = weights

    async def prune(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply | str:
        return operators(ctx, "\n".join((await self.pruner.prune()).lines()))  # (the whole bot's counts)

    async def weights(self, ctx: CommandContext, args: Sequence[str]) -> str:
        current = self.stores[0].weights
        if not args:
            return (f"Search weights: {_weights_line(current)}. Each signal is scaled to 0-1 first; "
                    f"half-life of recency: {self.config.memory.half_life_days:g} days.")
        if not ctx.is_bot_admin:
            raise CommandError("The search weights are the same for every server: changing them is for the bot's "
                               "admins.")
        if list(args) == ["default"]:
            weights = configured_weights(self.config.memory)
            await self.storage.set_setting(WEIGHTS_SETTING, "")
        else:
            weights = parse_weights(args, current)
            await self.storage.set_setting(WEIGHTS_SETTING, json.dumps({s: getattr(weights, s) for s in SIGNALS}))
        self._apply(weights)
        return f"Search weights now: {_weights_line(weights)}."

    async def budgets(self, ctx: CommandContext, args: Sequence[str]) -> str | CommandReply:
        settings = (await self.resolver.effective(ctx.persona, ctx.server_key)).settings
        spending = "."  # the whole bot's spending is for bot admins
        if ctx.is_bot_admin:
            spent = await self.cortex_store.tokens_since(utc_midnight(time.time()))
            spending = f"; spent today (UTC): {spent:,} tokens."
        pair_budget = f"{settings.daily_token_budget:,}" if settings.daily_token_budget else "unlimited"
        bot_budget = f"{settings.bot_daily_token_budget:,}" if settings.bot_daily_token_budget else "unlimited"
        c = self.config
        reply = self._reply_budgets(ctx.persona)
        text = "\n".join([
            f"Reply prompt budgets (tokens): history {reply.history_tokens:,}, summary "
            f"{reply.summary_tokens:,}, cortex files {settings.prompt_tokens:,}, knowledge "
            f"{c.memory.prompt_tokens:,} ({c.memory.relevant_items} items, {c.memory.recalled_messages} "
            "recalled messages).",
            f"Cortex updates: {settings.history_tokens:,} tokens of conversation each, at most "
            f"{settings.max_tokens:,} out per call and {settings.max_rounds} rounds.",
            f"Daily cortex budgets: {pair_budget} per user, {bot_budget} for the bot{spending}",
            budget_pointer(self.prefix, bot_admin=ctx.is_bot_admin),
        ])
        return operators(ctx, text) if ctx.is_bot_admin else text

    def _reply_budgets(self, persona: str) -> Budgets:
        """The history and summary budgets a reply of ``persona`` uses (its own, where it sets them)."""
        try:
            return budgets_for(self.config, (self.personas or ConfigPersonas(self.config)).persona(persona))
        except ConfigError:  # (a persona deleted since the channel picked it)
            return budgets_for(self.config, ConfigPersonas(self.config).persona(None))

    async def embedder(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply | str:
        """Privately outside a DM: the embedding server's last error may quote what it was sent (a person's
        memory item), and its address and the whole bot's counts are the operator's."""
        if self.embeddings is None:
            return "No embedder: [memory] embedder = \"none\"; search uses full text and the other signals only."
        s = await self.embeddings.status()
        total = s.items_total + s.messages_total
        done = total - s.pending
        percent = 100.0 if not total else 100.0 * done / total
        lines = [
            f"Embedder: {s.model}.",
            f"Embedded: {s.items_embedded:,} of {s.items_total:,} memory items, {s.messages_embedded:,} of "
            f"{s.messages_total:,} messages ({percent:.0f}%).",
        ]
        if s.pending and s.texts_per_second:
            eta = f", about {s.pending / s.texts_per_second / 60:.0f} min to go"
            lines.append(f"Backfill in progress: {s.pending:,} left at {s.texts_per_second:.0f} texts/s{eta}.")
        elif s.pending:  # (no run has measured a speed yet: none ran, or none embedded anything)
            lines.append(f"Waiting to be embedded: {s.pending:,}; the background embedding runs every "
                         f"{self.config.memory.backfill_seconds:g} s.")
        if s.last_run is not None and s.last_run_at is not None:
            lines.append(f"Last backfill {time.strftime('%H:%M', time.gmtime(s.last_run_at))} UTC: "
                         f"{s.last_run.items} items, {s.last_run.messages} messages in {s.last_run.seconds:.1f} s.")
        if s.last_error:
            lines.append(f"Last error: {s.last_error}")
        return operators(ctx, "\n".join(lines))

    async def stats_lines(self) -> list[str]:
        """Background jobs and the last pruning, for ``!cortex stats``."""
        lines = []
        if self.scheduler is not None and self.scheduler.jobs:
            lines.append("Background jobs:")
            lines += [f"  {job.describe()}" for job in self.scheduler.jobs.values()]
        last = await self.pruner.last_report()
        if last is not None:
            lines += last.lines()
        return lines
