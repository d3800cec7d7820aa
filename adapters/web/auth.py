"""Login by a single-use link, sessions in a cookie, CSRF and origin checks, and who may do what.

A ``!dashboard`` link opens a small page whose button posts the token back: chat platforms fetch links
to show previews, and a GET that used the link up would lock its owner out. The session cookie is
HttpOnly and SameSite=Strict (and Secure, with the ``__Host-`` prefix, when the public URL is https).
Every change (POST, PUT, PATCH, DELETE) must carry the session's CSRF token in ``X-CSRF-Token`` and,
when the browser sends an Origin, come from the page's own origin. The page names the user it shows in
``X-Cortex-User`` on every request, reads included: a request of a page whose browser has since logged in
as someone else is refused.
"""

from __future__ import annotations

import hmac
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from aiohttp import web

from adapters.matrix_content import home_server
from adapters.web.errors import fail
from bot.config import Config
from bot.policy import user_refusal
from bot.ports import AdminDirectory, LookupsSpent, ServerRef
from bot.ratelimit import FleetRateLimiter, RateLimiter
from bot.storage.web import WebLoginRepository, WebSession

log = logging.getLogger(__name__)

CHANGES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CSRF_HEADER = "X-CSRF-Token"
USER_HEADER = "X-Cortex-User"  # the user the page shows, percent-encoded (a key may hold any character)
OTHER_USER = ("this page shows another user than the one this browser is now logged in as (a login in another "
              "tab): reload the page")


def cookie_name(secure: bool) -> str:
    return "__Host-cortexbot" if secure else "cortexbot_session"


def is_bot_admin(config: Config, user_key: str) -> bool:
    """A configured admin id of a chat platform, or the terminal's user (who runs the bot) unless ``[access]``
    leaves them out: a ``console:NAME`` the lists refuse is no one's admin on the page."""
    platform, _, user_id = user_key.partition(":")
    if platform == "console":
        return user_refusal(config.access, user_key) is None
    if platform == "discord":
        return user_id.isdigit() and int(user_id) in config.discord.admin_ids
    if platform == "matrix":
        return user_id in config.matrix.admin_ids
    return False


def home_server_key(user_key: str) -> str | None:
    """The home server of a Matrix user (``matrix:@ann:example.org`` → ``matrix:example.org``), which the
    chat's access lists see as the author's server; None on platforms without one."""
    platform, _, user_id = user_key.partition(":")
    if platform != "matrix" or ":" not in user_id:
        return None
    return f"matrix:{home_server(user_id)}"


def access_refusal(config: Config, user_key: str) -> str | None:
    """Why ``[access]`` keeps this user off the page as it does in chat (the deny list always wins, a
    non-empty allow list lets in only those on it; a denied Matrix home server keeps out its users), or
    None. Checked on every request, so a session opened before the user was listed ends there. A
    ``console:NAME`` is held to the lists here too: only the terminal itself applies none (whoever runs it runs
    the bot), and a link it made for a listed name opens no page."""
    reason = user_refusal(config.access, user_key)
    if reason == "denied user":
        return "the bot's operator has denied you access ([access] deny_users): this page is closed to you"
    home = home_server_key(user_key)
    if home is not None and home in config.access.deny_servers:
        return "the bot's operator has denied your home server ([access] deny_servers): this page is closed to you"
    if reason is not None:
        return "the bot's operator has not allowed you access ([access] allow_users): this page is closed to you"
    return None


def csrf_matches(sent: str, expected: str) -> bool:
    """In constant time. A header's bytes that are not UTF-8 arrive as surrogate escapes, which no token
    holds (and a plain ``str.encode`` refuses): they never match."""
    return hmac.compare_digest(sent.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def origin_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent this request (from a valid session) and the session's id."""

    session_id: str
    session: WebSession

    @property
    def user_key(self) -> str:
        return self.session.user_key


class Auth:
    def __init__(self, config: Config, logins: WebLoginRepository, directories: Sequence[AdminDirectory],
                 limiter: FleetRateLimiter | None = None) -> None:
        self.config = config
        self.logins = logins
        self.directories = {d.platform: d for d in directories}
        self.cookie = cookie_name(config.web.secure_cookies)
        # Changes count against the same per-user limit as chat commands: a page script must not write
        # thousands of versions a minute where a chat could not.
        self.limiter = limiter or FleetRateLimiter(config.chat.command_rate_limit_per_minute)
        # Views that cost the bot's CPU (a file's HTML, a diff, a search's embedding): a script asking for them
        # without pause slowed every user's replies from milliseconds to seconds.
        self.views = RateLimiter(config.web.views_per_minute)

    async def caller(self, request: web.Request) -> Caller | None:
        session_id = request.cookies.get(self.cookie, "")
        if not session_id or len(session_id) > 200:
            return None
        session = await self.logins.session(session_id)
        return None if session is None else Caller(session_id, session)

    async def require(self, request: web.Request, *, costly: bool = False, limited: bool = True,
                      view: bool = False) -> Caller:
        """The logged-in caller; a 401 without a valid session, a 403 for a change without its CSRF token
        or from another origin. Changes, and reads that are ``costly`` (an export builds a zip of everything),
        count against the per-user limit (429 beyond it) unless not ``limited`` (logging out always works);
        a ``view`` (a file's HTML, a diff, a search) against the per-user limit of views. A 409 when the request
        names another user than the session's (:meth:`check_user`)."""
        caller = await self.caller(request)
        if caller is None:
            fail(401, "not logged in (or the session ended): send !dashboard in a chat for a new link")
        self.check_user(request, caller)  # (first: an access refusal of the other user is not this page's)
        refused = access_refusal(self.config, caller.user_key)
        if refused is not None:  # the session ends here: lifting the deny later must not bring it back
            await self.logins.end_sessions(caller.user_key)
            fail(403, f"{refused} (your sessions on it have ended)")
        if request.method in CHANGES:
            self.check_origin(request)
            if not csrf_matches(request.headers.get(CSRF_HEADER, ""), caller.session.csrf):
                # (the page reads the code: a login in another tab of the browser gave the session a new token)
                fail(403, f"missing or wrong {CSRF_HEADER} header (reload the page)", code="csrf")
        if limited and (request.method in CHANGES or costly) and (wait := await self.limiter.check(caller.user_key)):
            fail(429, f"too many changes or exports in a minute (at most {self.limiter.per_minute}): try again "
                      f"in {math.ceil(wait)} s")
        if view:
            self.count_view(caller)
        return caller

    async def end_refused(self) -> int:
        """End the sessions and unused links of every user ``[access]`` now keeps off the page (at start: a
        session left unused while its user was denied would open again once the deny is lifted); how many
        users'."""
        users = [key for key in await self.logins.session_users() if access_refusal(self.config, key) is not None]
        for key in users:
            await self.logins.end_sessions(key)
        return len(users)

    @staticmethod
    def check_user(request: web.Request, caller: Caller) -> None:
        """A 409 (code ``other_user``) when the request names in ``X-Cortex-User`` another user than the session's.
        A login in another tab of the browser gives the one session cookie to someone else; reads carry no CSRF
        token, so without this an open page went on showing that person's memory and export under its own
        user's name. A request without the header (an API client, curl) is whoever its session is."""
        named = request.headers.get(USER_HEADER)
        if named is not None and unquote(named) != caller.user_key:
            fail(409, OTHER_USER, code="other_user")

    def count_view(self, caller: Caller) -> None:
        """Count a view that costs the bot's CPU against the caller's limit of views (429 beyond it)."""
        if wait := self.views.check(caller.user_key):
            fail(429, f"too many file views, diffs or searches in a minute (at most {self.views.per_minute}): try "
                      f"again in {math.ceil(wait)} s")

    def check_origin(self, request: web.Request) -> None:
        if not self.from_page(request):
            fail(403, "requests to the page must come from the page itself")

    def from_page(self, request: web.Request) -> bool:
        """Whether ``request`` came from the page itself, by its ``Origin``."""
        origin = request.headers.get("Origin")
        if origin is None:
            return True  # not a browser (or an old one): the CSRF token still has to match
        page = origin_of(self.config.web.base_url)
        allowed = {page}
        if page.startswith(f"{request.scheme}://"):  # behind an https page's proxy, plain http is not the page
            allowed.add(f"{request.scheme}://{request.host}".lower())
        return origin.lower() in allowed

    def set_cookie(self, response: web.StreamResponse, session_id: str, max_age: float) -> None:
        response.set_cookie(self.cookie, session_id, max_age=int(max_age), path="/", httponly=True,
                            samesite="Strict", secure=self.config.web.secure_cookies)

    def clear_cookie(self, response: web.StreamResponse) -> None:
        # With the same attributes as when it was set: a browser ignores a __Host- cookie without Secure, so
        # a deletion lacking it would leave the (dead) cookie in place.
        response.del_cookie(self.cookie, path="/", secure=self.config.web.secure_cookies, httponly=True,
                            samesite="Strict")

    # -- permissions -----------------------------------------------------------------------------

    async def servers(self, user_key: str) -> list[ServerRef]:
        """The servers ``user_key`` administers, from every platform that can tell; one that fails right now
        (its network) lists none, so the page still opens."""
        found: list[ServerRef] = []
        for directory in self.directories.values():
            try:
                found += await directory.servers(user_key)
            except Exception:
                log.exception("the %s directory could not list the servers of a user", directory.platform)
        return found

    def is_bot_admin(self, caller: Caller) -> bool:
        return is_bot_admin(self.config, caller.user_key)

    async def is_server_admin(self, caller: Caller, server_key: str) -> bool:
        """Asked live on every request, as the chat commands check the platform's permissions each time."""
        if self.is_bot_admin(caller):
            return True
        directory = self.directories.get(server_key.partition(":")[0])
        if directory is None or caller.user_key.partition(":")[0] != directory.platform:
            return False
        try:
            return await directory.is_admin(caller.user_key, server_key)
        except LookupsSpent as exc:  # (neither yes nor no: said so, not a 403)
            fail(429, f"too many servers of other bot processes asked about in a minute: try again in "
                      f"{math.ceil(exc.wait)} s")

    async def require_bot_admin(self, request: web.Request) -> Caller:
        caller = await self.require(request)
        if not self.is_bot_admin(caller):
            fail(403, "only the bot's admins may see or change this")
        return caller

    async def require_server_admin(self, request: web.Request, server_key: str) -> Caller:
        caller = await self.require(request)
        if not await self.is_server_admin(caller, server_key):
            fail(403, "only that server's admins may see or change this")
        return caller
