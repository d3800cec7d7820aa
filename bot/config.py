"""Typed configuration, loaded from TOML and checked at start-up.

Every section is a pydantic model that forbids unknown keys, so a typo stops start-up with a message
that names the key, where it is, and what to do about it (:class:`ConfigError`). Secrets never live in
the file: the config names the environment variable that holds them (``api_key_env``) and
:func:`read_secret` reads it when a component is built.

Starting without any config file gives safe defaults and one built-in persona.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol
from urllib.parse import parse_qsl, quote, quote_plus, unquote, unquote_plus, urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import idna
import platformdirs
from jsonschema import exceptions as schema_errors
from jsonschema import validators
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from bot.text import ONLY_DOTS, name_key, only_dots, persona_key, readable

SOUL_SECTIONS: tuple[str, ...] = (
    "identity",
    "personality",
    "boundaries",
    "communication_style",
    "values",
    "tone",
    "domain_expertise",
    "error_handling",
)

DEFAULT_CONFIG_NAME = "config.toml"
CONFIG_ENV = "CORTEXBOT_CONFIG"

log = logging.getLogger(__name__)


class ConfigError(Exception):
    """A config problem a person can fix; the message says which key and how."""


MAX_NUMBER = 10**12  # no setting needs more; far larger ones overflow timers and sleeps


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False, strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _sane_number(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool) and abs(value) > MAX_NUMBER:
            raise ValueError(f"{value:g} is far too large (at most {MAX_NUMBER:,})")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _env_names(cls, value: Any, info: ValidationInfo) -> Any:
        """A ``*_env`` key (and ``env_from``, ``headers_env``) names an environment variable: a value that is
        no such name is most likely the secret itself, pasted in; it is refused and never repeated."""
        if _names_variables(info.field_name or ""):
            for name in value.values() if isinstance(value, dict) else (value,):
                if isinstance(name, str) and name and not ENV_NAME.fullmatch(name):
                    raise ValueError(_shell_spelling(name) or NOT_A_VARIABLE)
                if isinstance(name, str) and looks_like_token(name):
                    raise ValueError(LOOKS_LIKE_TOKEN)
        return value


def _shell_spelling(value: str) -> str | None:
    """What to write instead of a variable's name in a shell's spelling, "$OPENAI_API_KEY" or "${OPENAI_API_KEY}"
    (the secret itself is told apart: it is never repeated); None for anything else."""
    bare = value.strip()
    bare = bare[2:-1] if bare.startswith("${") and bare.endswith("}") else bare.removeprefix("$")
    if bare == value.strip() or not ENV_NAME.fullmatch(bare) or looks_like_token(bare):
        return None
    return (f"write the environment variable's name alone, as {bare}: the bot reads the variable itself (a $ "
            "would be taken as part of the name)")


NOT_A_VARIABLE = ("this names an environment variable (letters, digits and _), and what is written here is not "
                  "one: if it is the secret itself, remove it from the file, put it in an environment variable "
                  "and write that variable's name here")
LOOKS_LIKE_TOKEN = ("this names an environment variable, and what is written here looks like a token rather than a "
                    "variable's name (a token's prefix, or letters and digits mixed at random): if it is the secret "
                    "itself, remove it from the file, put it in an environment variable and write that variable's "
                    "name here; if it is a name, choose one of words (e.g. MATRIX_ACCESS_TOKEN)")


# Tokens made of letters, digits and _ alone, which pass for a variable's name: Synapse's access and refresh tokens,
# Matrix Authentication Service's, GitHub's, Slack's, Stripe's (OpenAI's and Anthropic's "sk-…" hold a "-").
TOKEN_PREFIXES = ("syt_", "syr_", "mat_", "mct_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "xox",
                  "sk_live_", "sk_test_", "rk_live_", "rk_test_", "hf_")
RANDOM_PIECE_CHARS = 16


def looks_like_token(value: str) -> bool:
    """Whether a would-be variable name is rather a secret: a known token's prefix followed by a random piece
    (letters of both cases and digits, or a long one), or a long piece (between "_") of letters and digits mixed as
    no name mixes them. Names with a prefix's look ("github_pat_for_the_bot") and a number or code in them
    ("DISCORD_TOKEN_3F2A9C1B7E4D5A60", "Bot1Discord2Token") are names."""
    if value.startswith(TOKEN_PREFIXES):
        rest = value.split("_")[1:]
        if any(_mixed(piece) or len(piece) >= RANDOM_PIECE_CHARS and (re.search(r"[0-9]", piece) or _cased(piece))
               for piece in rest):
            return True
    return any(_random_piece(piece) for piece in value.split("_"))


def _mixed(piece: str) -> bool:
    return bool(re.search(r"[0-9]", piece)) and _cased(piece)


def _cased(piece: str) -> bool:
    return bool(re.search(r"[a-z]", piece) and re.search(r"[A-Z]", piece))


def _random_piece(piece: str) -> bool:
    """Letters and digits mixed in a long piece: of one case, 24 characters or more with three numbers in them
    ("a3f9c2e1b4d5f6a7b8c9d0e1f2a3b4c5"); of both, mostly words of one or two letters between numbers
    ("Ab9CdEf0123456789GhIjKlMn"), where a name has words ("AzureOpenAIKey", "CortexBot2MatrixToken")."""
    if len(piece) < RANDOM_PIECE_CHARS:
        return False
    runs = len(re.findall(r"[0-9]+", piece))
    if piece.lower() == piece or piece.upper() == piece:
        return len(piece) >= 24 and runs >= 3
    words = re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", piece)
    short = sum(len(word) <= 2 for word in words)
    return short * 2 >= len(words) and short >= (3 if runs >= 2 else 5)


def _names_variables(key: str) -> bool:
    return key.endswith("_env") or key == "env_from"


def default_database_url() -> str:
    data_dir = Path(platformdirs.user_data_dir("cortex-bot", appauthor=False))
    return f"sqlite:///{data_dir / 'bot.db'}"


class BotConfig(_Section):
    default_persona: str | None = Field(
        default=None, description="Persona used where none is chosen; the first persona when unset."
    )
    global_rules: str = Field(default="", description="Bot-wide rules placed first in every reply prompt.")
    max_message_chars: int = Field(
        default=8000, ge=1, description="Longer user messages are refused with a clear notice."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_in_capitals(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value  # "debug" is DEBUG


class StorageConfig(_Section):
    url: str = Field(
        default_factory=default_database_url,
        description="sqlite:////abs/path/bot.db (four slashes: absolute; three: relative to the folder the bot "
        "starts in) or postgresql://user@host:5432/dbname",
    )
    url_env: str = Field(default="", description="Environment variable holding the whole URL (overrides url).")
    password_env: str = Field(
        default="", description="Environment variable holding the PostgreSQL password (else PGPASSWORD)."
    )
    pool_size: int = Field(default=10, ge=1, le=200, description="PostgreSQL: connections per process.")

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        value = check_storage_url(value)
        if url_has_password(value):
            raise ValueError(
                "the URL holds a password, and the config file is no place for it: remove it from the URL and "
                "put it in an environment variable named by [storage] password_env (or PGPASSWORD), or the "
                "whole URL in one named by [storage] url_env"
            )
        return value

    def resolve(self, env: Mapping[str, str] | None = None) -> tuple[str, str | None]:
        """The URL to open (``url_env``'s value when set) and the PostgreSQL password from the environment."""
        env = os.environ if env is None else env
        url = self.url
        if self.url_env:
            value = env.get(self.url_env, "").strip()
            if not value:
                state = "is empty" if self.url_env in env else "is not set"
                raise ConfigError(f"[storage] url_env names {self.url_env}, but that environment variable {state}")
            try:
                url = check_storage_url(value)
            except ValueError as exc:
                raise ConfigError(f"the storage URL in ${self.url_env}: {exc}") from None
        password = read_secret(self.password_env, env) if self.password_env else None
        if self.password_env and not password:
            shown = shown_variable(self.password_env, "[storage] password_env")
            raise ConfigError(f"[storage] password_env names a variable that is not set: set {shown} to the database's "
                              "password")
        _known_secrets.update(_secret_pieces(url, password))  # hidden in any text from now on
        return url, password

    @property
    def sqlite_path(self) -> Path:
        return Path(self.url.removeprefix("sqlite:///")).expanduser()


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _url_secret_spans(url: str) -> list[tuple[int, int]]:
    """Where the passwords of one URL are, as written: before its host (everything between the user's ":" and the
    last "@" before the query: a password may hold "@", "/", "?", spaces or quotes unencoded) and in its query
    (``?password=…`` up to the next "&", spaces and all)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return []
    base = len(scheme) + len(sep)
    query = rest.find("?")
    at = rest.rfind("@", 0, query) if query >= 0 else -1
    if at < 0:  # no query, or a "?" in the password itself
        at = rest.rfind("@")
    colon = rest.find(":", 0, max(at, 0))
    spans = [(base + colon + 1, base + at)] if at >= 0 and colon >= 0 else []
    mark = rest.find("?", max(at, 0))
    if mark >= 0:
        start = base + mark + 1
        for part in rest[mark + 1:].split("&"):
            name, equals, value = part.partition("=")
            if equals and secret_param(name):
                spans.append((start + len(name) + 1, start + len(part)))
            start += len(part) + 1
    return [(a, b) for a, b in spans if b > a]


def _url_secrets(url: str) -> list[str]:
    """The passwords one URL carries, as written (see ``_url_secret_spans``)."""
    return [url[a:b] for a, b in _url_secret_spans(url)]


def hide_url_password(url: str) -> str:
    """One URL (the whole string is the URL) without its passwords: where each is is known here, however it is
    written, so nothing of one shows, and nothing else is hidden (:func:`hide_url_passwords` reads URLs out of
    any text)."""
    for start, end in sorted(_url_secret_spans(url), reverse=True):
        url = url[:start] + "***" + url[end:]
    return hide_url_passwords(url)


def hide_secrets_of(url: str, text: str) -> str:
    """``text`` (an error about ``url``) with each password of the URL, and each piece of one between "/", "@",
    ":", "?", "#" and spaces (a URL parser's error may quote one), as ``***``."""
    return hide_url_passwords(_without(sorted(_secret_pieces(url), key=len, reverse=True), text))


def _secret_pieces(url: str, *more: str | None) -> set[str]:
    """The passwords of ``url`` (and ``more``), as written, decoded and in pieces (see ``_pieces``), but for what
    the URL shows anyway: a password, or a piece of one, that is also its user, host or database name (as in
    postgres:postgres@db/postgres) shows nothing hidden, and hiding it would hide those."""
    shown = hide_url_password(url)
    return {piece for secret in (*more, *_url_secrets(url)) if secret for written in (secret, unquote(secret))
            for piece in _pieces(written, shown)}


def url_has_password(url: str) -> bool:
    """Whether a PostgreSQL URL carries a password (``user:pw@`` or a ``?password=`` option)."""
    parts = urlsplit(url)
    return url.startswith("postgres") and bool(parts.password or any(
        secret_param(k) for k, _ in parse_qsl(parts.query, keep_blank_values=True)))


def check_storage_url(value: str) -> str:
    """A storage URL as the engines take it: the scheme in lower case (``SQLITE:///``), SQLAlchemy's
    ``postgresql+asyncpg://`` as ``postgresql://``."""
    if "\x00" in value:
        raise ValueError("the storage URL contains a NUL character")
    scheme, sep, rest = value.partition("://")
    if sep and scheme.lower() in ("sqlite", "postgresql", "postgres", "postgresql+asyncpg"):
        value = scheme.lower().removesuffix("+asyncpg") + sep + rest
    if value.startswith("sqlite:///"):
        if len(value) == len("sqlite:///"):
            raise ValueError("the sqlite URL names no file: write sqlite:////var/lib/cortex/bot.db (four slashes: "
                             "an absolute path) or sqlite:///bot.db (relative to the folder the bot starts in)")
        if "?" in value:  # the path is taken as it is written: "?mode=ro" would name a new file
            raise ValueError("the sqlite URL takes no options (?…): write the file's path alone, e.g. "
                             "sqlite:////var/lib/cortex/bot.db (the bot always opens it for reading and writing)")
        return value
    if value.startswith(("postgresql://", "postgres://")):
        parts = urlsplit(value)
        if parts.netloc.count("@") > 1:  # (read from the last one on, the host was "ss@127.0.0.1": a DNS error)
            raise ValueError("the postgresql URL holds more than one @: write an @ in the user name or password as "
                             "%40, or keep the password out of the URL ([storage] password_env)")
        if not parts.hostname and "host=" not in parts.query:
            raise ValueError("the postgresql URL names no host: write postgresql://user@host:5432/dbname")
        _check_port(parts.netloc)
        if parts.path.strip("/"):
            return value
        # asyncpg reads the database from the path, and only without one (not even "/") from ?dbname= or
        # ?database= (a blank one is skipped): "host/?dbname=bot" opened the database named like the user.
        named = {key for key, val in parse_qsl(parts.query, keep_blank_values=True) if val}
        if not named & {"dbname", "database", "service"} and not os.environ.get("PGDATABASE", "").strip():
            raise ValueError("the postgresql URL names no database: write postgresql://user@host:5432/dbname "
                             "(without one, PostgreSQL takes the user's name for the database's)")
        query = f"?{parts.query}" if parts.query else ""  # no path at all: asyncpg then reads ?dbname= or PGDATABASE
        return f"{parts.scheme}://{parts.netloc}{query}" + (f"#{parts.fragment}" if parts.fragment else "")
    raise ValueError(
        "use sqlite:////var/lib/cortex/bot.db (four slashes: an absolute path; sqlite:///bot.db is relative to the "
        "folder the bot starts in) or postgresql://user@host:5432/dbname"
    )


def _check_port(netloc: str) -> None:
    """A PostgreSQL URL's port, if it names one, is a number from 1 to 65535 (said so, never with the URL)."""
    port = netloc.rpartition("@")[2].rpartition("]")[2].partition(":")[2]
    if not port:
        return
    if not port.isascii() or not port.isdigit():
        raise ValueError("the postgresql URL's port is not a number: write postgresql://user@host:5432/dbname")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"the postgresql URL's port {int(port)} is out of range: a port is 1 to 65535 "
                         "(PostgreSQL's own is 5432)")


URL_USER_INFO = "url_user_info"  # the kind of error of a URL holding user:password@ (its value is never shown)


def refuse_user_info(value: str, keep_in: str) -> str:
    """A URL without a user name or password before its host (``user:password@``): the config file is no place for a
    secret, and the servers take theirs elsewhere (``keep_in`` names the key that does)."""
    try:
        netloc = urlsplit(value.strip()).netloc
    except ValueError:  # (said by the URL's own check)
        return value
    if "@" in netloc:
        raise PydanticCustomError(URL_USER_INFO, "holds a user name or password (user:password@): the config file "
                                  "is no place for a secret; remove it and put the secret in an environment variable "
                                  f"named by {keep_in}")
    return value


def shown_url(url: str) -> str:
    """A URL for doctor and logs: without a user name or password, and without its query (an API's key may be in
    it, as ``?appid=…``), which is shown as ``?…``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return hide_url_password(url)
    netloc = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{netloc}{parts.path}" + ("?…" if parts.query else "")


def check_http_url(value: str, keep_in: str) -> str:
    """An http(s) URL with a host, e.g. http://localhost:11434/v1, without user:password@ (see
    :func:`refuse_user_info`)."""
    refuse_user_info(value, keep_in)
    parts = urlsplit(value.strip())
    try:
        _ = parts.port
    except ValueError:
        raise ValueError(f"{value!r} has a port that is not a number") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c in value for c in " \x00\n"):
        raise ValueError(f"{value!r} is not an http(s) URL: write it like http://localhost:11434/v1")
    return value.strip()


def optional_http_url(value: str | None, keep_in: str) -> str | None:
    """:func:`check_http_url`, where nothing (or an empty string: "the provider's own API") is None."""
    return None if value is None or not value.strip() else check_http_url(value, keep_in)


_MODEL_NAME = re.compile(r"[A-Za-z0-9/][A-Za-z0-9._:/@+-]{0,199}")


def _model_name(value: str) -> str:
    """A model's name as servers spell them ("claude-sonnet-4-5", "llama3.1:8b", "Qwen/Qwen2.5-7B-Instruct",
    "/models/llama-3" for a vLLM serving a path). A stray quote (``!cortex settings model "claude``: an unclosed
    quote is taken as typed) would have failed every call at the provider."""
    if not _MODEL_NAME.fullmatch(value):
        raise ValueError("a model name is one word of at most 200 characters, as the server spells it: letters, "
                         "digits and . _ : / @ + - (e.g. claude-sonnet-4-5)")
    return value


ModelName = Annotated[str, AfterValidator(_model_name)]


def _blank_is_unset(value: Any) -> Any:
    """An empty (or blank) optional model name means the default, as an empty ``base_url`` does."""
    return None if isinstance(value, str) and not value.strip() else value


# A model that falls back to another one when unset (``summary_model = ""``: the chat model).
FallbackModel = Annotated[ModelName | None, BeforeValidator(_blank_is_unset)]


class LLMConfig(_Section):
    provider: Literal["anthropic", "openai"] = "anthropic"
    model: ModelName = "claude-sonnet-4-5"
    base_url: str | None = None

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return optional_http_url(value, "[llm] api_key_env")

    @model_validator(mode="after")
    def _anthropic_adds_v1(self) -> LLMConfig:
        if self.provider == "anthropic" and self.base_url and self.base_url.rstrip("/").endswith("/v1"):
            raise ValueError(
                f"base_url {self.base_url!r} ends in /v1, but the Anthropic SDK adds /v1 itself: write it without "
                "(or set provider = \"openai\" for an OpenAI-compatible server)"
            )
        return self

    api_key_env: str | None = Field(
        default=None,
        description="Environment variable holding the API key; default ANTHROPIC_API_KEY / OPENAI_API_KEY.",
    )
    max_tokens: int = Field(default=1024, ge=1, le=200_000)
    temperature: float | None = Field(
        default=None, ge=0.0, le=2.0, description="Unset: the server's default (newer Claude models reject it)."
    )
    timeout_seconds: float = Field(default=120.0, gt=0, le=3600)
    connect_timeout_seconds: float = Field(default=10.0, gt=0, le=600)
    max_retries: int = Field(default=2, ge=0, le=10)
    summary_model: FallbackModel = Field(default=None, description="Cheaper model for summaries; default: model.")

    @property
    def key_env_name(self) -> str:
        if self.api_key_env:
            return self.api_key_env
        return "ANTHROPIC_API_KEY" if self.provider == "anthropic" else "OPENAI_API_KEY"

    @property
    def key_required(self) -> bool:
        """Whether the bot needs a key to start: a local OpenAI-compatible server (Ollama, vLLM, llama.cpp)
        takes any, unless the config names the variable that holds one (then a missing one is a mistake)."""
        return not (self.provider == "openai" and self.base_url and not self.api_key_env)


class HistoryConfig(_Section):
    history_tokens: int = Field(default=2000, ge=50, description="Token budget for the history window.")
    summary_tokens: int = Field(default=500, ge=20, description="Token budget for the rolling summary.")
    min_exchanges: int = Field(default=3, ge=0, description="Exchanges always kept, even over budget.")
    summary_trigger: int = Field(
        default=40, ge=2, description="Messages a channel needs before a rolling summary is written."
    )
    summary_batch: int = Field(
        default=10, ge=1, description="Uncovered evicted messages that make a new summary worth writing."
    )
    summary_words: int = Field(default=150, ge=10, description="Target length of a rolling summary.")
    summary_input_tokens: int = Field(
        default=6000, ge=200, description="Most evicted-message tokens folded into one summary job."
    )
    token_margin: float = Field(default=0.10, ge=0.0, le=1.0, description="Safety margin on token estimates.")


class JobsConfig(_Section):
    concurrency: int = Field(default=2, ge=1, le=64)
    # 5 s doubling, 8 attempts: about ten minutes in all, longer than a provider's usual overload (529s for
    # a minute or two); 2 s and 5 attempts gave up after 30 s, and the update a tier fired was lost.
    max_attempts: int = Field(default=8, ge=1, le=100)
    retry_base_seconds: float = Field(default=5.0, gt=0, le=3600)
    retry_max_seconds: float = Field(default=300.0, gt=0, le=86_400)
    lease_seconds: float = Field(default=60.0, ge=5, le=86_400)
    poll_seconds: float = Field(default=1.0, gt=0, le=3600)
    shutdown_grace_seconds: float = Field(default=10.0, ge=0, le=3600)
    keep_done_days: float = Field(default=14.0, ge=0, le=36_500, description=(
        "Days a finished job's row is kept (0: forever); the runs it made stay in the cortex's history."))
    keep_failed_days: float = Field(default=90.0, ge=0, le=36_500, description=(
        "Days a failed job's row is kept to look at and retry (0: forever); doctor counts the last day's."))


FREQUENCY_PRESETS: dict[str, tuple[int, ...]] = {
    "frequent": (25, 50, 75, 95),
    "medium": (50, 75, 95),
    "rare": (95,),
}


def _check_tiers(value: list[int]) -> list[int]:
    if any(not 1 <= t <= 100 for t in value):
        raise ValueError("each tier is a percentage from 1 to 100")
    if len(set(value)) != len(value):
        raise ValueError("a tier is listed twice")
    return sorted(value)


class CortexConfig(_Section):
    """Defaults of the cortex; admins override most of them per persona and per server."""

    enabled: bool = Field(default=True, description="Whether the persona keeps its cortex files up to date.")
    frequency: Literal["frequent", "medium", "rare"] = Field(
        default="medium", description="Tier preset: frequent 25/50/75/95 %, medium 50/75/95 %, rare 95 %."
    )
    tiers: list[int] = Field(
        default_factory=list, description="Explicit tier percentages of context_limit; overrides frequency."
    )
    context_limit: int = Field(default=60, ge=4, le=100_000, description="Messages per tier cycle.")
    cooldown_seconds: float = Field(
        default=30.0, ge=0, le=30 * 86_400,
        description="Least time between two updates of a pair.")
    max_rounds: int = Field(default=10, ge=1, le=50, description="Most model calls in one update.")
    file_max_chars: int = Field(default=8000, ge=200, le=200_000, description="Size cap of each cortex file.")
    daily_token_budget: int = Field(
        default=200_000, ge=0, description="Tokens one user-persona pair's updates may use per UTC day (0: none)."
    )
    bot_daily_token_budget: int = Field(
        default=2_000_000, ge=0, description="Tokens all cortex updates together may use per UTC day (0: none)."
    )
    model: FallbackModel = Field(default=None, description="Model for updates; default: [llm] model.")
    temperature: float | None = Field(default=0.3, ge=0.0, le=2.0, description="Low keeps the files steady.")
    max_tokens: int = Field(default=4096, ge=256, le=64_000, description="Longest answer per update round.")
    history_tokens: int = Field(
        default=6000, ge=200, description="Budget of the conversation an update reads (newest first)."
    )
    prompt_tokens: int = Field(default=3000, ge=100, description="Budget of the cortex files in a reply prompt.")
    use_in_groups: bool = Field(
        default=False,
        description="Put a user's cortex files (which hold what they said in DMs too) into prompts in group channels.",
    )

    @field_validator("tiers")
    @classmethod
    def _valid_tiers(cls, value: list[int]) -> list[int]:
        return _check_tiers(value)

    def tier_percentages(self) -> tuple[int, ...]:
        return tuple(self.tiers) if self.tiers else FREQUENCY_PRESETS[self.frequency]


class MemoryConfig(_Section):
    """The memory store beside the cortex files: search weights and the prompt's knowledge section."""

    weight_vector: float = Field(default=0.50, ge=0, description="Weight of vector similarity in search.")
    weight_text: float = Field(default=0.20, ge=0, description="Weight of full-text (bm25) relevance.")
    weight_importance: float = Field(default=0.15, ge=0, description="Weight of an item's importance (1-10).")
    weight_recency: float = Field(default=0.10, ge=0, description="Weight of recency (exponential decay).")
    weight_access: float = Field(default=0.05, ge=0, description="Weight of how often an item was used.")
    weight_author: float = Field(default=0.40, ge=0, description="Weight of a message being by the person the "
                                 "search is about (the user for I/my, the persona for you, anyone named).")
    half_life_days: float = Field(default=30.0, gt=0, le=36_500, description="Age at which the recency signal halves.")
    candidates: int = Field(default=50, ge=5, le=1000, description="Candidates taken by text and by vector.")
    relevant_items: int = Field(default=8, ge=0, le=50, description="Relevant items put into a reply prompt.")
    prompt_tokens: int = Field(default=800, ge=50, description="Budget of the knowledge section in a reply prompt.")
    recent_days: float = Field(
        default=7.0, ge=0, le=36_500,
        description="Items younger than this appear in full in prompts.")
    recalled_messages: int = Field(
        default=4, ge=0, le=20, description="Past messages (outside the history window) recalled into a reply prompt."
    )
    embedder: Literal["default", "openai", "none"] = Field(
        default="default",
        description="default: multilingual-e5-small, offline on CPU; openai: an OpenAI-compatible /v1/embeddings "
        "server; none: full-text search only.",
    )
    embedder_model: str = Field(default="", description="Model name for the openai embedder.")

    @field_validator("embedder_model")
    @classmethod
    def _embedder_model_name(cls, value: str) -> str:
        return _model_name(value) if value else value
    embedder_base_url: str | None = Field(default=None, description="Server of the openai embedder (Ollama, vLLM).")

    @field_validator("embedder_base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return optional_http_url(value, "[memory] embedder_api_key_env")

    embedder_api_key_env: str = Field(default="OPENAI_API_KEY", description="Variable holding the embedder's key.")
    embed_messages: bool = Field(default=True, description="Embed past messages too (recall by meaning).")
    query_timeout_seconds: float = Field(
        default=2.0, gt=0, le=60,
        description="A reply prompt waits this long for the query's embedding, then uses text only.",
    )
    vector_cache: int = Field(
        default=150_000, ge=1000, description="Vectors kept in memory over all pairs (384 dims: ~1.5 KB each)."
    )
    backfill_seconds: float = Field(
        default=60.0, ge=5, le=86_400,
        description="How often missing embeddings are computed.")
    backfill_max_seconds: float = Field(default=45.0, gt=0, le=3600, description="Longest stretch of one backfill run.")
    prune_every_hours: float = Field(
        default=24.0, gt=0, le=24 * 365,
        description="How often unused items are archived.")
    prune_unused_days: float = Field(
        default=90.0, gt=0, le=36_500, description="Archive items older than this that were never accessed."
    )
    prune_rarely_used_days: float = Field(
        default=365.0, gt=0, le=36_500,
        description="Archive items older than this accessed fewer than prune_min_access times.",
    )
    prune_min_access: int = Field(default=3, ge=1, description="Accesses that keep an old item (see above).")
    max_item_chars: int = Field(
        default=2000, ge=100, le=20_000, description="Longest memory item (from a user or the persona)."
    )
    keep_messages_days: float = Field(
        default=0.0, ge=0, le=36_500,
        description="Delete raw messages older than this many days in the daily upkeep (0: keep them forever); "
                    "files, items and summaries stay.")
    incognito_hours: float = Field(
        default=24.0, gt=0, le=720,
        description="An incognito stretch (!memory pause) ends by itself after this long; its messages are deleted.")

    @model_validator(mode="after")
    def _embedder_model(self) -> MemoryConfig:
        if self.embedder == "openai" and not self.embedder_model:
            raise ValueError("[memory] embedder = \"openai\" needs embedder_model (e.g. \"nomic-embed-text\")")
        return self


class ChatConfig(_Section):
    """How replies are delivered on chat platforms."""

    streaming: bool = Field(default=True, description="Edit the reply in place as it streams in.")
    edit_interval_seconds: float = Field(default=1.2, ge=0.2, le=60, description="Least time between two edits.")
    rate_limit_per_minute: int = Field(default=12, ge=0, description="Messages a user may send per minute (0: off).")
    command_rate_limit_per_minute: int = Field(
        default=30, ge=0, description="Commands a user may send per minute (0: off; the terminal has no limit).")
    typing_indicator: bool = True
    still_working_seconds: float = Field(
        default=8.0, ge=0, le=600,
        description="Post \"still working…\" when no reply text has come after this long (0: never); the reply "
                    "then replaces it.")


_SERVER_NAME = r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+)(?::\d{1,5})?"  # example.org[:port], [::1]:8448
_MATRIX_SERVER = re.compile(_SERVER_NAME)
_MATRIX_USER = re.compile(rf"@[^:\s]+:{_SERVER_NAME}")  # @name:server[:port]
_MATRIX_ROOM = re.compile(rf"![^:\s]+(?::{_SERVER_NAME})?")  # !id:server (room version 12: !id alone)
ACCESS_PLATFORMS = ("discord", "matrix", "console")
_POWER_ROLE = re.compile(r"matrix:power:-?[0-9]{1,16}")  # a Matrix power level, from which the role is held
_ROOM_ID_HINT = "(Element: Room settings → Advanced → Internal room ID)"


def _matrix_problem(entry: str, field: str) -> str | None:
    """What is wrong with a Matrix id (without its ``matrix:``) in the access list ``field``, or None: users are
    @name:server, rooms !id (and their server: room version 12 has none), servers a room or a homeserver's name
    (roles: see ``_power_levels``)."""
    if field.endswith("_roles"):
        return None
    if entry.startswith("#") and not field.endswith(("_users", "_bots")):
        return (f"that is the room's alias, which messages do not carry: write its id, matrix:!…:"
                f"{entry.partition(':')[2] or 'example.org'} {_ROOM_ID_HINT}")
    if field.endswith(("_users", "_bots")):
        return None if _MATRIX_USER.fullmatch(entry) else (
            "a Matrix user is written in full, e.g. matrix:@ann:example.org (an @, the account's name, a colon and "
            "its server)")
    if _MATRIX_ROOM.fullmatch(entry) or (field.endswith("_servers") and _MATRIX_SERVER.fullmatch(entry)):
        return None
    if field.endswith("_servers"):
        return ("a Matrix entry here is a room's id (matrix:!AbCdEf:example.org) or a homeserver's name as user ids "
                "end (matrix:example.org)")
    return f"a Matrix room is written with its id, e.g. matrix:!AbCdEf:example.org {_ROOM_ID_HINT}"


class AccessConfig(_Section):
    """Who and where the bot answers. Ids are written platform:id (discord:1234, matrix:@ann:example.org,
    matrix:!room:example.org); an empty allow list allows everyone, a deny list always wins."""

    dms: bool = Field(default=True, description="Answer direct messages.")
    always_answer_channels: list[str] = Field(default_factory=list, description="Answer every message there.")
    allow_users: list[str] = Field(default_factory=list)
    deny_users: list[str] = Field(default_factory=list)
    allow_channels: list[str] = Field(default_factory=list)
    deny_channels: list[str] = Field(default_factory=list)
    allow_servers: list[str] = Field(default_factory=list)
    deny_servers: list[str] = Field(default_factory=list)
    allow_roles: list[str] = Field(
        default_factory=list, description="Discord role ids / Matrix power levels (matrix:power:50: 50 and up).")
    deny_roles: list[str] = Field(default_factory=list)
    allow_bots: list[str] = Field(default_factory=list, description="Other bots the bot may answer.")

    @field_validator("always_answer_channels", "allow_users", "deny_users", "allow_channels", "deny_channels",
                     "allow_servers", "deny_servers", "allow_roles", "deny_roles", "allow_bots")
    @classmethod
    def _platform_ids(cls, ids: list[str], info: ValidationInfo) -> list[str]:
        """A bare id ("1234", "general") matches nothing, so a list of them would silently refuse or let
        through everyone: each id must say its platform, a Discord id is a number, and a Matrix one is written as
        messages carry it (see ``_matrix_problem``). Spaces around an id or its parts are dropped."""
        taken = []
        for entry in ids:
            platform, _, rest = entry.strip().partition(":")
            rest = rest.strip()
            if platform not in ACCESS_PLATFORMS or not rest:
                raise ValueError(f"{entry!r} in {info.field_name}: write ids as platform:id, e.g. discord:1234, "
                                 "matrix:@ann:example.org, matrix:!room:example.org (console:NAME in the terminal)")
            if platform == "discord" and not (rest.isascii() and rest.isdigit()):
                raise ValueError(f"{entry!r} in {info.field_name}: a Discord id is a number (Developer Mode, "
                                 "right click, Copy ID), e.g. discord:123456789012345678")
            if platform == "matrix" and (problem := _matrix_problem(rest, str(info.field_name))):
                raise ValueError(f"{entry!r} in {info.field_name}: {problem}")
            taken.append(f"{platform}:{rest}")
        return taken

    @field_validator("allow_roles", "deny_roles")
    @classmethod
    def _power_levels(cls, roles: list[str], info: ValidationInfo) -> list[str]:
        """Matrix's roles are power levels, each listed one a threshold (matrix:power:50 is held from 50 up, the
        room's admins at 100 too): anything else matched nobody. In a deny list a threshold would keep out the
        room's admins first, so there it is refused and the allow list named."""
        for entry in roles:
            if not entry.startswith("matrix:"):
                continue
            if not _POWER_ROLE.fullmatch(entry):
                raise ValueError(f"{entry!r} in {info.field_name}: a Matrix role is a power level, written "
                                 "matrix:power:N with N a whole number, e.g. matrix:power:50 (level 50 and above)")
            if info.field_name == "deny_roles":
                raise ValueError(f"{entry!r} in deny_roles: matrix:power:N holds from level N up, and would keep out "
                                 "the room's admins; to keep out those below a level, list it in allow_roles")
        return roles


MAX_SHARDS = 10_000  # far above what any bot needs (Discord allows ~2,500 servers per shard)


def _discord_user_ids(value: Any) -> Any:
    """Discord user ids as numbers; one written as text ("1234", or the access lists' "discord:1234") is read as
    its number. Anything else is refused by name: it made nobody an admin."""
    if not isinstance(value, list):
        return value
    ids: list[Any] = []
    for entry in value:
        if isinstance(entry, str):
            digits = entry.strip().removeprefix("discord:")
            if not (digits.isascii() and digits.isdigit()):
                raise ValueError(f"{entry!r} is not a Discord user id: write the number (Developer Mode, right "
                                 "click, Copy ID), e.g. 123456789012345678")
            entry = int(digits)
        if isinstance(entry, int) and not isinstance(entry, bool) and entry < 1:
            raise ValueError(f"{entry} is not a Discord user id: write the number (Developer Mode, right click, "
                             "Copy ID), e.g. 123456789012345678")
        ids.append(entry)
    return ids


class DiscordConfig(_Section):
    enabled: bool = Field(default=False, description="Serve Discord with `cortexbot run`.")
    token_env: str = Field(default="DISCORD_TOKEN", description="Environment variable holding the bot token.")
    test_guild_ids: list[int] = Field(
        default_factory=list, description="Sync slash commands to these servers at once (else globally)."
    )
    admin_ids: Annotated[list[int], BeforeValidator(_discord_user_ids)] = Field(
        default_factory=list, description="User ids with admin rights everywhere.")
    sync_commands: bool = Field(default=True, description="Register the slash commands at start.")
    shard_count: int | None = Field(
        default=None, ge=1, le=MAX_SHARDS,
        description="Shards of the whole fleet; unset: one process, unsharded. Same value in every process.",
    )
    shard_ids: list[int] | None = Field(
        default=None, description="The shards this process runs (0 … shard_count-1); unset: all of them."
    )

    @field_validator("shard_ids")
    @classmethod
    def _shards_within_count(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is None:
            return None
        if "shard_count" not in info.data:  # shard_count itself is invalid and reported
            return value
        return _check_shard_ids(value, info.data["shard_count"])


def _check_shard_ids(ids: list[int], count: int | None) -> list[int]:
    if count is None:
        raise ValueError(
            "needs shard_count: set [discord] shard_count to the number of shards of the whole fleet "
            "(the same value in every process), or remove shard_ids"
        )
    if not ids:
        raise ValueError("is empty: list the shards this process runs, or remove the key to run all of them")
    outside = sorted({i for i in ids if not 0 <= i < count})
    if outside:
        raise ValueError(
            f"{outside} are outside 0 … {count - 1}: each id must be at least 0 and below shard_count = {count}"
        )
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ValueError(f"lists {twice} more than once: list each shard once")
    return ids


def _matrix_user_ids(ids: list[str]) -> list[str]:
    """Full Matrix user ids, compared as they are with each sender's: "bob" (or a typo) made nobody an admin
    without a word. The access lists' form (matrix:@ann:example.org) is read as the id it names."""
    checked = []
    for entry in ids:
        user_id = entry.strip().removeprefix("matrix:")
        if not _MATRIX_USER.fullmatch(user_id):
            raise ValueError(f"{entry!r} is not a full Matrix user id: write it like @ann:example.org (an @, the "
                             "account's name, a colon and its server)")
        checked.append(user_id)
    return checked


def _matrix_server_names(names: list[str]) -> list[str]:
    """Server names as a user id ends (example.org), compared with each inviter's: a URL matched nobody. The
    access lists' form (matrix:example.org) is read as the name it holds."""
    checked = []
    for entry in names:
        name = entry.strip()
        if not _MATRIX_SERVER.fullmatch(name):  # ("matrix:8448" is a host and its port)
            name = name.removeprefix("matrix:")
        if not _MATRIX_SERVER.fullmatch(name):
            host = urlsplit(name if "//" in name else f"//{name}").hostname if "/" in name else None
            raise ValueError(f"{entry!r} is not a server name: write it as a user id ends, e.g. "
                             f"{host or 'example.org'} (no https:// and no /)")
        checked.append(name)
    return checked


MATRIX_SESSION_FILE = "session.json"  # the login and device the Matrix adapter keeps in its store folder


def _store_left_under_tilde(value: str, expanded: Path) -> Path | None:
    """The session folder an older version made for a ``store_path`` starting with "~", while the home folder's
    holds no session (it may not exist, or be one an upgraded start made empty): that version took the "~" as a
    folder's name under the folder the bot started in, and kept the login, the device and the encryption keys
    there. It stays in use (a warning says where to move it): another folder logs in as a new device and leaves
    the keys behind. None when there is no such session."""
    if not value.startswith("~") or (expanded / MATRIX_SESSION_FILE).exists():
        return None
    left = Path(value).absolute()
    if not (left / MATRIX_SESSION_FILE).is_file():
        return None
    log.warning("[matrix] store_path %r: the session is in %s, where an older version kept it (it read ~ as a "
                "folder's name), and is used from there; move that folder to %s to keep it where the config says "
                "(until then, a start from another folder logs in as a new device)", value, left, expanded)
    return left


class MatrixConfig(_Section):
    enabled: bool = Field(default=False, description="Serve Matrix with `cortexbot run`.")
    homeserver: str = Field(default="", description="e.g. https://matrix.example.org")
    user_id: str = Field(default="", description="The bot's account, e.g. @cortex:example.org")
    password_env: str = Field(default="", description="Environment variable holding the password.")
    access_token_env: str = Field(default="", description="Environment variable holding an access token.")
    device_name: str = "cortex-bot"
    store_path: str = Field(
        default="", description="Sync token, device and keys (~ is the home folder); default: the data folder.")
    command_prefix: str = Field(default="!", min_length=1, max_length=5)
    e2ee: bool = Field(default=False, description="End-to-end encryption (keys kept in store_path).")
    admin_ids: Annotated[list[str], AfterValidator(_matrix_user_ids)] = Field(
        default_factory=list, description="Matrix ids (@ann:example.org) with admin rights everywhere.")
    admin_power_level: int = Field(default=50, description="Room power level that counts as admin.")
    msgtype: Literal["m.notice", "m.text"] = Field(default="m.notice", description="How replies are sent.")
    auto_join: bool = Field(default=True, description="Accept invites from allowed users.")
    invite_servers: Annotated[list[str], AfterValidator(_matrix_server_names)] = Field(
        default_factory=list, description="Servers whose users may invite the bot; default: its own."
    )
    max_rooms_per_inviter: int = Field(
        default=25, ge=0, description="Rooms one user (admins aside) may bring the bot into; further invites "
                                      "are declined (0: no limit).")

    @field_validator("store_path")
    @classmethod
    def _absolute_store(cls, value: str) -> str:
        """``~`` is the home folder, and a relative path is taken from the folder the bot starts in, here and
        said in a warning (as a relative SQLite path is): "~/cortex-matrix" made a folder named "~", and a
        start from another folder found no session, logged in as a new device and left its keys behind."""
        if not value.strip():
            return ""
        path = Path(value).expanduser()
        if (left := _store_left_under_tilde(value, path)) is not None:
            return str(left)
        if not path.is_absolute():
            path = path.absolute()
            log.warning("[matrix] store_path %r is relative: the session is kept in %s (under the folder the bot "
                        "was started in); write an absolute path, or a start from elsewhere logs in as a new "
                        "device", value, path)
        return str(path)

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> MatrixConfig:
        """When enabled, everything a login needs, each problem said at once (one per start took three starts)."""
        if not self.enabled:  # (a Discord bot with an old or half-written [matrix] section starts)
            return self
        self.homeserver, self.user_id = self.homeserver.strip(), self.user_id.strip()
        problems = [f"{k} is not set" for k in ("homeserver", "user_id") if not getattr(self, k)]
        if self.homeserver:
            try:  # ("matrix.example.org": nio retried its invalid URL forever)
                check_http_url(self.homeserver, "[matrix] password_env or access_token_env")
            except PydanticCustomError as exc:
                problems.append(f"homeserver {exc.message()}")
            except ValueError:
                like = self.homeserver if "://" not in self.homeserver else "matrix.example.org"
                problems.append(f"homeserver {self.homeserver!r} is not an http(s) URL: write it like https://{like}")
        if self.user_id and not _MATRIX_USER.fullmatch(self.user_id):
            problems.append(f"user_id {self.user_id!r} is not a full Matrix user id: write it like "
                            "@cortex:example.org (an @, the account's name, a colon and its server)")
        if not (self.password_env or self.access_token_env):
            problems.append("neither password_env nor access_token_env is set")
        if problems:
            raise ValueError("[matrix] is enabled, but " + "; ".join(problems))
        return self


_SKILL_NAME = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}")
# Names of headers and variables whose value is a credential: Authorization, Cookie, X-Api-Key, PRIVATE-TOKEN,
# GITHUB_TOKEN, DB_PASSWORD, AWS_SECRET_ACCESS_KEY ... (a word of the name, between "-" or "_").
_CREDENTIAL_WORDS = frozenset({"authorization", "cookie", "token", "secret", "password", "passwd", "apikey", "key",
                               "credential", "credentials"})


def _holds_credential(name: str, value: str) -> bool:
    """Whether a fixed header (``headers``) or variable (``env``) written in the file carries a secret: by its name,
    or by its value ("Bearer …", a token's look). A file's path (``SSH_KEY_PATH = "/srv/bot/id_ed25519"``) is where
    a secret is kept, not the secret."""
    if value.strip().startswith(("/", "~/", "./", "../")):
        return False
    words = set(re.split(r"[-_.]", name.lower()))
    scheme, _, rest = value.strip().partition(" ")
    return bool(words & _CREDENTIAL_WORDS) or (scheme.lower() in ("bearer", "basic", "token") and bool(rest)) or \
        looks_like_token(value.strip())


def _no_credentials(given: dict[str, str], kind: str, instead: str) -> None:
    """Refuse a secret written in the file where the environment should hold it (never repeating its value)."""
    for name, value in given.items():
        if _holds_credential(name, value):
            raise ValueError(f"{kind} {name[:60]!r} holds a secret, and the config file is no place for one: remove "
                             f"it here, put its value in an environment variable and name that in {instead} = "
                             f"{{ \"{name[:60]}\" = \"VARIABLE_NAME\" }}")


def _remote_ref(schema: Any) -> str | None:
    """The first ``$ref`` in ``schema`` that does not point into the schema itself (``#…``), if any."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return ref
        return next((r for v in schema.values() if (r := _remote_ref(v)) is not None), None)
    if isinstance(schema, list):
        return next((r for v in schema if (r := _remote_ref(v)) is not None), None)
    return None


URL_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")  # "{city}" in an HTTP skill's url


class HttpSkillConfig(_Section):
    """One ``[[skills.http]]`` entry: an HTTP endpoint the persona may call as a tool."""

    name: str = Field(pattern=_SKILL_NAME, description="Tool name the model sees.")
    description: str = Field(min_length=1, max_length=2000, description="What the tool does, for the model.")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON schema (an object schema) of the arguments.",
    )
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "GET"
    url: str = Field(min_length=1, description="URL template; {arg} is replaced by the URL-quoted argument.")
    headers: dict[str, str] = Field(default_factory=dict, description="Fixed request headers.")
    headers_env: dict[str, str] = Field(
        default_factory=dict, description="Header name -> environment variable holding its value (secrets)."
    )
    timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    max_response_bytes: int = Field(default=100_000, ge=100, le=10_000_000)
    result_path: str = Field(
        default="", description="Dotted path into a JSON response the model sees (e.g. data.items); empty: all."
    )
    admin_only: bool = Field(default=False, description="Offered to the bot's admins (admin_ids) only.")
    triggers: list[str] = Field(default_factory=list, description="Offered only when a message has one of these.")
    allow_internal: bool = Field(
        default=False, description="The url's host may be a name that resolves to an internal address (a service "
        "on this machine or network, e.g. http://ollama:11434); an IP address or localhost written in the url "
        "may be one anyway. Off: the name must resolve to public addresses, as any other host.")

    @field_validator("url")
    @classmethod
    def _no_user_info(cls, value: str) -> str:
        return refuse_user_info(value, "headers_env (an Authorization header: \"Basic …\" or \"Bearer …\")")

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Both model APIs take a tool's input schema only as ``type = "object"``: any other made every
        request that offers the skill fail, so the persona could not answer at all."""
        if value.get("type") != "object":
            raise ValueError('parameters must be an object schema: type = "object", with the arguments under '
                             "properties (the model APIs refuse any other, and every reply would fail)")
        remote = _remote_ref(value)
        if remote is not None:  # the schema check would fetch it (or fail) at every call
            raise ValueError(f"parameters: $ref {remote[:80]!r} points outside the schema; only local references "
                             "(#/$defs/…) are followed")
        try:
            validators.validator_for(value).check_schema(value)
        except schema_errors.SchemaError as exc:
            raise ValueError(f"parameters is not a valid JSON schema: {exc.message[:200]}") from None
        return value

    @model_validator(mode="after")
    def _placeholders_are_parameters(self) -> HttpSkillConfig:
        """A ``{name}`` in the url that the schema, where it names its arguments, does not offer: the model
        never sends it, and every call failed with "missing argument". (A schema without properties takes
        any argument.)"""
        offered = self.parameters.get("properties") or {}
        open_ended = self.parameters.get("patternProperties") or self.parameters.get("additionalProperties") not in (
            None, False)  # (arguments it does not name are welcome)
        if not offered or open_ended:
            return self
        unknown = sorted({m for m in URL_PLACEHOLDER.findall(self.url) if m not in offered})
        if unknown:
            names = ", ".join(f"{{{m}}}" for m in unknown)
            raise ValueError(f"url uses {names}, which parameters does not define: add "
                             f"{'it' if len(unknown) == 1 else 'them'} under parameters.properties (and to required)")
        return self

    @field_validator("headers", "headers_env")
    @classmethod
    def _header_names(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        """A header's name is an HTTP token and a fixed value one line: anything else failed every call."""
        for name, given in value.items():
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"{name[:60]!r} is not a header name (letters, digits and !#$%&'*+-.^_`|~)")
            if info.field_name == "headers" and any(ch in given for ch in "\r\n\x00"):
                raise ValueError(f"the value of header {name!r} must be one line")
        if info.field_name == "headers":  # (a secret here followed redirects to other hosts, and was never redacted)
            _no_credentials(value, "header", "headers_env")
        return value


class McpServerConfig(_Section):
    """One ``[[skills.mcp]]`` entry: an MCP server whose tools the persona may call."""

    name: str = Field(pattern=_SKILL_NAME)
    command: list[str] = Field(default_factory=list, description="A stdio server: program and arguments.")
    url: str = Field(default="", description="A streamable HTTP server's URL.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for a stdio server.")
    env_from: dict[str, str] = Field(
        default_factory=dict, description="Variable for the server -> variable of the bot's environment (secrets)."
    )
    headers_env: dict[str, str] = Field(
        default_factory=dict, description="HTTP server: header name -> environment variable holding its value."
    )
    tools: list[str] = Field(default_factory=list, description="Allowed tool names; empty: all.")
    timeout_seconds: float = Field(default=30.0, gt=0, le=600, description="Longest tool call.")
    admin_only: bool = Field(default=False, description="Its tools are offered to the bot's admins only.")
    triggers: list[str] = Field(default_factory=list)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        """An http(s) URL, without user:password@ (a URL without its scheme, "localhost:3000/mcp", passed here and
        then logged the server as down, retrying, for as long as the bot ran)."""
        return check_http_url(value, "headers_env") if value.strip() else value

    @field_validator("env")
    @classmethod
    def _no_secret_in_env(cls, value: dict[str, str]) -> dict[str, str]:
        """A secret in ``env`` sat in the file and was not redacted from the server's logged errors."""
        _no_credentials(value, "variable", "env_from")
        return value

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if bool(self.command) == bool(self.url):
            which = "both command and url are set" if self.command else "neither command nor url is set"
            raise ValueError(f"[[skills.mcp]] {self.name!r}: {which}: set command (a stdio server) or url "
                             "(an HTTP one)")
        return self


BUILTIN_SKILLS = ("remember", "search_memory", "search_lore", "current_time", "read_soul", "read_guidelines",
                  "edit_soul", "edit_guidelines")


def _did_you_mean(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


class SkillsConfig(_Section):
    """Tools the persona may use while replying."""

    enabled: bool = Field(default=True, description="Offer skills to the model in replies.")
    builtin: list[str] = Field(default_factory=lambda: list(BUILTIN_SKILLS),
                               description="Built-in skills on by default.")
    disabled: list[str] = Field(default_factory=list, description="Skills off by default (admins may enable).")
    max_rounds: int = Field(default=4, ge=1, le=20, description="Most model calls in one reply.")
    reply_token_cap: int = Field(default=20_000, ge=1000, description="Tokens one reply may spend over all rounds.")
    calls_per_user_per_day: int = Field(default=50, ge=0, description="Calls of one skill per user per day (0: off).")
    result_max_chars: int = Field(default=8000, ge=200, le=200_000, description="Longest tool result the model sees.")
    timezone: str = Field(default="UTC", description="The bot's zone: {date} in prompts, current_time's default.")
    http: list[HttpSkillConfig] = Field(default_factory=list)
    mcp: list[McpServerConfig] = Field(default_factory=list)

    @property
    def zone(self) -> ZoneInfo:
        """``timezone`` (checked when the config was read). The date prompts give the model is today's here, as
        ``current_time`` says it: in UTC, a bot set to Sydney's zone was told it was yesterday each morning."""
        return ZoneInfo(self.timezone)

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError("no such time zone: use an IANA name like Europe/Berlin, America/New_York or UTC"
                             ) from None
        return value

    @model_validator(mode="after")
    def _names_are_known(self) -> SkillsConfig:
        """A typo here switched skills off (or failed to) without a word: built-in names are checked, HTTP
        skills may not share a name, and a ``disabled`` name close to a known one but not it is refused when
        no MCP server is configured (their tools are known only once they run; ``server/tool`` must name a
        configured server)."""
        for name in self.builtin:
            if name not in BUILTIN_SKILLS:
                raise ValueError(f"builtin: {name!r} is no built-in skill{_did_you_mean(name, BUILTIN_SKILLS)}; "
                                 f"they are {', '.join(BUILTIN_SKILLS)}")
        http: set[str] = set()
        for entry in self.http:
            if entry.name.casefold() in http or entry.name in BUILTIN_SKILLS:
                raise ValueError(f"[[skills.http]] {entry.name!r}: a skill of that name exists already "
                                 "(built-in or another http entry); give it a name of its own")
            http.add(entry.name.casefold())
        known = [*BUILTIN_SKILLS, *(entry.name for entry in self.http)]
        servers = {server.name for server in self.mcp}
        for name in self.disabled:
            server, slash, _ = name.partition("/")
            if slash and server not in servers:
                raise ValueError(f"disabled: {name!r} names a tool of the MCP server {server!r}, which "
                                 f"[[skills.mcp]] does not have")
            if slash or servers or name.casefold() in {k.casefold() for k in known}:
                continue  # an MCP server's tools are known only once it runs: any name may be one
            if hint := _did_you_mean(name, known):
                raise ValueError(f"disabled: {name!r} names no skill{hint}")
        return self


MAX_ALLOWED_HOSTS = 100
HOST_NAME = re.compile(r"(?:[a-z0-9_-]{1,63}\.)*[a-z0-9_-]{1,63}")


def canonical_host(name: str) -> str | None:
    """A host name (without its port) as Host headers are compared: lower case, without a trailing dot, an
    internationalised name in punycode (as browsers send it), an IPv6 address in brackets in its shortest
    spelling; None when it is no host name."""
    name = name.lower().removesuffix(".")
    bare = name.removeprefix("[").removesuffix("]")
    try:
        if ":" in bare:
            return f"[{ipaddress.IPv6Address(bare).compressed}]"
        if not name.isascii():
            name = idna.encode(name, uts46=True, transitional=False).decode("ascii")
    except (ValueError, idna.IDNAError):
        return None
    return name if HOST_NAME.fullmatch(name) else None


def _allowed_host(entry: str) -> str:
    """One ``[web] allowed_hosts`` entry as the Host header is compared with it (see :func:`canonical_host`)."""
    shown = repr(entry[:60]) + ("…" if len(entry) > 60 else "")
    if len(entry) > 253:
        raise ValueError(f"{shown} in allowed_hosts is longer than a host name can be (at most 253 characters)")
    if entry == "*":
        return entry
    name = canonical_host(entry)
    if name is None:
        raise ValueError(f"{shown} in allowed_hosts: write a host name alone, like bot.example.org, "
                         "192.168.1.5 or [::1] (no http://, path, port or spaces; ports are not compared)")
    return name


class WebConfig(_Section):
    """The web page: memory and admin views, a JSON API, health and metrics, served by the bot itself."""

    enabled: bool = Field(default=False, description="Serve the web page beside the adapters.")
    host: str = Field(default="127.0.0.1", description="Address to listen on (behind a proxy: keep loopback).")
    port: int = Field(default=8080, ge=0, le=65535, description="Port to listen on (0: any free port).")
    public_url: str = Field(
        default="", description="The address people open (behind a reverse proxy); default http://host:port.")
    session_hours: float = Field(default=12.0, gt=0, le=24 * 90, description="How long a login lasts.")
    link_minutes: float = Field(default=10.0, gt=0, le=60, description="How long a !dashboard link works.")
    metrics: bool = Field(default=True, description="Serve Prometheus /metrics.")
    metrics_host: str = Field(default="", description="Serve /metrics on another address (default: the page's).")
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="… and port.")
    max_body_kb: int = Field(default=256, ge=16, le=65_536, description="Largest request body accepted.")
    views_per_minute: int = Field(default=120, ge=0, le=100_000, description=(
        "File views, diffs and searches one user may ask the page for in a minute (0: no limit)."))
    allowed_hosts: list[str] = Field(default_factory=list, description=(
        "More names the page answers to (Host header), beside public_url's, host and loopback; [\"*\"]: any."))

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, names: list[str]) -> list[str]:
        """Names as the Host header is compared with them (lower case, punycode, IPv6 in brackets)."""
        if len(names) > MAX_ALLOWED_HOSTS:
            raise ValueError(f"at most {MAX_ALLOWED_HOSTS} names (got {len(names)})")
        return [_allowed_host(entry) for entry in names]

    @field_validator("host", "metrics_host")
    @classmethod
    def _listen_address(cls, value: str, info: ValidationInfo) -> str:
        """An address to listen on, alone: a URL or a port written in it failed only when the page started (after
        `doctor` passed), and a URL's "0.0.0.0" in it was warned about as listening on every address."""
        port_key = "port" if info.field_name == "host" else "metrics_port"
        if "/" in value:
            raise ValueError(f"write the address to listen on alone, like 127.0.0.1 or 0.0.0.0, not a URL (the "
                             f"address people open goes in [web] public_url, the port in [web] {port_key})")
        if value and value.strip("[]") not in ("", "::") and canonical_host(value) is None:
            if value.count(":") == 1:
                raise ValueError(f"write the address alone, like 127.0.0.1, and the port in [web] {port_key}")
            raise ValueError("not a host name or an IP address to listen on (e.g. 127.0.0.1, 0.0.0.0 or ::)")
        return value

    @field_validator("public_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        """The page's origin as a browser writes it in ``Origin`` (requests are checked against it): no
        default port (":443" locked everyone out), no path (the page's links start at "/")."""
        value = value.strip().rstrip("/")
        if not value:
            return value
        if not value.lower().startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https:// (e.g. https://bot.example.org)")
        parts = urlsplit(value)
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"{value!r} has a port that is not a number") from None
        if not parts.hostname or parts.username is not None or parts.path or parts.query or parts.fragment:
            raise ValueError("must be the page's address alone, like https://bot.example.org: the page is served at "
                             "the root of it (a path, a query or a user name cannot be used)")
        scheme = parts.scheme.lower()
        hostname = parts.hostname
        if not hostname.isascii():  # a browser sends an internationalised name in Origin as punycode
            try:  # (UTS #46 as browsers: Python's own codec is IDNA 2003, which turns straße into strasse)
                hostname = idna.encode(hostname, uts46=True, transitional=False).decode("ascii")
            except idna.IDNAError:
                raise ValueError(f"{value!r} is not a host name a browser can reach") from None
        host = f"[{hostname}]" if ":" in hostname else hostname
        default = {"http": 80, "https": 443}[scheme]
        return f"{scheme}://{host}" + (f":{port}" if port is not None and port != default else "")

    _listening: str = PrivateAttr(default="")  # the address the page was bound to (port 0: the port chosen)

    def listening_on(self, url: str) -> None:
        """Where the running page listens: its links use it when no ``public_url`` is set."""
        self._listening = url

    @property
    def base_url(self) -> str:
        if self.public_url:
            return self.public_url
        if self._listening:
            return self._listening
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def secure_cookies(self) -> bool:
        return self.base_url.startswith("https://")

    @property
    def links_unreachable(self) -> bool:
        """Whether login links would name every address (host 0.0.0.0 or ::, no public_url): no browser opens those."""
        return not self.public_url and self.host.strip("[]") in ("0.0.0.0", "::", "")

    @model_validator(mode="after")
    def _metrics_address(self) -> WebConfig:
        if self.enabled and self.metrics and self.metrics_host and self.metrics_port is None:
            raise ValueError("metrics_host needs metrics_port too (the port /metrics listens on at that address; 0 "
                             "picks a free one each start); to keep /metrics on the page's own address, set neither")
        return self


class TerminalConfig(_Section):
    enabled: bool = Field(default=True, description=(
        "Whether `cortexbot run` is a terminal chat when neither Discord nor Matrix is enabled (with them, `run` "
        "serves those alone: a service reads no keyboard; chat beside it with `cortexbot chat`)."))
    user: str = Field(default="", description="Name of the local user; default: the login name.")


class PersonaConfig(_Section):
    name: str = Field(min_length=1, max_length=80)
    language: str = "English"
    model: FallbackModel = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    history_tokens: int | None = Field(default=None, ge=50)
    summary_tokens: int | None = Field(default=None, ge=20)
    identity: str = ""
    personality: str = ""
    boundaries: str = ""
    communication_style: str = ""
    values: str = ""
    tone: str = ""
    domain_expertise: str = ""
    error_handling: str = ""
    soul_order: list[str] = Field(default_factory=lambda: list(SOUL_SECTIONS))

    @field_validator("name")
    @classmethod
    def _readable_name(cls, name: str) -> str:
        """A name people can read and type: not blank, no control or invisible characters (a name such as
        "Co\u200bra" looks like "Cora" and cannot be picked by typing it)."""
        if not readable(name) or name != name.strip():
            raise ValueError(f"{name!r}: a persona's name is visible text without control or invisible characters "
                             "and without spaces at either end")
        if only_dots(name):  # (refused here, before the personas are seeded into the database)
            raise ValueError(f"{name!r}: {ONLY_DOTS}")
        return name

    @field_validator("soul_order")
    @classmethod
    def _known_sections(cls, value: list[str]) -> list[str]:
        """The order of the sections it lists, the others after them in their usual order: an order is no choice of
        sections (the ones left out were dropped from the prompt, boundaries and all)."""
        unknown = [s for s in value if s not in SOUL_SECTIONS]
        if unknown:
            raise ValueError(f"unknown soul section(s) {unknown}; allowed: {', '.join(SOUL_SECTIONS)}")
        if len(set(value)) != len(value):
            raise ValueError("a soul section is listed twice")
        return value + [section for section in SOUL_SECTIONS if section not in value]

    def soul_sections(self) -> list[tuple[str, str]]:
        """Non-empty soul sections in this persona's order."""
        return [(name, getattr(self, name)) for name in self.soul_order if getattr(self, name).strip()]


class ModelChoice(Protocol):
    """What a persona says about its model (a config entry, or a persona from the database)."""

    @property
    def model(self) -> str | None: ...

    @property
    def temperature(self) -> float | None: ...


DEFAULT_PERSONA = PersonaConfig(
    name="Cora",
    identity="You are {char_name}, a friendly and thoughtful companion in a chat with {user_name}.",
    personality="Curious, warm and honest. You remember what people tell you and build on it.",
    boundaries="You never pretend to have done things you cannot do, and you say when you do not know.",
    communication_style="Answer in {language}, briefly and naturally, like a person in a chat. Today is {date}.",
)


class Config(_Section):
    bot: BotConfig = Field(default_factory=BotConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig)
    history: HistoryConfig = Field(default_factory=HistoryConfig)
    jobs: JobsConfig = Field(default_factory=JobsConfig)
    cortex: CortexConfig = Field(default_factory=CortexConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    chat: ChatConfig = Field(default_factory=ChatConfig)
    access: AccessConfig = Field(default_factory=AccessConfig)
    discord: DiscordConfig = Field(default_factory=DiscordConfig)
    matrix: MatrixConfig = Field(default_factory=MatrixConfig)
    terminal: TerminalConfig = Field(default_factory=TerminalConfig)
    skills: SkillsConfig = Field(default_factory=SkillsConfig)
    web: WebConfig = Field(default_factory=WebConfig)
    personas: list[PersonaConfig] = Field(default_factory=lambda: [DEFAULT_PERSONA.model_copy()])

    @model_validator(mode="after")
    def _personas_consistent(self) -> Config:
        if not self.personas:
            raise ValueError("at least one [[personas]] entry is needed (or leave the key out for the default)")
        alike = [persona_key(p.name) for p in self.personas]  # as the store's claims tell names apart
        dupes = sorted({p.name for p, n in zip(self.personas, alike, strict=True) if alike.count(n) > 1})
        if dupes:
            raise ValueError("persona names must be unique (case, accents written two ways, full-width letters and "
                             "Cyrillic or Greek look-alikes of Latin letters count as one); "
                             f"duplicated: {', '.join(dupes)}")
        if self.bot.default_persona:
            names = [name_key(p.name) for p in self.personas]  # as lookups find them (case, Unicode form)
            wanted = name_key(self.bot.default_persona)
            if wanted not in names:
                raise ValueError(
                    f"[bot] default_persona = {self.bot.default_persona!r} is not one of the [[personas]] names "
                    f"({', '.join(p.name for p in self.personas)})"
                )
            # as its [[personas]] entry writes it: every later lookup (settings, lists, the web page) finds it
            self.bot.default_persona = self.personas[names.index(wanted)].name
        return self

    def model_for(self, persona: ModelChoice) -> str:
        return persona.model or self.llm.model

    def temperature_for(self, persona: ModelChoice) -> float | None:
        return persona.temperature if persona.temperature is not None else self.llm.temperature

    def persona(self, name: str | None = None) -> PersonaConfig:
        """The persona called ``name`` (case-insensitive), or the default one."""
        wanted = name or self.bot.default_persona
        if wanted is None:
            return self.personas[0]
        for persona in self.personas:
            if persona.name.casefold() == wanted.casefold():
                return persona
        raise ConfigError(
            f"unknown persona {wanted!r}; configured personas: {', '.join(p.name for p in self.personas)}"
        )


def shown_variable(name: str, key: str) -> str:
    """A password variable's name as a message shows it, ``$NAME``; a name in small letters too ("hunter2") may be
    the password itself, pasted where its variable's name belongs (a password is any word its owner chose, and the
    checks of ``*_env`` keys catch tokens, not words), so it is not repeated: the key that holds it is named."""
    if name == name.upper():
        return f"${name}"
    return (f"the variable {key} names (not repeated here: if what is written there is the password itself, put it "
            "in an environment variable and write that variable's name there)")


def read_secret(env_name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The secret held by environment variable ``env_name`` without the whitespace around it (a secret mounted from
    a file, or made with ``echo``, ends in a line break), or None when it is unset or empty. One with a line break
    or another control character inside raises :class:`ConfigError` naming the variable: no server takes it, and
    HTTP refuses it in a header (as a traceback, or as a server that "cannot be reached")."""
    value = (env if env is not None else os.environ).get(env_name, "").strip()
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ConfigError(f"environment variable {env_name} holds a line break or another control character inside "
                          "its secret: put the secret alone in it")
    return value or None


def resolve_config_path(explicit: str | os.PathLike[str] | None) -> Path | None:
    """Where the config comes from: --config, then $CORTEXBOT_CONFIG, then ./config.toml, else none."""
    if explicit:
        return Path(explicit)
    from_env = os.environ.get(CONFIG_ENV)
    if from_env:
        return Path(from_env)
    local = Path(DEFAULT_CONFIG_NAME)
    # Anything by that name is meant as the config: a folder (what Docker makes of a bind-mounted file that
    # did not exist yet) or a broken link is reported when read, not passed over for the defaults.
    return local if local.exists() or local.is_symlink() else None


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read and validate the config at ``path`` (None: built-in defaults). Raises :class:`ConfigError`."""
    if path is None:
        return Config()
    file = Path(path)
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8-sig"))  # -sig: a BOM some Windows editors write
    except FileNotFoundError:
        if file.is_symlink():
            raise ConfigError(f"config file {file} is a link to {os.readlink(file)}, which does not exist") from None
        raise ConfigError(f"config file {file} does not exist; copy config.example.toml there to start") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {file}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{file} nests arrays or tables too deeply to be a cortex-bot config") from None
    return parse_config(raw, source=str(file))


def parse_config(raw: Mapping[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(raw)
    except RecursionError:
        raise ConfigError(f"{source} nests arrays or tables too deeply to be a cortex-bot config") from None
    except ValidationError as exc:
        secrets = sorted({piece for url in _urls_in(raw) for piece in _secret_pieces(url)}, key=len, reverse=True)
        lines = [_cut_problem(hide_url_passwords(_without(secrets, _describe_error(err, raw)))) for err in exc.errors()]
        raise ConfigError(f"{source} has {len(lines)} problem(s):\n" + "\n".join(f"  - {x}" for x in lines)) from None


MAX_PROBLEM_CHARS = 1000  # of one problem's line in a refusal (the longest list of known keys is half that)


def _cut_problem(line: str) -> str:
    """One problem's line cut to :data:`MAX_PROBLEM_CHARS`: it repeats the refused value, which may be of any size
    (a prompt pasted under a wrong key made a line of 100,000 characters). Cut only once its secrets are hidden:
    a password cut in two is no longer found whole."""
    if len(line) <= MAX_PROBLEM_CHARS:
        return line
    return f"{line[:MAX_PROBLEM_CHARS - 1]}\u2026 ({len(line):,} characters in all)"


def _urls_in(raw: object) -> list[str]:
    """Every string of a raw config that holds a URL (its passwords are known exactly: see ``_url_secrets``)."""
    if isinstance(raw, str):
        return [raw] if "://" in raw else []
    if isinstance(raw, Mapping):
        return [url for value in raw.values() for url in _urls_in(value)]
    if isinstance(raw, list | tuple):
        return [url for value in raw for url in _urls_in(value)]
    return []


def _without(secrets: Sequence[str], text: str) -> str:
    """``text`` with each of ``secrets`` as ``***`` (those of fewer than 3 characters are left to the patterns:
    replacing every "a" would leave nothing readable)."""
    for secret in secrets:
        if len(secret) >= 3:
            text = text.replace(secret, "***")
    return text


# Both patterns are linear in the text's length, which may be a refused value of any size: the scheme is at most 32
# characters (unbounded, each letter of a long word began a scan to its end), a query parameter's name holds no "?"
# (each "?" of "????…" began one), and a password is looked for only up to the last "@" of its word (see
# _hide_userinfo).
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s:/@]*):\S*@")
_QUERY_PARAM = re.compile(r"([?&])([^=&#?\s]*)=([^&#\s]*)")  # a URL's query parameter (name and value)
_WORD = re.compile(r"\S+")
_SECRET_PARAMS = frozenset({"password", "sslpassword"})  # libpq's and asyncpg's names of a password


# Passwords this process read (a storage URL's, password_env's), in pieces: hidden wherever they appear, also where
# no pattern finds them (a password with a space: where it ends in a line of text, only knowing it tells).
_known_secrets: set[str] = set()


def _pieces(secret: str, shown: str = "") -> set[str]:
    """A password as it may be written or quoted in part: whole, percent-encoded, and its pieces between "/", "@",
    ":", "?", "#" and spaces (a URL parser's error may quote one), but for what ``shown`` holds and pieces too
    short to hide without hiding every such letter."""
    pieces = {secret, quote(secret, safe=""), quote_plus(secret, safe=""), *re.split(r"[/@:?#\s]+", secret)}
    return {piece for piece in pieces if len(piece) >= 3 and piece not in shown}


def hide_url_passwords(text: str) -> str:
    """``text`` with the password of every URL in it as ``***``, before the host (up to the last "@" before a
    space: a password may hold an unencoded "@" or a quote) and in the query (``?password=``), and with every
    password the process read (``_known_secrets``) as ``***``: a refused URL is shown back, but never the
    secret in it."""
    text = _without(sorted(_known_secrets, key=len, reverse=True), text)
    return _QUERY_PARAM.sub(_hidden_param, _WORD.sub(_hide_userinfo, text))


def _hide_userinfo(word: re.Match[str]) -> str:
    """One word (no white space) with the password before its host as ``***``. A password runs to the word's last
    "@", so the pattern is tried on the word up to there only: past it no attempt can succeed, and each attempt
    (one per "scheme://user:" of "a://:a://:…") scanned the rest of the word."""
    text = word[0]
    last_at = text.rfind("@")
    if last_at == -1 or "://" not in text:
        return text
    return _URL_PASSWORD.sub(r"\1:***@", text[:last_at + 1]) + text[last_at + 1:]


def secret_param(name: str) -> bool:
    """Whether a URL query parameter's name is a password's, however it is written (``pass%77ord`` is decoded to
    ``password`` by the drivers)."""
    return unquote_plus(name).strip().lower() in _SECRET_PARAMS


def _hidden_param(match: re.Match[str]) -> str:
    return f"{match[1]}{match[2]}=***" if secret_param(match[2]) else match[0]


def _location(loc: tuple[int | str, ...]) -> str:
    """Render a pydantic error location as the TOML reader sees it: [llm] max_tokens, [[personas]] #2 name."""
    parts = list(loc)
    if not parts:
        return "top level"
    head = parts.pop(0)
    if head == "personas" and parts and isinstance(parts[0], int):
        index = parts.pop(0)
        where = f"[[personas]] #{int(index) + 1}"
    elif isinstance(head, str) and head in Config.model_fields:
        where = f"[{head}]"
        if len(parts) >= 2 and isinstance(parts[1], int) and _holds_tables(loc[:2]):  # [[skills.http]] #1
            where = f"[[{head}.{parts[0]}]] #{parts[1] + 1}"
            parts = parts[2:]
    else:
        return f"key '{head}' at the top level" if not parts else f"'{'.'.join(map(str, loc))}'"
    return f"{where} key '{'.'.join(map(str, parts))}'" if parts else where


def _holds_tables(loc: tuple[int | str, ...]) -> bool:
    """Whether the field at ``loc`` is an array of tables (``[[skills.http]]``), not of values."""
    model = _model_for(loc)
    field = model.model_fields.get(str(loc[-1])) if model is not None else None
    args = getattr(field.annotation, "__args__", ()) if field is not None else ()
    return any(isinstance(a, type) and issubclass(a, BaseModel) for a in args)


def _model_for(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        annotation = field.annotation
        inner = getattr(annotation, "__args__", (annotation,))
        candidates = [a for a in (annotation, *inner) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not candidates:
            return None
        model = candidates[0]
    return model


def _toml_kind(err: Mapping[str, Any]) -> str:
    got = err.get("input")
    if isinstance(got, list):
        return f"[[{'.'.join(map(str, err.get('loc', ())))}]], which makes a list"
    return {bool: "true or false", int: "a number", float: "a number", str: "a text"}.get(type(got), "a value")


def _describe_error(err: Mapping[str, Any], raw: Mapping[str, Any]) -> str:
    loc: tuple[int | str, ...] = tuple(err.get("loc", ()))
    kind = err.get("type", "")
    where = _location(loc)
    if kind == "extra_forbidden":
        model = _model_for(loc)
        known = sorted(model.model_fields) if model else []
        name = str(loc[-1]) if loc else "?"
        if f"{name}_env" in known:  # (api_key, token, password: a secret written into the file)
            return (f"unknown {where}: secrets are not read from the config file; put it in an environment "
                    f"variable and write that variable's name as {name}_env")
        hint = difflib.get_close_matches(name, known, n=1)
        fix = f"did you mean '{hint[0]}'?" if hint else f"known keys: {', '.join(known)}"
        return f"unknown {where}: remove it or fix the spelling ({fix})"
    if kind == "missing":
        return f"missing required {where}: add it"
    if kind == "model_type":  # a section written as a value or a list ([[llm]], llm = 5): pydantic names its class
        names = [str(part) for part in loc if not isinstance(part, int)]
        header = f"[[{'.'.join(names)}]]" if loc and isinstance(loc[-1], int) else f"[{'.'.join(names)}]"
        return f"{where} must be a table: {header} on a line of its own, its keys below it (not {_toml_kind(err)})"
    if kind == "list_type" and isinstance(err.get("input"), Mapping) and _model_for((*loc, "")) is not None:
        # [personas] where [[personas]] was meant (a list of tables, not of values like [cortex] tiers)
        dotted = ".".join(str(part) for part in loc if not isinstance(part, int))
        return (f"{where} is a list of tables: write each entry under [[{dotted}]] (two brackets), "
                f"not one [{dotted}] table")
    got = err.get("input")
    # maybe a secret pasted in, or a URL holding one
    secret = kind == URL_USER_INFO or any(isinstance(part, str) and _names_variables(part) for part in loc)
    shown = "" if isinstance(got, Mapping) or got is None or secret else f" (got {got!r})"
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")  # pydantic's wording
    if isinstance(got, Mapping) and message.startswith("["):
        return message  # a whole section's check, which names the section itself
    return f"{where}: {message}{shown}"
