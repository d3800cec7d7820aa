"""Assembling the reply prompt in the order of DESIGN.md §4.

System prompt: 1 global rules → 2 guidelines → 3 persona soul sections (in the persona's order) →
4 cortex files → 5 persistent knowledge → 6 rolling summary. Then the history window as chat turns,
then the new message. Template variables ``{char_name}``, ``{user_name}``, ``{language}`` and
``{date}`` resolve in every section; any other brace text is left exactly as written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bot.config import PersonaConfig
from bot.llm.base import ChatMessage
from bot.ports import PromptSection
from bot.storage.base import StoredMessage, Summary

_VARIABLE = re.compile(r"\{(char_name|user_name|language|date)\}")

SOUL_TITLES = {
    "identity": "Identity",
    "personality": "Personality",
    "boundaries": "Boundaries",
    "communication_style": "Communication style",
    "values": "Values",
    "tone": "Tone",
    "domain_expertise": "Expertise",
    "error_handling": "When something goes wrong",
}


def resolve_variables(text: str, variables: Mapping[str, str]) -> str:
    return _VARIABLE.sub(lambda m: variables.get(m.group(1), m.group(0)), text)


@dataclass(frozen=True, slots=True)
class PromptParts:
    global_rules: str
    guidelines: Sequence[PromptSection]
    persona: PersonaConfig
    cortex: Sequence[PromptSection]
    knowledge: Sequence[PromptSection]
    summary: Summary | None


def render_system(parts: PromptParts, variables: Mapping[str, str]) -> str:
    blocks: list[str] = []
    if parts.global_rules.strip():
        blocks.append(f"# Rules\n{parts.global_rules.strip()}")
    blocks.extend(f"# {s.title}\n{s.body.strip()}" for s in parts.guidelines if s.body.strip())
    soul = [f"## {SOUL_TITLES[name]}\n{body.strip()}" for name, body in parts.persona.soul_sections()]
    if soul:
        blocks.append("# Who you are\n" + "\n\n".join(soul))
    blocks.extend(f"# {s.title}\n{s.body.strip()}" for s in parts.cortex if s.body.strip())
    blocks.extend(f"# {s.title}\n{s.body.strip()}" for s in parts.knowledge if s.body.strip())
    if parts.summary is not None:
        blocks.append(
            "# Earlier in this conversation\n"
            "A summary of what was said before the messages below; you remember it.\n\n"
            + parts.summary.text.strip()
        )
    return resolve_variables("\n\n".join(blocks), variables)


def history_turns(messages: Sequence[StoredMessage], *, label_speakers: bool) -> list[ChatMessage]:
    """The window as chat turns; in group channels user turns carry the speaker's name."""
    turns: list[ChatMessage] = []
    for m in messages:
        if m.role == "user" and label_speakers:
            turns.append(ChatMessage(role="user", content=f"{m.author_name}: {m.text}"))
        else:
            turns.append(ChatMessage(role=m.role, content=m.text))
    return turns
