"""``!memory remember|forget|pin|unpin|list|search|archived|restore``: a user's own memory items.

Like the file commands these act only on the asking user's pair with the channel's persona; list and
search views do not count as accesses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from bot.commands import (
    Command,
    CommandContext,
    CommandError,
    CommandRegistry,
    CommandReply,
    Handler,
    Param,
    flag,
    number,
    option,
    parse_number,
    text,
    word,
)
from bot.storage.sources import ReplySource
from bot.text import inert, plural, shown
from cortex.memory.store import CATEGORIES, SCOPES, AlreadyRemembered, MemoryError, MemoryItem, MemoryStore, Scope
from cortex.store import CortexStore

PAGE = 10


def _line(item: MemoryItem) -> str:
    """An item as one line of a list (its own line breaks would break the list, and a line of its own such as a
    code fence or a heading, or a code span or spoiler begun in it, would change how the rest of the reply
    renders)."""
    marks = ("📌 " if item.pinned else "") + (f"[{item.category}] ") + ("(shared) " if item.scope == "shared" else "")
    when = f"{item.created_at:%Y-%m-%d}"
    return f"#{item.id} {marks}{inert(item.content)}  (importance {item.importance}, {when})"


def _escaped(text: str) -> CommandReply:
    """An answer quoting items or messages through :func:`inert` (the memory commands answer privately)."""
    return CommandReply(text, private=True, escaped=True)


def _why_archived(item: MemoryItem) -> str:
    if item.archived_at is None:  # expired, not pruned yet
        return f"  — expired {item.expires_at:%Y-%m-%d}" if item.expires_at is not None else ""
    return f"  — archived: {inert(item.archive_reason, 200)}"  # (the model's words: a code fence broke the list)


FROM = "--from"
MAX_SEARCH_CHARS = 1000  # of a !memory search
OF = "--of"
MESSAGE_REF = re.compile(r"[a-z][a-z0-9]*-message:\S+")  # how every adapter names a message


def source_ref(text: str, flag: str = FROM) -> str:
    """Where an item came from, as a platform names a message (``discord-message:123``, ``matrix-message:$ev``):
    anything else is refused, not looked up (``--from abc`` found nothing and said so, as if it were a message)."""
    ref = text.strip()
    if not ref or len(ref) > 200 or not ref.isprintable() or " " in ref:
        raise CommandError(f"{flag} needs a message reference like discord-message:123")
    if MESSAGE_REF.fullmatch(ref) is None:
        raise CommandError(f"{shown(ref)} is not a message reference; {flag} takes one like discord-message:123")
    return ref


@dataclass
class MemoryCommands:
    pairs: CortexStore
    memory: MemoryStore
    prefix: str = "!"
    incognito_hours: float = 24.0
    # After a stretch ends: drop what the process still holds of it in memory (the last texts per channel, the
    # kept query vectors); the App wires it.
    on_resume: Callable[[], None] | None = None

    def register(self, registry: CommandRegistry) -> None:
        self.prefix = registry.prefix
        item = number("item", "the item's number (#12)", required=True)
        page = number("page", "which page")
        source = option("source", "the message it comes from (set by a platform's 'Remember this')", token=FROM,
                        menu=True)
        commands: list[tuple[str, tuple[Param, ...], str, Handler]] = [
            ("remember", (text("text", "the fact", required=True),
                          option("category", "what kind of fact", choices=CATEGORIES),
                          option("importance", "1 (trivia) to 10 (vital)", minimum=1, maximum=10),
                          flag("pin", "always keep it in mind"), source), "store a fact about you", self.remember),
            ("forget", (number("item", "the item's number (#12)"), source),
             "archive one of your memory items, or those from a message (restore brings them back)", self.forget),
            ("pin", (item,), "always keep an item in the persona's mind", self.pin),
            ("unpin", (item,), "stop pinning an item", self.unpin),
            ("list", (word("category", "only this kind", choices=CATEGORIES), page),
             "your memory items, newest first", self.list_items),
            ("search", (text("words", "what to look for", required=True),),
             "search your memory items and past messages", self.search),
            ("archived", (page,), "your archived (forgotten, pruned or expired) items", self.archived),
            ("restore", (item,), "bring an archived item back", self.restore),
            ("scope", (item, word("scope", "private: DMs only; shared: group channels too", required=True,
                                  choices=SCOPES)), "who may see an item: private or shared", self.scope),
            ("pause", (), "talk without being remembered (incognito) until resume", self.pause),
            ("resume", (), "end incognito: what was said meanwhile is deleted", self.resume),
            ("why", (option("reply", "one reply (a platform's 'Why?' names it)", token=OF, menu=True),),
             "what shaped the persona's last reply to you here, and how to correct it", self.why),
        ]
        for name, params, summary, handler in commands:
            registry.register(Command(f"memory {name}", summary, handler, params, private=True))

    async def pause(self, ctx: CommandContext, args: Sequence[str]) -> str:
        user, _ = await self.pairs.pair_for(ctx.user_key, ctx.user_name, ctx.persona)
        started, handled = await self.pairs.storage.start_incognito(user.id, ctx.persona, ctx.sent_at)
        since = datetime.fromtimestamp(started, tz=UTC).strftime("%H:%M")
        # (sent after the pause, they reached the bot before it: in the stretch all the same)
        also = f" That includes {plural(handled, 'message')} sent after the pause that I had already answered." \
            if handled else ""
        return (f"Incognito with {ctx.persona} since {since} UTC: I still answer, but nothing said from then on "
                "reaches my summaries, your files, your memory items or search by meaning, and it is deleted "
                f"when you send {self.prefix}memory resume (or after {self.incognito_hours:g} hours at the "
                f"latest).{also}")

    async def resume(self, ctx: CommandContext, args: Sequence[str]) -> str:
        user = await self.pairs.storage.get_user(ctx.user_key)  # looked up, not made: resuming stores nothing
        storage = self.pairs.storage
        deleted = await storage.end_incognito(user.id, ctx.persona, ctx.sent_at) if user is not None else None
        if deleted is None:
            return f"You were not incognito with {ctx.persona}."
        if self.on_resume is not None:
            self.on_resume()
        if deleted:  # their words leave the database's files within a minute (scrubs are spaced)
            await storage.scrub_soon()
        verb = "is" if deleted == 1 else "are"
        return f"Incognito ended: {plural(deleted, 'message')} from that stretch {verb} deleted. I remember again."

    async def why(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply | str:
        user, pair = await self.pairs.pair_for(ctx.user_key, ctx.user_name, ctx.persona)
        storage = self.pairs.storage
        which, note = "my last reply to you here", ""
        if OF in args:
            ref = source_ref(args[args.index(OF) + 1] if args.index(OF) + 1 < len(args) else "", OF)
            last = await storage.sources.reply_shown_as(ref, user.id)
            if last is None:
                return "That is not one of my replies to you (or it was written before I kept track)."
            which = "that reply of mine"
        else:  # sent as a reply to one of mine: that one; else the last one here
            last = await storage.sources.reply_shown_as(ctx.reply_to, user.id) if ctx.reply_to else None
            if last is not None:
                which = "that reply of mine"
            elif ctx.reply_to:  # a reply to someone else's message, or to my reply to someone else
                note = "The message you answered is not one of my replies to you. "
            last = last or await storage.sources.last_reply(user.id, ctx.channel_key)
        if last is None:
            return note + "I have not answered you here yet."
        reply_id, at, persona = last
        if persona != ctx.persona:  # written by another persona (the channel's changed since): its memory of you
            note += (f"That reply was {persona}'s (what it remembered is your memory with {persona}: "
                     f"{self.prefix}persona {persona} here to change it). ")
            _, pair = await self.pairs.pair_for(ctx.user_key, ctx.user_name, persona)
        sources = await storage.sources.of(reply_id)
        when = datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%d %H:%M")
        if not sources:
            return f"{note}{which[0].upper()}{which[1:]} ({when} UTC) used no memory: only the conversation itself."
        lines = [f"{note}What shaped {which} ({when} UTC):"]
        for source in sources:
            lines.append(await self._source_line(source, pair.id, user.id, persona))
        return _escaped("\n".join(lines))

    async def _source_line(self, source: ReplySource, pair_id: int, user_id: int, persona: str) -> str:
        if source.kind == "item":
            try:
                item = await self.memory.get(pair_id, source.ref, count_access=False)
            except MemoryError:
                return f"- memory item #{source.ref} (no longer in your memory)"
            if item.superseded_by is not None:  # restore refuses it: the correction is what counts
                return f"- memory item #{item.id} (corrected since by #{item.superseded_by})"
            if not item.visible:
                state = "forgotten" if item.archived_at is not None else "expired"
                return f"- memory item #{item.id} ({state} since; {self.prefix}memory restore {item.id} brings it back)"
            return f"- memory item #{item.id}: {inert(item.content)} — wrong? {self.prefix}memory forget {item.id}"
        if source.kind == "file":
            return (f"- your {source.detail}, version {source.ref} — change it with {self.prefix}memory edit "
                    f"{source.detail} (see {self.prefix}memory history {source.detail})")
        if source.kind == "message":
            rows = await self.pairs.storage.memory.pair_messages(user_id, persona, [source.ref])
            said = f'"{inert(str(rows[0]["text"]), 120)}"' if rows else "(deleted since)"
            return f"- something said earlier: {said}"
        if source.kind == "lore":
            return f"- {persona}'s shared knowledge, lore #{source.ref} (admins: {self.prefix}lore show {source.ref})"
        return f"- the summary of this conversation, version {source.ref} ({self.prefix}summary)"

    async def _pair(self, ctx: CommandContext) -> int:
        return (await self.pairs.pair_for(ctx.user_key, ctx.user_name, ctx.persona))[1].id

    @staticmethod
    def _id(args: Sequence[str]) -> int:
        if not args:
            raise CommandError("Which item? Give its number, e.g. 12 (see list or search).")
        return parse_number(args[0], "the item", prefix="#")

    async def remember(self, ctx: CommandContext, args: Sequence[str]) -> str | CommandReply:
        # From the message typed (deleted on its platform, the item is archived, as a 🧠'd message's is).
        kept, category, importance, pin, origin = [], "fact", 5, False, ctx.message_key or ctx.channel_key
        it = iter(args)
        for token in it:
            if token in ("--category", "--importance") and (value := next(it, None)) is None:
                raise CommandError(f"{token} needs a value after it, e.g. "
                                   + ("--category preference" if token == "--category" else "--importance 8"))
            if token == "--category":
                category = str(value).lower()  # "Fact" is the category fact
            elif token == "--importance":
                typed = str(value).strip()
                if not (typed.isascii() and typed.isdigit()) or len(typed) > 3:  # (int() took "٥" and "1_0")
                    raise CommandError(f"importance is a number from 1 to 10, not {shown(str(value))}")
                importance = int(typed)
            elif token == "--pin":
                pin = True
            elif token == FROM:
                origin = source_ref(next(it, ""))
            else:
                kept.append(token)
        content = " ".join(kept) or ctx.body
        user, found = await self.pairs.pair_for(ctx.user_key, ctx.user_name, ctx.persona)
        pair = found.id
        if await self.pairs.storage.incognito.active(user.id, ctx.persona):
            # The pause promised that nothing from it reaches the memory items (the remember tool is not
            # offered either): an item made now would outlive the stretch. (Said without the command's usage:
            # a platform's "Remember this" or 🧠 reaction comes here too.)
            return CommandReply(f"You are incognito with {ctx.persona}: nothing new is remembered until "
                                f"{self.prefix}memory resume.", private=True, failed=True)
        # Learned in a DM (or by a slash command nobody else saw) stays out of group channels.
        scope: Scope = "shared" if ctx.seen_by_all and not ctx.is_dm else "private"
        try:
            item = await self.memory.remember(pair, content, scope=scope, category=category, importance=importance,
                                              pinned=pin, source="user", source_ref=origin, once=True)
        except AlreadyRemembered as same:  # (the same words again: a second item would only crowd the prompt)
            return self._already(same.item, category, importance, pin)
        except MemoryError as exc:
            raise CommandError(str(exc)) from None
        pinned = " (pinned)" if item.pinned else ""
        if scope == "private":
            return f"Remembered as #{item.id}{pinned}."
        return (f"Remembered as #{item.id}{pinned}, shared: it may come up in group channels too "
                f"({self.prefix}memory scope {item.id} private keeps it to our DMs).")

    def _already(self, item: MemoryItem, category: str, importance: int, pin: bool) -> str:
        """The answer to remembering the words of an item in use: which one, and what it keeps of its own."""
        kept = [f"its category {item.category}"] if item.category != category else []
        kept += [f"its importance {item.importance}"] if item.importance != importance else []
        note = f" It keeps {' and '.join(kept)}." if kept else ""
        hint = f" Pin it with {self.prefix}memory pin {item.id}." if pin and not item.pinned else ""
        return f"Already remembered as #{item.id}; nothing new was stored.{note}{hint}"

    async def scope(self, ctx: CommandContext, args: Sequence[str]) -> str:
        item_id = self._id(args)
        wanted = args[1].lower() if len(args) > 1 else ""
        if wanted not in SCOPES:
            raise CommandError(f"{shown(args[1]) + ' is no scope; ' if len(args) > 1 else ''}give the scope: private "
                               "(only in DMs) or shared (group channels too)")
        try:
            item = await self.memory.set_scope(await self._pair(ctx), item_id, "private" if wanted == "private"
                                               else "shared")
        except MemoryError as exc:
            raise CommandError(str(exc)) from None
        if item.superseded_by is not None:  # never restored: its correction comes up instead
            return (f"#{item.id} is {item.scope} now, but it was corrected by #{item.superseded_by}: "
                    "it comes up nowhere.")
        if not item.visible:
            state = "is archived" if item.archived_at is not None else "has expired"
            return f"#{item.id} is {item.scope} now, but it {state}: it comes up nowhere until restored."
        where = "only in your DMs" if item.scope == "private" else "in group channels too"
        return f"#{item.id} is {item.scope} now: it may come up {where}."

    async def _change(self, ctx: CommandContext, args: Sequence[str], what: str) -> CommandReply | str:
        pair, item_id = await self._pair(ctx), self._id(args)
        try:
            if what == "forget":
                await self.memory.archive(pair, item_id, "forgotten by the user")
                return f"#{item_id} is archived; {self.prefix}memory restore {item_id} brings it back."
            if what == "restore":
                item = await self.memory.restore(pair, item_id)
                return _escaped(f"#{item.id} is back: {inert(item.content)}")
            before = await self.memory.get(pair, item_id, count_access=False)
            item = await self.memory.set_pinned(pair, item_id, what == "pin")
            if before.pinned == item.pinned:  # (asked twice: nothing changed the second time)
                return f"#{item.id} is pinned already." if item.pinned else f"#{item.id} was not pinned."
            return f"#{item.id} is {'pinned' if item.pinned else 'no longer pinned'}."
        except MemoryError as exc:
            raise CommandError(str(exc)) from None

    async def forget(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply | str:
        if FROM not in args:
            return await self._change(ctx, args, "forget")
        if args.index(FROM) > 0 or len(args) > 2:  # an item and a message: which one was meant?
            raise CommandError(f"give either an item or {FROM} a message, not both")
        origin = source_ref(args[args.index(FROM) + 1] if args.index(FROM) + 1 < len(args) else "")
        archived = await self.memory.archive_from(await self._pair(ctx), origin)
        if not archived:
            return "Nothing of yours was remembered from that message."
        return f"Forgotten: {', '.join(f'#{i}' for i in archived)} ({self.prefix}memory restore brings one back)."

    async def restore(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply | str:
        return await self._change(ctx, args, "restore")

    async def pin(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply | str:
        return await self._change(ctx, args, "pin")

    async def unpin(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply | str:
        return await self._change(ctx, args, "unpin")

    @staticmethod
    def _page_args(args: Sequence[str], *, archived: bool) -> tuple[str | None, int]:
        """The category (any case) and the page a list command was given; a second of either is refused, not
        ignored."""
        categories = [a.lower() for a in args if a.lower() in CATEGORIES]
        numbers = [a for a in args if a.lower() not in CATEGORIES and a.lstrip("+-")[:1].isdigit()]
        if len(numbers) > 1:
            raise CommandError(f"give one page, not {shown(' '.join(numbers))}")
        page = parse_number(numbers[0], "the page") if numbers else 1
        unknown = [a for a in args if a.lower() not in CATEGORIES and a not in numbers]
        if unknown and archived:
            raise CommandError(f"{shown(unknown[0])} is not a page number")
        if unknown:
            raise CommandError(f"unknown category {shown(unknown[0])}; categories: {', '.join(CATEGORIES)}")
        if len(categories) > 1:
            raise CommandError(f"give one category, not {shown(' '.join(categories))}")
        return (categories[0] if categories else None), page

    async def _page(self, ctx: CommandContext, args: Sequence[str], *, archived: bool) -> CommandReply | str:
        category, page = self._page_args(args, archived=archived)
        items, total = await self.memory.list_items(
            await self._pair(ctx), category=category, archived=archived, limit=PAGE, offset=(page - 1) * PAGE)
        if not total:
            if category:
                return f"No {'archived ' if archived else ''}items in the category {category}."
            if archived:
                return "No archived items."
            return f"No memory items yet (the persona and {self.prefix}memory remember add them)."
        pages = (total + PAGE - 1) // PAGE
        if page > pages:
            return f"There {'is only 1 page' if pages == 1 else f'are only {pages} pages'} ({plural(total, 'item')})."
        head = f"{'Archived items' if archived else 'Your memory items'}" + (f" ({category})" if category else "")
        lines = [f"{head}: page {page}/{pages}, {total} in all"]
        lines += [_line(i) + (_why_archived(i) if archived else "") for i in items]
        return _escaped("\n".join(lines))

    async def list_items(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply | str:
        return await self._page(ctx, args, archived=False)

    async def archived(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply | str:
        return await self._page(ctx, args, archived=True)

    async def search(self, ctx: CommandContext, args: Sequence[str]) -> CommandReply | str:
        query = (" ".join(args) or ctx.body).strip()
        if not query:
            raise CommandError("What should I look for?")
        if len(query) > MAX_SEARCH_CHARS:  # (a pasted megabyte held the event loop for seconds)
            raise CommandError(f"a search is at most {MAX_SEARCH_CHARS:,} characters; this one has {len(query):,}: "
                               "look for a few words of it")
        user, pair = await self.pairs.pair_for(ctx.user_key, ctx.user_name, ctx.persona)
        hits = await self.memory.search(pair.id, query, user_id=user.id, persona=ctx.persona, limit=10, patient=True)
        if not hits:
            return f"Nothing found for {shown(query, 80)}."
        return _escaped("\n".join([f"Results for {shown(query, 80)}:"] + [
            f"{h.score:.2f}  {inert(h.text, 200)}  ({h.source}, {h.created_at:%Y-%m-%d})" for h in hits]))
