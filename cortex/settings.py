"""Effective cortex settings: config defaults, overridden per persona, overridden per server.

Overrides are rows in ``cortex_settings`` (scope ``persona:<name>`` or ``server:<key>``), set by
admin commands, so they hold across restarts and are shared by every process on the database. The
effective value of every key can always be shown together with where it came from.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from bot.config import FREQUENCY_PRESETS, CortexConfig
from bot.llm.base import LLMProvider
from bot.llm.probe import check_model
from bot.text import shown
from cortex.store import CortexStore

# Keys admins may override, with how a value typed in a chat command is read.
OVERRIDABLE: dict[str, str] = {
    "enabled": "on/off",
    "frequency": "frequent, medium or rare",
    "tiers": "percentages, e.g. 50,75,95 or 50 75 95 (or 'none' to use the frequency)",
    "context_limit": "messages per cycle, e.g. 60",
    "cooldown_seconds": "seconds, e.g. 30",
    "max_rounds": "model calls per update, e.g. 10",
    "model": "a model name (or 'default')",
    "temperature": "0 to 2 (or 'default')",
    "daily_token_budget": "tokens per pair and UTC day (0: no limit)",
    "use_in_groups": "on/off: use what a user shared in DMs in group channels too",
}
# How chat shows an unset model or temperature (cortex.commands), read back as unset when typed or pasted.
SHOWN_UNSET = ("the chat model", "provider default")
CACHE_SECONDS = 5.0
# What the bot's operator pays for: a server admin may tune how the persona remembers, not the bill.
OPERATOR_KEYS = frozenset({"model", "daily_token_budget", "max_rounds"})
PRIVACY_KEYS = frozenset({"use_in_groups"})
# How often updates run, so how many model calls the operator pays for: a server admin may set these for their
# server only towards fewer updates than each persona's own settings (a bot admin sets them freely).
PACE_KEYS = frozenset({"enabled", "frequency", "tiers", "context_limit", "cooldown_seconds"})

log = logging.getLogger(__name__)


def check_may_change(key: str, *, bot_admin: bool, value: str = "") -> None:
    """Raise :class:`SettingError` when someone who is not a bot admin changes (or clears) a setting that
    decides the operator's spending (which model updates run on, how many tokens a pair may spend a day
    and how many calls one update may make) or the users' privacy (switching ``use_in_groups`` on)."""
    if key in OPERATOR_KEYS and not bot_admin:
        raise NotAllowed(f"{key} decides what the bot's operator pays for: only the bot's admins change it")
    if key in PRIVACY_KEYS and not bot_admin and value.strip().lower() != "default" \
            and parse_value(key, value) is True:
        # A server admin is anyone who makes a Matrix room: their switch would decide where everyone else's
        # private memory shows. Switching it off keeps things private: anyone may (back to the default: see
        # SettingsResolver.change).
        raise NotAllowed(_PRIVACY_REFUSAL.format(key=key))


def plain_problem(exc: ValidationError) -> str:
    """A validation error as a person would say it ("at least 4", not "Input should be greater than...")."""
    error = exc.errors()[0]
    context = error.get("ctx") or {}
    for bound, words in (("ge", "at least"), ("gt", "more than"), ("le", "at most"), ("lt", "less than")):
        if bound in context:
            limit = context[bound]
            if isinstance(limit, int | float):  # 2592000, not 2.592e+06 (and seconds said as days too)
                shown_limit = f"{limit:,.0f}" if float(limit).is_integer() else f"{limit:,}"
                days = f" ({limit / 86_400:g} days)" if error.get("loc") == ("cooldown_seconds",) and limit >= 86_400 \
                    else ""
                return f"it must be {words} {shown_limit}{days}"
            return f"it must be {words} {limit}"
    message = str(error.get("msg", "invalid value"))
    return message.removeprefix("Value error, ").replace("Input should be", "it must be")


class SettingError(ValueError):
    """An override that cannot be stored; the message says what is accepted."""


class NotAllowed(SettingError):
    """An override the one asking may not make (a server admin's spending or privacy switch)."""


_PRIVACY_REFUSAL = ("{key} decides whether what people said in private shows in group channels: only the bot's "
                    "admins switch it on")


def persona_scope(persona: str) -> str:
    return f"persona:{persona.casefold()}"


def server_scope(server_key: str) -> str:
    return f"server:{server_key}"


@dataclass(frozen=True, slots=True)
class Change:
    """What :meth:`SettingsResolver.change` did: the value stored, or (for "default") whether an override
    was removed (None: it stored a value)."""

    stored: Any = None
    cleared: bool | None = None
    note: str = ""  # a model that could not be checked: why (see bot.llm.probe)


@dataclass(frozen=True, slots=True)
class Effective:
    settings: CortexConfig
    sources: dict[str, str]  # key -> "config" | scope that set it


def unknown_setting(key: str) -> str:
    if key in CortexConfig.model_fields:
        return (f"{key} is set in the config file only ([cortex] {key}), not in chat; settings here: "
                f"{', '.join(OVERRIDABLE)}")
    return f"unknown setting {shown(key)}; settings: {', '.join(OVERRIDABLE)}"


def _whole(text: str) -> int:
    """A whole number in ASCII digits (``int`` takes "٦٠" and "４" too, which every other command refuses)."""
    if not re.fullmatch(r"[+-]?[0-9]{1,18}", text.strip()):
        raise ValueError
    return int(text)


def _decimal(text: str) -> float:
    if not text.isascii():
        raise ValueError
    return float(text)


def parse_value(key: str, text: str) -> Any:
    """Read a value typed in a command; raises :class:`SettingError` with the accepted form."""
    if key not in OVERRIDABLE:
        raise SettingError(unknown_setting(key))
    raw = text.strip()
    lowered = raw.lower()
    try:
        if key in ("enabled", "use_in_groups"):
            if lowered in ("on", "true", "yes", "1", "enable", "enabled"):
                return True
            if lowered in ("off", "false", "no", "0", "disable", "disabled"):
                return False
            raise ValueError
        if key == "tiers":
            if lowered in ("none", "", "[]"):
                return []
            # "50,75" or "50 75"; in order (as the tiers fire, and as the answer names them)
            return sorted(_whole(part) for part in re.split(r"[,\s]+", raw.strip("[] ")) if part)
        if key in ("context_limit", "max_rounds", "daily_token_budget"):
            number = _whole(raw.removesuffix("(no limit)").strip())  # (as a budget of 0 is shown: "0 (no limit)")
            if number and raw.endswith("(no limit)"):
                raise ValueError
            return number
        if key == "cooldown_seconds":
            return _decimal(raw) + 0.0  # (-0 is 0: it was kept, and shown, as "-0")
        if key in ("model", "temperature") and lowered in ("default", "none", "not set", "", *SHOWN_UNSET):
            return None
        if key == "temperature":
            return _decimal(raw) + 0.0
        if key == "frequency":  # (a word of a few, as on/off is: "RARE" is rare)
            return lowered
        return raw
    except ValueError:
        raise SettingError(f"{key} must be {OVERRIDABLE[key]}; got {shown(text)}") from None


class SettingsResolver:
    def __init__(self, defaults: CortexConfig, store: CortexStore, llm: LLMProvider | None = None) -> None:
        self.defaults = defaults
        self.store = store
        self.llm = llm  # to check a model an admin sets (None: not checked)
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}
        self._warned: set[tuple[str, str, str]] = set()

    async def _scope(self, scope: str) -> dict[str, Any]:
        cached = self._cache.get(scope)
        if cached is not None and time.monotonic() - cached[0] < CACHE_SECONDS:
            return cached[1]
        values = await self.store.settings(scope)
        now = time.monotonic()
        self._cache.pop(scope, None)
        self._cache[scope] = (now, values)  # to the end: the dict stays in the order the scopes were read
        self._forget_stale(now)
        return values

    def _forget_stale(self, now: float) -> None:
        """Drop the scopes read longer than ``CACHE_SECONDS`` ago, at the dict's front: each server a reply was
        written in kept its entry for good (a bot in thousands of Matrix rooms, each a server, kept them all)."""
        while self._cache:
            read_at = next(iter(self._cache.values()))[0]
            if now - read_at < CACHE_SECONDS:
                return
            del self._cache[next(iter(self._cache))]

    async def effective(self, persona: str, server_key: str | None = None) -> Effective:
        """The settings of ``persona`` (at ``server_key``): the config's, under the persona-wide overrides,
        under the server's. A server's override of how often updates run counts only while it has them run
        no more often than the persona's own settings do (one that was rarer when set stays so after a bot
        admin made the persona's rarer still)."""
        below = await self._layered([persona_scope(persona)])
        if not server_key:
            return below
        scope = server_scope(server_key)
        faster = _faster_keys(await self._scope(scope), below.settings)
        return await self._layered([persona_scope(persona), scope], skip=faster)

    async def _layered(self, scopes: list[str], skip: frozenset[str] = frozenset()) -> Effective:
        """The config's settings under the overrides of ``scopes`` in turn (the last one's keys in ``skip``
        left out); an override that no longer validates falls back to the config's value alone."""
        merged = self.defaults.model_dump()
        sources = {key: "config" for key in merged}
        for scope in scopes:
            for key, value in (await self._scope(scope)).items():
                if key in OVERRIDABLE and not (scope == scopes[-1] and key in skip):
                    merged[key] = value
                    sources[key] = scope
        try:
            settings = CortexConfig.model_validate(merged, strict=False)  # stored by older versions too
        except ValidationError as exc:
            # An override that no longer validates (e.g. after an upgrade) must not stop replies: it alone
            # falls back to the config's value, the others stay.
            defaults = self.defaults.model_dump()
            for key in {str(error["loc"][0]) for error in exc.errors() if error.get("loc")}:
                if key in merged:
                    stale = (sources.get(key, ""), key, repr(merged[key])[:200])
                    if stale not in self._warned:  # once, not at every reply
                        self._warned.add(stale)
                        log.warning("the stored cortex setting %s = %s (%s) is no longer valid; the config's value "
                                    "is used until an admin sets it again", key, stale[2], stale[0])
                    merged[key], sources[key] = defaults[key], "config"
            try:
                settings = CortexConfig.model_validate(merged, strict=False)
            except ValidationError:  # a check across keys: every override waits until an admin mends it
                settings = self.defaults
                sources = {key: "config" for key in merged}
        return Effective(settings, sources)

    async def private_memory_allowed(self, persona: str, server_key: str | None, is_dm: bool) -> bool:
        """Whether a user's files and items (which hold what they said in DMs) may enter this prompt:
        always in a DM, in a group channel only where the server set ``use_in_groups``."""
        if is_dm:
            return True
        return (await self.effective(persona, server_key)).settings.use_in_groups

    async def set(self, scope: str, key: str, text: str, updated_by: str, *, paced: bool = False) -> Any:
        """Store an override typed as ``text``; ``paced``: only if it has updates run no more often than each
        persona's own settings (a server's setting, see :meth:`_check_pace`)."""
        value = self._validated(key, text)
        if paced and key in PACE_KEYS:
            await self._check_pace(scope, key, value, text)
        await self.store.set_setting(scope, key, value, updated_by)
        self._cache.pop(scope, None)
        return value

    def _validated(self, key: str, text: str) -> Any:
        """The value typed as ``text`` for ``key``, as the config would take it (:class:`SettingError` if not)."""
        value = parse_value(key, text)
        try:
            CortexConfig.model_validate(self.defaults.model_dump() | {key: value})
        except ValidationError as exc:
            raise SettingError(f"{key} = {shown(text)} is not accepted: {plain_problem(exc)}") from None
        return value

    async def _model_note(self, key: str, text: str) -> str:
        """For a model being set: :class:`SettingError` when the LLM server rejects a request for it (a wrong name
        made every update of the scope fail, unseen until someone read the runs); why it could not be checked,
        or "" (see bot.llm.probe)."""
        if key != "model" or self.llm is None or not isinstance(model := self._validated(key, text), str):
            return ""
        found = await check_model(self.llm, model)
        if not found.usable:
            raise SettingError(f"{found.note}. Nothing was changed.")
        return found.note

    async def change(self, scope: str, key: str, value: str, *, bot_admin: bool, author: str) -> Change:
        """What a chat command or the web page asks: set ``key`` in ``scope``, or clear it ("default"). Raises
        :class:`NotAllowed` for what the one asking may not change (a server admin's spending or privacy
        switch, also by clearing: the persona-wide or config value then applies; a server's setting that has
        updates run more often than the bot's own, whoever asks), :class:`SettingError`
        for a value the key does not take."""
        check_may_change(key, bot_admin=bot_admin, value=value)
        if value.strip().lower() != "default":
            note = await self._model_note(key, value)
            return Change(stored=await self.set(scope, key, value, author, paced=scope.startswith("server:")),
                          note=note)
        if key in PRIVACY_KEYS and not bot_admin and await self._on_beneath(key):
            raise NotAllowed(_PRIVACY_REFUSAL.format(key=key) + " (and back to the default switches it on here)")
        if key in ("tiers", "frequency") and scope.startswith("server:"):  # the server's other one may decide then
            server = await self.store.settings(scope)
            if problem := _more_tiers(await self._beneath(), {k: v for k, v in server.items() if k != key}):
                raise NotAllowed(f"{key} default would have updates run more often than the bot's own settings "
                                 f"({problem}): this server's {'frequency' if key == 'tiers' else 'tiers'} would "
                                 "decide. Make that rarer first.")
        return Change(cleared=await self.clear(scope, key))

    async def _check_pace(self, scope: str, key: str, value: Any, typed: str) -> None:
        """Raise :class:`NotAllowed` when a server's ``value`` would have updates run more often, for some
        persona, than that persona's own settings beneath the server (the config's, with its persona-wide
        overrides): an admin of one server (on Matrix, whoever makes a room) would otherwise spend the whole
        bot's daily budget on their server. Making updates rarer is always allowed, and so is "default"."""
        beneath = await self._beneath()
        server = await self.store.settings(scope)  # not the cache: another process may have set one a moment ago
        problem = _faster(key, value, beneath, server)
        if problem:
            raise NotAllowed(f"{key} {shown(typed)} would have updates run more often than the bot's own settings "
                             f"({problem}): each update is model calls the bot's operator pays for, so a server's "
                             "settings may make them rarer, not more frequent. For more, a bot admin sets it for the "
                             "persona everywhere (--persona).")

    async def _beneath(self) -> list[CortexConfig]:
        """The settings beneath any server: the config's, and each live persona's with its persona-wide overrides
        (read as :meth:`effective` reads them; a deleted persona's, kept for its revival, bind nobody)."""
        return [self.defaults] + [(await self._layered([scope])).settings for scope in await self._live_overrides()]

    async def _on_beneath(self, key: str) -> bool:
        """Whether clearing a server's override of ``key`` would switch it on there for some persona: the
        config's value, or any live persona's own override (a server's override applies to every persona in it,
        whichever one the command or request named)."""
        if getattr(self.defaults, key) is True:
            return True
        return any(values.get(key) is True for values in (await self._live_overrides()).values())

    async def _live_overrides(self) -> dict[str, dict[str, Any]]:
        """The persona-wide overrides of the personas that exist, by scope (a deleted persona's are kept for its
        revival, and bind nobody meanwhile)."""
        live = {persona_scope(p.name) for p in await self.store.storage.personas.list_personas()}
        return {scope: values for scope, values in (await self.store.persona_overrides()).items() if scope in live}

    async def clear(self, scope: str, key: str) -> bool:
        if key not in OVERRIDABLE:
            raise SettingError(unknown_setting(key))
        self._cache.pop(scope, None)
        return await self.store.clear_setting(scope, key)


def _tier_count(settings: CortexConfig, over: dict[str, Any]) -> int:
    """Updates per cycle for a persona with ``settings`` once a server's overrides ``over`` apply."""
    tiers = over.get("tiers", settings.tiers)
    if isinstance(tiers, list) and tiers:
        return len(tiers)
    frequency = over.get("frequency", settings.frequency)
    return len(FREQUENCY_PRESETS.get(str(frequency), settings.tier_percentages()))


def _faster(key: str, value: Any, beneath: list[CortexConfig], server: dict[str, Any]) -> str:
    """Why ``value`` for ``key`` at a server would make updates more frequent than some persona's own settings
    in ``beneath`` (given the server's other overrides), or "" when it does not: the rule of
    :func:`_faster_keys`, which reading the settings applies, said with the least value allowed."""
    over = [s for s in beneath if key in _faster_keys(server | {key: value}, s)]
    if not over:
        return ""
    if key == "enabled":
        return "updates are off bot-wide or for a persona"
    if key in ("context_limit", "cooldown_seconds"):
        unit = " messages per cycle" if key == "context_limit" else " seconds"
        return f"{key} at least {max(getattr(s, key) for s in over):.10g}{unit}"
    return _more_tiers(over, server | {key: value})


def _more_tiers(beneath: list[CortexConfig], server: dict[str, Any]) -> str:
    """Why a server's overrides ``server`` would give some persona in ``beneath`` more tiers per cycle than its
    own settings do, or "" when they do not."""
    allowed = [len(s.tier_percentages()) for s in beneath]
    over = [n for s, n in zip(beneath, allowed, strict=True) if _tier_count(s, server) > n]
    if not over:
        return ""
    most = min(over)
    return f"at most {most} tier{'s' if most != 1 else ''} per cycle here"


def _faster_keys(server: dict[str, Any], below: CortexConfig) -> frozenset[str]:
    """The keys of a server's overrides ``server`` that would have updates run more often than ``below`` (the
    persona's own settings) does: left out when the server's settings are read."""
    faster: set[str] = set()
    if server.get("enabled") is True and not below.enabled:
        faster.add("enabled")
    for key in ("context_limit", "cooldown_seconds"):
        value = server.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value < getattr(below, key):
            faster.add(key)
    if _more_tiers([below], {k: v for k, v in server.items() if k in ("tiers", "frequency")}):
        faster.update({"tiers", "frequency"})
    return frozenset(faster)
