"""What the core knows of a persona: its name, language, model settings and soul sections, in order.

Personas live in the database (``cortex.personas`` keeps them, seeded from the config's
``[[personas]]``); the core asks a :class:`PersonaSource` for one by name and never cares where it
came from. :class:`ConfigPersonas` serves the config's personas as they are written (tests, tools).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from bot.config import Config, ConfigError, PersonaConfig
from bot.text import shown

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


def section_title(key: str) -> str:
    """``communication_style`` → "Communication style"; a free-form section's own name, made readable."""
    return SOUL_TITLES.get(key) or key.replace("_", " ").strip().capitalize()


@dataclass(frozen=True, slots=True)
class Persona:
    name: str
    language: str = "English"
    model: str | None = None
    temperature: float | None = None
    history_tokens: int | None = None
    summary_tokens: int | None = None
    sections: tuple[tuple[str, str], ...] = ()  # (section key, text) in the persona's order

    def soul_sections(self) -> list[tuple[str, str]]:
        """Non-empty soul sections in this persona's order."""
        return [(key, body) for key, body in self.sections if body.strip()]

    @classmethod
    def from_config(cls, config: PersonaConfig) -> Persona:
        return cls(config.name, config.language, config.model, config.temperature, config.history_tokens,
                   config.summary_tokens, tuple((key, getattr(config, key)) for key in config.soul_order))


class PersonaSource(Protocol):
    def persona(self, name: str | None = None) -> Persona:
        """The persona called ``name`` (case-insensitive), or the default one; ConfigError if unknown."""

    def names(self) -> list[str]: ...


class ConfigPersonas:
    """The config file's personas, exactly as written."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def persona(self, name: str | None = None) -> Persona:
        return Persona.from_config(self.config.persona(name))

    def names(self) -> list[str]:
        return [p.name for p in self.config.personas]


def unknown_persona(wanted: str, names: list[str]) -> ConfigError:
    return ConfigError(f"unknown persona {shown(wanted)}; personas: {', '.join(names) or 'none'}")
