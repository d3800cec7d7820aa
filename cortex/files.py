"""The three cortex files of a pair: creation from templates, checked writes, history, diff, revert,
reset, export. Every change is a new version; nothing is overwritten or deleted here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bot.text import shown, storable
from cortex.diff import unified
from cortex.memory.guard import guarded
from cortex.store import FILENAMES, Author, CortexStore, FileVersion, Pair
from cortex.templates import template

SHRINK_GUARD_MIN_CHARS = 400  # files shorter than this may be rewritten freely
SHRINK_GUARD_RATIO = 0.5  # a model write keeping less than half of a longer file is refused
_SUBSTANCE = re.compile(r"[^\W_]")  # what a file says: its letters and digits (any script), not spacing or lines


def substance(text: str) -> int:
    """The letters and digits of ``text``: the shrink guard compares these, so padding a short write with
    spaces or dots to the old length does not get a file wiped."""
    return len(_SUBSTANCE.findall(text))


class FileError(ValueError):
    """A file operation a user asked for cannot be done; the message says why and what to do."""


class NoSuchVersion(FileError):
    """The version asked for does not exist (any more)."""


class FileConflict(FileError):
    """The file changed since the version an edit was based on."""

    def __init__(self, filename: str, newest: int, based_on: int) -> None:
        super().__init__(f"{filename} changed since you opened it (now version {newest}, yours was based on version "
                         f"{based_on}): reload it, then make your change again")
        self.newest = newest


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str


def normalise_filename(name: str) -> str:
    """``memory`` / ``memory.md`` / ``MEMORY.md`` → ``memory.md``; anything else is refused."""
    candidate = name.strip().lower()
    if not candidate.endswith(".md"):
        candidate += ".md"
    if candidate not in FILENAMES:
        raise FileError(f"unknown file {shown(name)}; the files are {', '.join(FILENAMES)}")
    return candidate


def check_model_write(filename: str, old: str, new: str, max_chars: int) -> Refusal | None:
    """Why a write by the model must be refused (it is then told to condense and retry), or None."""
    if not new.strip():
        return Refusal(
            f"refused: empty content would erase {filename}. Write the complete file, keeping what matters."
        )
    if len(new) > max_chars:
        return Refusal(
            f"refused: the new {filename} has {len(new):,} characters; the limit is {max_chars:,}. Nothing was "
            "saved. Condense it (merge related points, drop what no longer matters, shorten wording) and call "
            "write_file again with the complete, shorter file."
        )
    if len(old) < SHRINK_GUARD_MIN_CHARS:
        return None
    # A file over the limit (an admin lowered it) is measured as the part of it that fits: against the whole, no
    # write short enough for the limit kept enough of it, and the file could never be written again.
    had, kept = round(substance(old) * min(1.0, max_chars / len(old))), substance(new)
    if kept < had * SHRINK_GUARD_RATIO:
        return Refusal(
            f"refused: this would drop most of {filename} (from {had:,} to {kept:,} letters and digits). Nothing "
            "was saved. write_file replaces the whole file: read it, keep what still matters, and write the "
            "complete file again."
        )
    return None


def unified_diff(a: FileVersion, b: FileVersion) -> str:
    """The change from version ``a`` to ``b`` as ``diff -u`` writes it (bounded work: :mod:`cortex.diff`)."""
    lines = unified(a.content, b.content, f"{a.filename} v{a.version}", f"{b.filename} v{b.version}")
    return lines or f"{a.filename} v{a.version} and v{b.version} are identical."


class CortexFiles:
    def __init__(self, store: CortexStore, file_max_chars: int) -> None:
        self.store = store
        self.file_max_chars = file_max_chars

    async def ensure(self, pair: Pair, language: str, user_name: str) -> dict[str, FileVersion]:
        """The pair's current files, creating missing ones from the language's templates. Idempotent under
        concurrency: a template becomes version 1 only while the file has no version at all, so concurrent
        first visits make one version, and one that saw the file missing never lands after a first edit."""
        current = await self.store.current_all(pair.id)
        for filename in FILENAMES:
            if filename not in current:
                current[filename] = await self._create(pair, filename, template(filename, language, user_name))
        return current

    async def _create(self, pair: Pair, filename: str, content: str) -> FileVersion:
        made = await self.store.add_first_version(pair.id, filename, content, "system", "created from template")
        if made is not None:
            return made
        latest = await self.store.current(pair.id, filename)  # made meanwhile by another request or writer
        if latest is None:
            raise FileError(f"{filename} was deleted while it was being created (a forget-me?): try again")
        return latest

    async def write(
        self, pair: Pair, filename: str, content: str, author: Author, reason: str, *, tier: str = "",
        run_id: int | None = None, based_on: int | None = None,
    ) -> FileVersion | None:
        """Store ``content`` as a new version; None when it equals the current one. With ``based_on`` (the
        version the writer read), only while that is still the newest, else :class:`FileConflict`."""
        # (as the store keeps it: a NUL PostgreSQL drops made every write of the same text a new version)
        content = storable(content)
        if author != "system":
            guarded(filename, content, f"{author} on pair {pair.id}", FileError)
        current = await self.store.current(pair.id, filename)
        if current is not None and current.content == content:
            return None
        if based_on is None:
            return await self.store.add_version(pair.id, filename, content, author, reason, tier, run_id)
        saved = await self.store.add_version_based_on(based_on, pair.id, filename, content, author, reason, tier,
                                                      run_id)
        if saved is None:
            latest = await self.store.current(pair.id, filename)
            raise FileConflict(filename, latest.version if latest else 0, based_on)
        return saved

    async def edit(self, pair: Pair, filename: str, content: str, *, based_on: int | None = None
                   ) -> FileVersion | None:
        """The user's own text as a new version (None: unchanged). With ``based_on``, only while that is still
        the newest version, else :class:`FileConflict`: an edit never silently replaces one made meanwhile."""
        if not content.strip():
            raise FileError(f"the new {filename} is empty; to start it over use reset instead")
        length = len(content.rstrip("\n"))  # (the line end a chat edit is saved with is not the person's)
        if length > self.file_max_chars:
            raise FileError(f"the new {filename} has {length:,} characters; the limit is {self.file_max_chars:,}")
        if based_on is None:
            return await self.write(pair, filename, content, "user", "edited by the user")
        guarded(filename, content, f"user on pair {pair.id}", FileError)
        current = await self.store.current(pair.id, filename)
        newest = current.version if current is not None else 0
        if newest != based_on:
            raise FileConflict(filename, newest, based_on)
        if current is not None and current.content == content:
            return None
        saved = await self.store.add_version_based_on(based_on, pair.id, filename, content, "user",
                                                      "edited by the user")
        if saved is None:
            latest = await self.store.current(pair.id, filename)
            raise FileConflict(filename, latest.version if latest else 0, based_on)
        return saved

    async def get_version(self, pair: Pair, filename: str, number: int) -> FileVersion:
        found = await self.store.version(pair.id, filename, number)
        if found is None:
            kept = await self.store.version_range(pair.id, filename)
            if kept is None:
                raise NoSuchVersion(f"{filename} has no version {number} (versions: none yet)")
            oldest, newest = kept
            dropped = (f"; the versions before {oldest} are no longer kept, only the newest "
                       f"{self.store.KEEP_VERSIONS:,}" if 1 < oldest and number < oldest else "")
            raise NoSuchVersion(f"{filename} has no version {number} (versions: {oldest} to {newest}{dropped})")
        return found

    async def revert(self, pair: Pair, filename: str, number: int) -> FileVersion | None:
        old = await self.get_version(pair, filename, number)
        length = len(old.content.rstrip("\n"))
        if length > self.file_max_chars:  # (kept from before an operator lowered the cap)
            raise FileError(f"{filename} version {number} has {length:,} characters, over today's limit of "
                            f"{self.file_max_chars:,}: copy what you need from it into an edit instead")
        return await self.write(pair, filename, old.content, "user", f"reverted to version {number}")

    async def reset(self, pair: Pair, filenames: tuple[str, ...], language: str, user_name: str) -> list[str]:
        changed = []
        for filename in filenames:
            if await self.write(pair, filename, template(filename, language, user_name), "user", "reset to template"):
                changed.append(filename)
        return changed
