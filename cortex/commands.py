"""``!memory …`` (a user's own cortex files) and ``!cortex …`` (updates and admin settings).

Every ``memory`` command works on the pair of the user who asks and the persona of the channel:
there is no argument that names another user, so nobody can read, revert, reset or export another
user's files through any command.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from bot.commands import (
    Attachment,
    Command,
    CommandContext,
    CommandError,
    CommandRegistry,
    CommandReply,
    Handler,
    Param,
    file,
    flag,
    number,
    parse_number,
    place_word,
    text,
    word,
    words,
)
from bot.commands.files import attached_file
from bot.config import FREQUENCY_PRESETS, Config, CortexConfig
from bot.persona import PersonaSource
from bot.storage.base import Channel, Storage, User
from bot.text import plural
from cortex.export import (
    MAX_ARCHIVE_BYTES,
    ArchiveError,
    ExportBusy,
    Exports,
    ImportReport,
    export_filename,
    read_archive,
)
from cortex.files import CortexFiles, FileError, normalise_filename, unified_diff
from cortex.importing import Importer, ImportLimits
from cortex.settings import (
    OPERATOR_KEYS,
    OVERRIDABLE,
    PRIVACY_KEYS,
    SHOWN_UNSET,
    SettingError,
    SettingsResolver,
    persona_scope,
    server_scope,
    unknown_setting,
)
from cortex.store import FILENAMES, CortexRun, CortexStore, ForgetReport, Pair
from cortex.tiers import MANUAL, TierEngine, job_key, thresholds
from cortex.update import CortexUpdater

MAX_INLINE_CHARS = 6000
CONFIRM_WORD = "confirm"
EXPORT_IN_PUBLIC = ("Your export was posted where everyone in that channel can open it: delete that message now "
                    "(it holds everything I knew about you), and next time send it in a direct message with me.")
IMPORT_RENEW_SECONDS = 20.0  # a running import renews its mark this often
IMPORT_CLAIM_SECONDS = 90.0  # a mark not renewed for this long is an import whose process died

log = logging.getLogger(__name__)


# What an unset model or temperature means where it is shown (the model is not "not set": the persona's chat
# model does the updates); a stored "none" overrides a value beneath it (the config's, or the persona's).
UNSET_SHOWN = dict(zip(("model", "temperature"), SHOWN_UNSET, strict=True))
UNSET_MEANS = {key: f"none ({means})" for key, means in UNSET_SHOWN.items()}
NO_LIMIT = frozenset({"daily_token_budget", "bot_daily_token_budget"})  # 0 is no limit


def setting_text(value: object, key: str = "") -> str:
    """A setting's value as a person types it: on/off, not set, plain numbers and lists."""
    if value is None:
        return UNSET_SHOWN.get(key, "not set")
    if key in NO_LIMIT and value == 0:
        return "0 (no limit)"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def scope_words(scope: str) -> str:
    """How a reply names where a setting is set: the config file, the persona everywhere, or this server
    (a Matrix room): a reply is always about the server it was sent in, so no id is shown."""
    if scope == "config":
        return "the config file"
    if scope.startswith("persona:"):
        return "the persona everywhere"
    if scope.startswith("server:"):
        return f"this {place_word(scope.removeprefix('server:'))}"
    return scope


@dataclass
class CortexCommands:
    config: Config
    storage: Storage
    store: CortexStore
    files: CortexFiles
    resolver: SettingsResolver
    tiers: TierEngine
    updater: CortexUpdater
    personas: PersonaSource

    prefix: str = "!"
    extra_stats: Callable[[], Awaitable[list[str]]] | None = None  # the memory store's jobs and pruning
    # Each drops what could hold a forgotten user's data besides the rows (the cortex's and the core's caches, the
    # terminal's history file, the web page's kept HTML), told the user's key.
    on_forget: list[Callable[[str], None]] = field(default_factory=list)
    embedding_backlog: Callable[[], Awaitable[str]] | None = None  # how long until imports are found by meaning
    _importing: set[str] = field(default_factory=set)  # users whose import runs (one at a time each)
    # Archives read and imported one at a time in the process (another user's waits its turn): a parsed one takes
    # hundreds of megabytes whatever its zip's size (a 3 MB zip of a million short messages took 380 MB).
    _one_import: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    exports: Exports = field(init=False)

    def __post_init__(self) -> None:
        self.exports = Exports(self.store)

    def register(self, registry: CommandRegistry) -> None:
        p = self.prefix = registry.prefix
        any_file = word("file", "one of your cortex files", choices=FILENAMES)
        needed = word("file", "one of your cortex files", choices=FILENAMES, required=True)

        def version(name: str) -> Param:
            return number(name, "a version of that file", required=True, complete="versions")

        memory: list[tuple[str, tuple[Param, ...], str, Handler]] = [
            ("show", (any_file,), "show your cortex files (all, or one)", self.show),
            ("history", (needed,), "the versions of a file: who changed it, when and why", self.history),
            ("diff", (needed, version("v1"), version("v2")), "what changed between two versions", self.diff),
            ("revert", (needed, version("version")), "bring back an earlier version (as a new version)",
             self.revert),
            ("reset", (any_file,), "start a file (or all) over from the template", self.reset),
            ("edit", (needed, text("content", "the file's new text (or on the lines after the command)")),
             "replace a file with your own text", self.edit),
            ("export", (), "download everything the bot holds about you (zip of JSON and Markdown)", self.export),
            ("import", (file("archive", "a zip made by memory export (in the terminal: its path)", required=True),),
             "take an export of yours back in (what is here already is skipped)", self.import_archive),
            ("forget-me", (flag("confirm", "yes, delete everything", token=CONFIRM_WORD),),
             "delete everything the bot stores about you", self.forget_me),
        ]
        for name, params, summary, handler in memory:
            registry.register(Command(f"memory {name}", summary, handler, params, private=True))
        registry.register(Command("cortex update", "update your cortex files now", self.update, private=True))
        registry.register(Command(
            "cortex settings", f"show the cortex settings, or set one ({p}cortex settings <key> <value|default>)",
            self.settings, (word("key", "a setting's name"), words("value", "its new value, or default"),
                            flag("persona_scope", "set it for the persona, not this server", token="--persona")),
            admin=True,
        ))
        # (private: its recent errors are every pair's, and a provider's error may quote what it was sent)
        registry.register(Command("cortex stats", "cortex update runs, tokens and recent errors (bot-wide)",
                                  self.stats, admin=True, bot_admin=True, private=True))

    # -- helpers ---------------------------------------------------------------------------------

    async def _pair(self, ctx: CommandContext) -> tuple[User, Pair]:
        user, pair = await self.store.pair_for(ctx.user_key, ctx.user_name, ctx.persona)
        persona = self.personas.persona(ctx.persona)
        await self.files.ensure(pair, persona.language, user.display_name)
        return user, pair

    @staticmethod
    def _file_arg(args: Sequence[str], index: int = 0) -> str:
        if len(args) <= index:
            raise CommandError("Which file? " + ", ".join(FILENAMES))
        try:
            return normalise_filename(args[index])
        except FileError as exc:
            raise CommandError(str(exc)) from None

    def _int_arg(self, args: Sequence[str], index: int, what: str) -> int:
        if len(args) <= index:
            raise CommandError(f"which version? {what} is missing: give its number "
                               f"({self.prefix}memory history {self._file_arg(args)} lists them)")
        return parse_number(args[index], f"{what} (a version number)", prefix="v")

    def _long(self, text: str, filename: str, preformatted: str = "") -> CommandReply:
        """Long output goes as an attached file instead of flooding the chat."""
        if len(text) <= MAX_INLINE_CHARS:
            return CommandReply(text, private=True, preformatted=preformatted)
        return CommandReply(
            f"That is {len(text):,} characters long; it is attached as {filename}.",
            attachments=(Attachment(filename, text.encode()),), private=True,
        )

    # -- memory ----------------------------------------------------------------------------------

    async def show(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        _, pair = await self._pair(ctx)
        wanted = (self._file_arg(args),) if args else FILENAMES
        current = await self.store.current_all(pair.id)
        blocks = []
        for filename in wanted:
            version = current[filename]
            blocks.append(
                f"── {filename} (version {version.version}, {version.author}, "
                f"{version.created_at:%Y-%m-%d %H:%M} UTC) ──\n{version.content.rstrip()}"
            )
        return self._long("\n\n".join(blocks), "cortex-files.md")

    async def history(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        filename = self._file_arg(args)
        _, pair = await self._pair(ctx)
        lines = [f"Versions of {filename} (newest first):"]
        for v in reversed(await self.store.versions(pair.id, filename)):
            why = v.reason + (f", run {v.run_id}" if v.run_id else "")
            lines.append(f"  v{v.version}  {v.created_at:%Y-%m-%d %H:%M} UTC  {v.author:<6}  "
                         f"{len(v.content):>5} chars  {why}")
        last = next(iter(await self.store.runs(pair.id, limit=1)), None)
        if last is not None and last.status == "failed":  # (else a failed update would look like no update at all)
            lines.append(await self._failed_update(pair, last))
        return self._long("\n".join(lines), f"{filename}-history.txt", "text")

    async def _failed_update(self, pair: Pair, run: CortexRun) -> str:
        """The line on a failed last update: what it saved before it stopped (a run stopped by max_rounds, a
        budget, an overloaded server or a kill may have saved versions), or that the files stayed as they were."""
        saved = sorted({v.filename for v in await self.store.versions_of_runs(pair.id, [run.id])})
        names = " and ".join(filter(None, (", ".join(saved[:-1]), saved[-1]))) if saved else ""
        kept = f"Before it stopped it saved {names} (run {run.id})" if saved else "They stayed as they were"
        return (f"The last update of your files ({run.started_at:%Y-%m-%d %H:%M} UTC) failed: "
                f"{run.reason or 'an error stopped it'}. {kept}; the next one comes at the next tier, or now with "
                f"{self.prefix}cortex update.")

    async def diff(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        filename = self._file_arg(args)
        first, second = self._int_arg(args, 1, "v1"), self._int_arg(args, 2, "v2")
        _, pair = await self._pair(ctx)
        try:
            a = await self.files.get_version(pair, filename, first)
            b = await self.files.get_version(pair, filename, second)
        except FileError as exc:
            raise CommandError(str(exc)) from None
        text = await asyncio.to_thread(unified_diff, a, b)  # (bounded work, but up to a tenth of a second)
        return self._long(text, f"{filename}-v{first}-v{second}.diff", "diff")

    async def revert(self, ctx: CommandContext, args: Sequence[str]) -> str:
        filename = self._file_arg(args)
        number = self._int_arg(args, 1, "version")
        _, pair = await self._pair(ctx)
        try:
            saved = await self.files.revert(pair, filename, number)
        except FileError as exc:
            raise CommandError(str(exc)) from None
        if saved is None:
            return f"{filename} already has the content of version {number}; nothing changed."
        return f"{filename} is back to the content of version {number}, saved as version {saved.version}."

    async def reset(self, ctx: CommandContext, args: Sequence[str]) -> str:
        user, pair = await self._pair(ctx)
        wanted = (self._file_arg(args),) if args else FILENAMES
        persona = self.personas.persona(ctx.persona)
        try:
            changed = await self.files.reset(pair, wanted, persona.language, user.display_name)
        except FileError as exc:
            raise CommandError(str(exc)) from None
        if not changed:
            return "Nothing to reset: already as the template."
        return (f"Reset to the template: {', '.join(changed)}. Earlier versions stay in the history "
                f"(revert brings them back).")

    async def edit(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        filename = self._file_arg(args)
        if not ctx.body.strip():
            return CommandReply(
                f"Send the complete new {filename} on the lines after the command.", private=True,
                needs_body=f"New content of {filename}; end with a line holding only a dot (.)",
            )
        _, pair = await self._pair(ctx)
        try:
            saved = await self.files.edit(pair, filename, ctx.body.strip() + "\n")
        except FileError as exc:
            raise CommandError(str(exc)) from None
        if saved is None:
            return CommandReply(f"{filename} already has exactly that content; nothing changed.", private=True)
        return CommandReply(f"Saved your {filename} as version {saved.version}.", private=True)

    async def export(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        user, _ = await self._pair(ctx)
        try:
            everything, data = await self.exports.archive(user)
        except ExportBusy as exc:
            raise CommandError(str(exc)) from None
        items = sum(len(p["memory_items"]) for p in everything["personas"])
        return CommandReply(
            f"Everything the bot holds about you: {plural(len(everything['personas']), 'persona')}: files with every "
            f"version, {plural(items, 'memory item')}, {plural(len(everything['messages']), 'message')} and the "
            f"update log ({len(data):,} bytes; README.md inside says what is where).",
            attachments=(Attachment(export_filename(user), data),), private=True,
        )

    async def import_archive(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        _, blob = await attached_file(ctx, args, "your export (the zip !memory export made)", MAX_ARCHIVE_BYTES)
        user, _ = await self._pair(ctx)
        busy = CommandError("an import of yours is still running; wait for its answer")
        if user.key in self._importing:  # a resent command: both would find nothing there yet, and write twice
            raise busy
        token, now = uuid.uuid4().hex, await self.store.storage.now()  # (compared by other processes)
        exports = self.store.storage.export
        if not await exports.claim_import(user.key, token, now, now - IMPORT_CLAIM_SECONDS):
            raise await self._busy_elsewhere(user.key)  # sent to another process sharing the database
        self._importing.add(user.key)
        renewing = asyncio.create_task(self._renew_import(user.key, token))
        try:
            report = await self._import(ctx, user, blob)
        except ArchiveError as exc:  # (about the archive, or a forget-me meanwhile: the usage would not help)
            return CommandReply(f"{EXPORT_IN_PUBLIC} {exc}" if ctx.attachments_seen_by_all else str(exc),
                                private=True, failed=True)
        finally:
            renewing.cancel()
            self._importing.discard(user.key)
            await exports.release_import(user.key, token)
        text = report.line(self.prefix)
        if ctx.attachments_seen_by_all:
            text = f"{EXPORT_IN_PUBLIC} {text}"
        if (report.items or report.messages) and self.embedding_backlog is not None:
            try:
                text += " " + await self.embedding_backlog()
            except Exception:  # the import is done: a status that cannot be read must not say otherwise
                log.exception("could not read the embedding backlog after an import")
        return CommandReply(text, private=True)

    async def _import(self, ctx: CommandContext, user: User, blob: bytes) -> ImportReport:
        """Read the archive and import it, once no other import runs in the process (what it parsed is let go
        when this returns)."""
        async with self._one_import:
            data = await asyncio.to_thread(read_archive, blob)  # a large archive must not stall the replies
            limits = ImportLimits(self.config.memory.max_item_chars, self.config.bot.max_message_chars,
                                  self.updater.estimator.raw_count)
            return await Importer(self.store, self.files, self.personas, limits).run(
                user, data, await self._dm_channel(ctx))

    async def _renew_import(self, user_key: str, token: str) -> None:
        """Renew the import's mark while it runs, so that a process that dies mid-import blocks the user's next
        import for ``IMPORT_CLAIM_SECONDS`` at most (a failed renewal is retried at the next beat)."""
        while True:
            await asyncio.sleep(IMPORT_RENEW_SECONDS)
            try:
                await self.store.storage.export.renew_import(user_key, token, await self.store.storage.now())
            except Exception:
                log.warning("could not renew the mark of %s's running import", user_key, exc_info=True)

    async def _busy_elsewhere(self, user_key: str) -> CommandError:
        """Another process runs an import of the user's, or ran one and stopped: then when to try again."""
        marked = await self.store.storage.export.import_marked_at(user_key)
        now = await self.store.storage.now()
        wait = IMPORT_CLAIM_SECONDS if marked is None else max(marked + IMPORT_CLAIM_SECONDS - now, 1.0)
        return CommandError("an import of yours is still running (sent before, perhaps where another of the bot's "
                            "processes answers); wait for its answer. If none comes (the bot restarted meanwhile), "
                            f"send the import again in {math.ceil(wait)} s.")

    async def _dm_channel(self, ctx: CommandContext) -> Channel | None:
        """The direct-message channel a command was sent in (made if new), or None outside one."""
        if not ctx.is_dm:
            return None
        storage = self.store.storage
        channel = await storage.get_channel(ctx.channel_key) or await storage.upsert_channel(ctx.channel_key, "", True)
        return channel if channel.is_dm else None

    async def forget_user(self, user_key: str) -> ForgetReport | None:
        """Everything about one user goes, and every cache that could hold their rows (chat and web page)."""
        report = await self.store.forget_user(user_key)
        for forget in self.on_forget:  # ids are reused after a delete: no cache may keep the old owner's rows
            forget(user_key)
        return report

    async def forget_me(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        prefix = self.prefix
        if not args or args[0].lower() != CONFIRM_WORD:
            return CommandReply(
                "This deletes everything the bot stores about you, for every persona: your messages and the "
                "replies to you, your cortex files with all their versions, your memory items (archived ones "
                "too), the update log, your skill runs and your web page logins. Rolling "
                "summaries of conversations you were part of are deleted too and written anew from what "
                f"remains. This cannot be undone (export first if you want a copy).\nTo go ahead, send: "
                f"{prefix}memory forget-me {CONFIRM_WORD}",
                private=True,
            )
        report = await self.forget_user(ctx.user_key)
        if report is None:
            return CommandReply("The bot stores nothing about you (web page links and logins you had, if any, "
                                "are ended).", private=True)
        return CommandReply(
            f"Done. Deleted {plural(report.messages, 'message')}, {plural(report.versions, 'file version')} of "
            f"{plural(report.pairs, 'persona')}, {plural(report.items, 'memory item')}, "
            f"{plural(report.runs, 'update run')} and {plural(report.summaries, 'summary', 'summaries')} that could "
            f"mention you.{await self._still_paused(ctx.user_key)}",
            private=True,
        )

    async def paused_personas(self, user_key: str) -> list[str]:
        """The personas a user is incognito with (a forget-me keeps a pause going: ``Storage.forget_user``)."""
        user = await self.storage.get_user(user_key)
        return await self.storage.incognito.personas(user.id) if user is not None else []

    async def _still_paused(self, user_key: str) -> str:
        personas = await self.paused_personas(user_key)
        if not personas:
            return ""
        return (f" You are still incognito with {', '.join(personas)}: what you say there is deleted when you "
                f"send {self.prefix}memory resume.")

    # -- cortex ----------------------------------------------------------------------------------

    async def update(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply:
        _, pair = await self._pair(ctx)
        effective = await self.resolver.effective(pair.persona, ctx.server_key)
        if await self.storage.active_job(job_key(pair.id)) is not None:
            return CommandReply("An update of your files is already queued or running.", private=True)
        reason = await self.updater.guard(pair, effective.settings)
        if reason is not None:
            return CommandReply(f"Not now: {reason}.", private=True)
        if await self.tiers.request_update(pair, MANUAL, ctx.server_key) is None:  # one came in meanwhile
            return CommandReply("An update of your files is already queued or running.", private=True)
        steps = ", ".join(f"{pct}% at {at}" for pct, at in thresholds(effective.settings))
        return CommandReply(
            f"Update queued; your files change in the background (see {self.prefix}memory history). This cycle: "
            f"{pair.cycle_count}/{effective.settings.context_limit} messages, tiers {steps}.",
            private=True,
        )

    async def _one_setting(self, ctx: CommandContext, key: str, *, persona_wide: bool) -> str:
        """``!cortex settings KEY [--persona]``: its value here (or for the persona everywhere) and where it comes
        from, and how to change it, or who may."""
        effective = await self.resolver.effective(ctx.persona, None if persona_wide else ctx.server_key)
        if key not in effective.sources:
            raise CommandError(unknown_setting(key))
        value, where = setting_text(getattr(effective.settings, key), key), "everywhere" if persona_wide else "here"
        flag = " --persona" if persona_wide and ctx.server_key else ""
        if key not in OVERRIDABLE:
            how = f"it is set in the config file only ([cortex] {key})"
        elif (key in OPERATOR_KEYS or (persona_wide and ctx.server_key)) and not ctx.is_bot_admin:
            how = "only the bot's admins change it"
        elif key in PRIVACY_KEYS and not ctx.is_bot_admin:  # (what was said in private: switched on by them alone)
            how = (f"you may switch it off here ({self.prefix}cortex settings {key} off); only the bot's admins "
                   "switch it on")
        else:
            how = f"change it with {self.prefix}cortex settings {key} <{OVERRIDABLE[key]}>{flag}"
        return f"{key} for {ctx.persona} {where}: {value} (from {scope_words(effective.sources[key])}); {how}."

    async def settings(self, ctx: CommandContext, args: Sequence[str]) -> str | CommandReply:
        words = [a for a in args if a != "--persona"]
        if words:  # (setting names are small letters: "Model" is model)
            words[0] = words[0].lower()
        scope = persona_scope(ctx.persona) if "--persona" in args or not ctx.server_key else server_scope(
            ctx.server_key)
        if len(words) == 1:  # reading one (persona-wide with --persona, or in a DM)
            return await self._one_setting(ctx, words[0], persona_wide=scope == persona_scope(ctx.persona))
        if words:
            if scope == persona_scope(ctx.persona) and not ctx.is_bot_admin:
                raise CommandError("A persona-wide setting changes every server and direct message: that is for the "
                                   "bot's admins. Server admins set it for their server (without --persona).")
            key, value = words[0], " ".join(words[1:])
            if not value.strip():  # `model ""`: stored as "not set", answered "set to not set"
                raise CommandError(f"Give a value for {key}: {OVERRIDABLE.get(key, 'see the list')}")
            try:
                changed = await self.resolver.change(scope, key, value, bot_admin=ctx.is_bot_admin, author=ctx.user_key)
            except SettingError as exc:
                raise CommandError(str(exc)) from None
            stored = UNSET_MEANS.get(key, "not set") if changed.stored is None else setting_text(changed.stored, key)
            note = (f"set to {stored}" if changed.cleared is None
                    else "override removed" if changed.cleared else "there was no override")
            effective = await self.resolver.effective(ctx.persona, ctx.server_key)
            now = setting_text(getattr(effective.settings, key), key)
            done = (f"{key}: {note} for {scope_words(scope)}. Effective now: {now} "
                    f"(from {scope_words(effective.sources[key])}).")
            if key in ("frequency", "tiers"):  # the tiers decide when both are set: say what the plan is now
                done += " " + self._tier_plan(effective.settings, effective.sources)
            return done + (f" (Its name was {changed.note}.)" if changed.note else "")
        effective = await self.resolver.effective(ctx.persona, ctx.server_key)
        here = f" in {scope_words(server_scope(ctx.server_key))}" if ctx.server_key else ""
        lines = [f"Cortex settings for persona {ctx.persona}{here} (value, where it comes from):"]
        for key, value in effective.settings.model_dump().items():
            mark = "" if key in OVERRIDABLE else "  (config only)"
            lines.append(f"  {key:<22} {setting_text(value, key):<24} {scope_words(effective.sources[key])}{mark}")
        lines.append(self._tier_plan(effective.settings, effective.sources) + " Presets: " + "; ".join(
            f"{name} {'/'.join(map(str, pcts))}%" for name, pcts in FREQUENCY_PRESETS.items()))
        lines.append(f"Change with: {self.prefix}cortex settings <key> <value|default> [--persona]; "
                     f"keys: {', '.join(OVERRIDABLE)}")
        return CommandReply("\n".join(lines), preformatted="text")  # in columns

    @staticmethod
    def _tier_plan(settings: CortexConfig, sources: Mapping[str, str]) -> str:
        steps = ", ".join(f"{pct}% → message {at}" for pct, at in thresholds(settings))
        if not settings.tiers:
            return f"Tiers this cycle: {steps}."
        return (f"Tiers this cycle: {steps}, from tiers ({scope_words(sources['tiers'])}), which decide over "
                f"frequency while set (tiers none where you set frequency lets it decide there).")

    async def stats(self, ctx: CommandContext, args: Sequence[str]) -> str:
        day_start = time.time() - 86_400
        lines = []
        for title, since in (("Last 24 hours", day_start), ("All time", 0.0)):
            s = await self.store.run_stats(since)
            outcomes = ", ".join(f"{n} {status}" for status, n in sorted(s.by_status.items())) or "none"
            held = (" (a running update's next call counts at the most it may take until it answers)"
                    if s.by_status.get("running") else "")
            lines.append(f"{title}: runs {outcomes}; tokens {s.input_tokens:,} in / {s.output_tokens:,} out{held}; "
                         f"average duration {s.average_duration_ms / 1000:.1f} s")
        errors = (await self.store.run_stats(0.0)).last_errors
        if errors:
            lines.append("Recent failures:")
            lines += [f"  run {r.id} (pair {r.pair_id}, tier {r.tier}, {r.started_at:%Y-%m-%d %H:%M} UTC): "
                      f"{r.reason or r.error}" for r in errors]
        if self.extra_stats is not None:
            lines += await self.extra_stats()
        return "\n".join(lines)
