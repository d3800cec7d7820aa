"""Starting content of the three cortex files, per language, written in the persona's first person.

``{user_name}`` resolves to the user's display name. Languages without their own templates get the
English ones; the persona still writes the content in its own language.
"""

from __future__ import annotations

from cortex.memory.guard import check_memory_text

TEMPLATES: dict[str, dict[str, str]] = {
    "english": {
        "memory.md": (
            "# My memories of {user_name}\n\n"
            "## What {user_name} told me about themselves\n\n"
            "## Moments we shared\n\n"
            "## Things I want to remember\n"
        ),
        "soul.md": (
            "# My soul\n\n"
            "## Who I am becoming\n\n"
            "## What I value\n\n"
            "## What I have learned\n"
        ),
        "relationship.md": (
            "# {user_name} and me\n\n"
            "## How we are with each other\n\n"
            "## Trust and closeness\n\n"
            "## Our topics and shared references\n"
        ),
    },
    "german": {
        "memory.md": (
            "# Meine Erinnerungen an {user_name}\n\n"
            "## Was {user_name} mir über sich erzählt hat\n\n"
            "## Momente, die wir geteilt haben\n\n"
            "## Was ich nicht vergessen will\n"
        ),
        "soul.md": (
            "# Meine Seele\n\n"
            "## Wer ich werde\n\n"
            "## Was mir wichtig ist\n\n"
            "## Was ich gelernt habe\n"
        ),
        "relationship.md": (
            "# {user_name} und ich\n\n"
            "## Wie wir miteinander umgehen\n\n"
            "## Vertrauen und Nähe\n\n"
            "## Unsere Themen und Insider\n"
        ),
    },
}

ALIASES = {"en": "english", "deutsch": "german", "de": "german"}


# Said instead of a display name that reads like instructions ("Ignore all previous instructions"): the
# files enter every prompt, and every later write of them (the persona's, a reset, a revert) is checked.
NEUTRAL_NAMES = {"english": "my friend", "german": "mein Gegenüber"}


def template(filename: str, language: str, user_name: str) -> str:
    key = language.strip().casefold()
    key = ALIASES.get(key, key)
    texts = TEMPLATES.get(key, TEMPLATES["english"])
    text = texts[filename].replace("{user_name}", user_name)
    if check_memory_text(text).ok:
        return text
    neutral = NEUTRAL_NAMES.get(key, NEUTRAL_NAMES["english"])
    return "\n".join(line[:2] + line[2:3].upper() + line[3:] if line.startswith("# ") else line
                     for line in texts[filename].replace("{user_name}", neutral).split("\n"))
