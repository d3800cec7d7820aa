"""``cortexbot doctor``'s look at the chat platforms: is the server there, and does it take the bot's credentials?

Each check asks what the bot would ask at start, without changing anything on the server: Discord's ``GET
/users/@me`` with the bot token; a Matrix homeserver's ``/versions``, then ``whoami`` with the access token (the
configured one, or the session a password login saved). A password alone is not tried: a login makes a new
device on the account, so it is checked at the bot's first start, which saves the session for the next doctor.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp
import discord

from adapters.discord import read_token, test_api_base
from adapters.matrix import MatrixError, read_secrets, saved_session, store_dir
from adapters.reachable import TIMEOUT, UNREACHABLE, why
from bot.config import DiscordConfig, MatrixConfig


async def discord_login(config: DiscordConfig, environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether Discord takes the bot token, and as whom (or what is wrong)."""
    try:
        token = read_token(config)
    except RuntimeError as exc:
        return False, str(exc)
    base = test_api_base(environ) or discord.http.Route.BASE
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session, \
                session.get(f"{base}/users/@me", headers={"Authorization": f"Bot {token}"}) as response:
            if response.status == 401:
                return False, (f"Discord rejected the bot token in ${config.token_env}: copy it again from the "
                               "developer portal (Bot → Reset Token)")
            if response.status >= 400:
                return False, f"Discord answered HTTP {response.status} to the bot token's check"
            try:
                me = await response.json(content_type=None)
            except ValueError:  # (not JSON: a proxy's or a captive portal's page)
                me = None
    except UNREACHABLE as exc:
        return False, f"cannot reach {base} ({why(exc)}); a bot started now waits until it can"
    if not isinstance(me, dict) or "id" not in me:
        return False, (f"{base} answered the bot token's check with something other than Discord's answer (a proxy "
                       "in between?)")
    return True, f"bot token from ${config.token_env} signs in as {me.get('username')} (id {me.get('id')})"


async def matrix_login(config: MatrixConfig, environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether the homeserver answers and takes what the bot would sign in with (see the module's description),
    in the bot's order: the session a password login saved, while it is signed in; else the access token; else
    the password."""
    try:
        _password, token = read_secrets(config, environ)
    except MatrixError as exc:
        return False, str(exc)
    server = config.homeserver.rstrip("/")
    tokens = [(where, value) for where, value in (
        ("the saved session", str(saved_session(store_dir(config), config.user_id).get("access_token") or "")),
        (f"${config.access_token_env}", token)) if value]
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.get(f"{server}/_matrix/client/versions") as response:
                if response.status >= 400:
                    return False, (f"the homeserver at {server} answered HTTP {response.status}: check [matrix] "
                                   "homeserver")
            signed_out = False
            for where, value in tokens:
                status, who = await _whoami(session, server, value)
                if status == 401 and where == "the saved session":
                    signed_out = True  # (since: the bot drops it and signs in with what comes next)
                    continue
                return _whoami_verdict(config, where, status, who)
    except UNREACHABLE as exc:
        return False, f"cannot reach the homeserver at {server} ({why(exc)}): check [matrix] homeserver"
    if signed_out:  # (and no access token: read_secrets found the password)
        return True, "the saved session was signed out; the password logs in anew at start"
    return True, (f"the homeserver answers; password from ${config.password_env} for {config.user_id} "
                  "(checked at the bot's first start: a login makes a device)")


async def _whoami(session: aiohttp.ClientSession, server: str, token: str) -> tuple[int, Mapping[str, object]]:
    async with session.get(f"{server}/_matrix/client/v3/account/whoami",
                           headers={"Authorization": f"Bearer {token}"}) as response:
        try:
            who = await response.json(content_type=None) if response.status == 200 else {}
        except ValueError:  # (not JSON: a proxy's page)
            return 502, {}
        return response.status, who if isinstance(who, dict) else {}


def _whoami_verdict(config: MatrixConfig, where: str, status: int, who: Mapping[str, object]) -> tuple[bool, str]:
    if status == 401:
        return False, f"the homeserver rejected the access token in {where}"
    if status != 200:
        return False, f"the homeserver answered HTTP {status} to the access token's check"
    if who.get("user_id") != config.user_id:
        return False, f"the access token in {where} belongs to {who.get('user_id')}, not {config.user_id}"
    return True, f"the access token in {where} signs in as {config.user_id}"
