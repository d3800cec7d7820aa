"""The tools a persona uses on its own cortex files: ``read_file`` and ``write_file`` (and, when the
memory store is on, the memory tools of :mod:`cortex.memory.tools`).

Whatever the model sends, :meth:`CortexTools.execute` answers with a tool result, never an
exception: an unknown tool, a file name outside the three (``../x``, ``/etc/passwd``), missing or
non-string arguments, unreadable JSON, an over-long or content-destroying write each get a clear
error the model can act on. Accepted writes become new versions at once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from bot.jobs import LeaseLost
from bot.llm.base import ToolCall, ToolSpec
from bot.text import quoted
from cortex.files import CortexFiles, FileConflict, FileError, check_model_write
from cortex.memory.tools import MEMORY_TOOL_NAMES, MemoryTools
from cortex.store import FILENAMES, Pair

# The tools that write (files, memory items): each checks first that the run's job is still its worker's.
WRITING_TOOLS = frozenset({"write_file"} | (MEMORY_TOOL_NAMES - {"search_memory"}))

log = logging.getLogger(__name__)
MAX_WRITES_PER_FILE = 5  # saves of one file in one update

FILENAME_SCHEMA = {
    "type": "string",
    "enum": list(FILENAMES),
    "description": "One of your three files.",
}

TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        name="read_file",
        description="Read the current content of one of your inner files. Read a file before you rewrite it.",
        input_schema={
            "type": "object",
            "properties": {"filename": FILENAME_SCHEMA},
            "required": ["filename"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        name="write_file",
        description=(
            "Replace one of your inner files with new content. This overwrites the whole file: always write the "
            "COMPLETE new content in Markdown, in your own first person, keeping what still matters."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "filename": FILENAME_SCHEMA,
                "content": {"type": "string", "description": "The complete new file, in Markdown."},
            },
            "required": ["filename", "content"],
            "additionalProperties": False,
        },
    ),
)


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    content: str
    is_error: bool = False


@dataclass
class CortexTools:
    files: CortexFiles
    pair: Pair
    tier: str
    run_id: int
    max_chars: int
    memory: MemoryTools | None = None
    files_read: list[str] = field(default_factory=list)
    files_written: list[str] = field(default_factory=list)
    refused_writes: list[str] = field(default_factory=list)  # why each write_file was refused, in order
    # Each file as this update first saw it: the shrink guard measures against it, so a file cannot be
    # whittled down in small steps within one update.
    started_with: dict[str, str] = field(default_factory=dict)
    # The version of each file the model last read or saved (at first: as the update found it): a save lands
    # only while it is still the newest, so an edit made during the update is never overwritten unseen.
    seen: dict[str, int] = field(default_factory=dict)
    # Saves of each file by the earlier attempts of the same job (a retry after a 529 keeps the write limit).
    earlier_writes: dict[str, int] = field(default_factory=dict)
    fence: Callable[[], Awaitable[bool]] | None = None  # whether the run's job is still this worker's

    async def execute(self, call: ToolCall) -> ToolOutcome:
        """The outcome of one tool call; never an exception (a bug in one call must not end the update), except
        :class:`LeaseLost` before a write when the update's job went to another worker (``fence`` says whether
        it is still this one's)."""
        if self.fence is not None and call.name in WRITING_TOOLS and not await self.fence():
            raise LeaseLost(f"its job went to another worker before {call.name} (this process stalled)")
        try:
            return await self._execute(call)
        except Exception:
            log.exception("tool %s failed unexpectedly (run %d)", call.name, self.run_id)
            return ToolOutcome(f"{call.name} failed because of an internal error; nothing was changed by this "
                               "call. Go on without it.", True)

    async def _execute(self, call: ToolCall) -> ToolOutcome:
        if call.name in MEMORY_TOOL_NAMES and self.memory is not None:
            result = await self.memory.execute(call)
            return ToolOutcome(result.content, result.is_error)
        if call.name not in ("read_file", "write_file"):
            names = ["read_file", "write_file"] + (sorted(MEMORY_TOOL_NAMES) if self.memory is not None else [])
            return ToolOutcome(f"unknown tool {quoted(call.name)}; the tools are {', '.join(names)}", True)
        if call.arguments is None:
            shown = call.raw_arguments[:200]
            return ToolOutcome(
                f"{call.name} needs a JSON object as input, e.g. {{\"filename\": \"memory.md\"}}; got: {shown!r}",
                True,
            )
        filename = call.arguments.get("filename")
        if not isinstance(filename, str):
            return ToolOutcome(f"{call.name} needs 'filename' as a string: one of {', '.join(FILENAMES)}", True)
        if filename not in FILENAMES:
            return ToolOutcome(f"there is no file {quoted(filename)}; your files are {', '.join(FILENAMES)}", True)
        if call.name == "read_file":
            return await self._read(filename)
        content = call.arguments.get("content")
        if not isinstance(content, str):
            return ToolOutcome("write_file needs 'content' as a string: the complete new file", True)
        outcome = await self._write(filename, content)
        if outcome.is_error:
            self.refused_writes.append(outcome.content)
        return outcome

    async def _read(self, filename: str) -> ToolOutcome:
        current = await self.files.store.current(self.pair.id, filename)
        version = current.version if current else 0
        if filename not in self.started_with or self.seen.get(filename) != version:
            # First look, or someone else saved it since (the person's own correction): the shrink guard
            # measures against the file as it is now, so keeping their deletion is no "dropping most of it".
            self.started_with[filename] = current.content if current else ""
        self.seen[filename] = version
        self.files_read.append(filename)
        return ToolOutcome(current.content if current else "")

    async def _write(self, filename: str, content: str) -> ToolOutcome:
        if self.files_written.count(filename) + self.earlier_writes.get(filename, 0) >= MAX_WRITES_PER_FILE:
            return ToolOutcome(
                f"refused: {filename} was already saved {MAX_WRITES_PER_FILE} times in this update; that is the "
                "limit. Nothing was saved. Finish the update.", True)
        current = await self.files.store.current(self.pair.id, filename)
        if current is not None and current.author not in ("system", "model") and filename not in self.files_read \
                and filename not in self.files_written:  # (the files are not in its prompt: a person's words
            # there, their own correction, would go unseen; its own earlier text the shrink guard keeps)
            return ToolOutcome(f"refused: read {filename} first (read_file). write_file replaces the whole file, "
                               "and it holds what you have not seen in this update. Nothing was saved.", True)
        before = self.started_with.setdefault(filename, current.content if current else "")
        refusal = check_model_write(filename, before, content, self.max_chars)
        if refusal is not None:
            return ToolOutcome(refusal.reason, True)
        try:
            saved = await self.files.write(
                self.pair, filename, content, "model", f"cortex update ({self._tier_label()})", tier=self.tier,
                run_id=self.run_id, based_on=self.seen.get(filename),
            )
        except FileConflict as exc:
            return ToolOutcome(f"refused: {filename} was changed by someone else since you read it (it is now "
                               f"version {exc.newest}), probably the person themselves. Nothing was saved. Read it "
                               "again and keep their changes in what you write.", True)
        except FileError as exc:  # the poisoning guard: nothing saved, the model is told why
            return ToolOutcome(f"{exc}. Nothing was saved; write what you learned about the person as facts.", True)
        if saved is None:
            return ToolOutcome(f"{filename} is unchanged (the content is identical); nothing to save")
        self.files_written.append(filename)
        self.seen[filename] = saved.version
        return ToolOutcome(f"saved {filename} as version {saved.version} ({len(content):,} characters)")

    def _tier_label(self) -> str:
        return "manual" if self.tier == "manual" else f"tier {self.tier}%"
