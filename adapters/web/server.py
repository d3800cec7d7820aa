"""The web server: an aiohttp application in the bot's own event loop, beside the chat adapters.

aiohttp because discord.py already depends on it (one HTTP stack in the process, no second server
framework) and its server side is mature: AppRunner sites, middlewares, a request body cap.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, InvalidURLError, TransferEncodingError
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel, ValidationError

from adapters.web.auth import Auth
from adapters.web.errors import GONE, ApiError, error_page, fail, json_error
from adapters.web.hosts import HOSTS, HostCheck, allowed_hosts, checked_host, warn_if_unchecked
from adapters.web.render import HtmlRenderer, markdown_html
from bot.ports import AdminDirectory
from bot.storage.engine import is_missing_reference

if TYPE_CHECKING:
    from bot.app import App

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_BODY = web.AppKey("max_body", int)
PAGES = web.AppKey("pages", bool)  # errors outside the API as the site's pages
SURROGATE = re.compile(r"[\ud800-\udfff]")
LOGIN_TOKEN = re.compile(r"/login/[^/?#]+", re.IGNORECASE)
# What reading a malformed body raises: a broken multipart header, a Content-Encoding the body does not
# match (gzip that is not gzip). The client's fault: a 400, never a 500.
UNREADABLE_BODY = (HttpProcessingError, RequestPayloadError)
CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; object-src 'none'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'self'")


@dataclass
class WebContext:
    """What every route module works with: the running bot's services and the authorisation."""

    app: App
    auth: Auth
    adapters: Mapping[str, Callable[[], bool]] = field(default_factory=dict)  # name -> connected?
    renderer: HtmlRenderer = field(default_factory=lambda: HtmlRenderer(markdown_html))  # files' HTML, as kept


def ok(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda v: json.dumps(v, ensure_ascii=False, default=str))


async def read_body(request: web.Request, model: type[M]) -> M:
    """The request's JSON body as ``model``: a 400 when it is not JSON, a 422 naming the first bad field,
    a 413 when it is larger than ``[web] max_body_kb``."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        fail(413, f"the request body is too large (at most {request.app[MAX_BODY]:,} bytes)")
    except UNREADABLE_BODY:
        fail(400, "the request body could not be read (a Content-Encoding it does not have?)")
    try:
        data = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError):
        fail(400, "the request body is not valid JSON")
    except RecursionError:
        fail(400, "the request body is nested too deeply")
    if not isinstance(data, dict):
        fail(400, "the request body must be a JSON object")
    if not storable(data):
        fail(422, "text may not hold NUL characters or unpaired surrogates (\\u0000, \\ud800)")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        fail(422, f"{where}: {first['msg']}")


def storable(data: Any) -> bool:
    """Whether every string in the parsed JSON (keys too) can be stored: PostgreSQL refuses NUL in text and
    no engine takes an unpaired surrogate (JSON allows both as escapes). Iterative: depth costs no stack."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value or SURROGATE.search(value):
                return False
        elif isinstance(value, dict):
            stack += value.keys()
            stack += value.values()
        elif isinstance(value, list):
            stack += value
    return True


def loggable_path(path: str) -> str:
    """``path`` for the log: a login link's token is a live credential and never written there."""
    return LOGIN_TOKEN.sub("/login/<token>", path)


LOGIN_TOKEN_IN_TEXT = re.compile(r"/login/[^/?#\s'\"]+", re.IGNORECASE)  # ends where a quoted request line does


# Where aiohttp's words about a request it could not parse end and its quote of the request begins: the repr of
# bytes, a bytearray or a string (``b'…'``, ``bytearray(b'…')``, ``'…'``), or whatever follows "reason: ".
QUOTE_STARTS = re.compile(r""":\s|(?:\bbytearray\(|\bb)?['"]""")
# aiohttp's errors whose whole message may be the request's own bytes, unquoted (a URL it could not read, a
# chunk's size line): only their kind is said. (The C parser's form, "reason:" and the quote on lines below,
# is multi-line; a line of a request never is.)
BARE_QUOTES = (InvalidURLError, TransferEncodingError)


def malformed_detail(exc: HttpProcessingError) -> str:
    """What was wrong with a request aiohttp could not parse, in aiohttp's words up to where it quotes the
    request (a session cookie, a login link's token, a query string); the error's kind when none are left."""
    lines = [line.strip() for line in str(exc.message).splitlines() if line.strip()]
    if not lines or (isinstance(exc, BARE_QUOTES) and len(lines) == 1):
        return type(exc).__name__
    said = QUOTE_STARTS.split(lines[0], maxsplit=1)[0].rstrip(" :.")
    return said or type(exc).__name__


class MalformedRequests(logging.Filter):
    """aiohttp logs every request it cannot parse at ERROR, with a traceback that quotes the raw line it failed
    on: a login link's token or a session cookie with it, and ten lines per request for anyone who sends garbage.
    Such a request is the client's fault (it got its 400): one line at INFO saying what was wrong, with nothing
    of the request's own bytes (:func:`malformed_detail`) and no traceback. Any other record of the logger keeps
    its level, login tokens hidden."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "malformed request (%s): %s", (record.getMessage(), malformed_detail(exc))
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        message = record.getMessage()
        hidden = LOGIN_TOKEN_IN_TEXT.sub("/login/<token>", message)
        if hidden != message:
            record.msg, record.args = hidden, ()
        return True


def quiet_malformed_requests() -> None:
    """Install :class:`MalformedRequests` on aiohttp's server logger (once)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequests) for f in logger.filters):
        logger.addFilter(MalformedRequests())


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bad input is a 4xx with a JSON message; nothing a client sends produces a 500 with a traceback."""
    api = request.path.startswith("/api/")
    if api and ("\x00" in request.path or any("\x00" in k or "\x00" in v for k, v in request.query.items())):
        return json_error(400, "the address holds a NUL character")
    try:
        return await handler(request)
    except ApiError as exc:
        if api or not request.app.get(PAGES, True):
            return json_error(exc.status, exc.message, exc.code)
        return error_page(exc.status, exc.message[0].upper() + exc.message[1:])  # (a browser's form post)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if api:
            answer = json_error(exc.status, exc.reason)
        elif request.app.get(PAGES, True):
            answer = error_page(exc.status, exc.reason)
        else:
            answer = web.Response(status=exc.status, text=f"{exc.status}: {exc.reason}")
        if "Allow" in exc.headers:  # a 405 says which methods would do
            answer.headers["Allow"] = exc.headers["Allow"]
        return answer
    except UNREADABLE_BODY:
        if api:
            return json_error(400, "the request body could not be read")
        return web.Response(status=400, text="The request could not be read.")
    except Exception as exc:
        if is_missing_reference(exc):  # e.g. a forget-me removed the user while this request wrote for them
            log.warning("web request %s %s met a deleted row (a forget-me meanwhile?): %s", request.method,
                        loggable_path(request.path), type(exc).__name__)
            status, message = 409, GONE
        else:
            log.exception("web request %s %s failed", request.method, loggable_path(request.path))
            status, message = 500, "internal error (the details are in the bot's log)"
        if api or not request.app.get(PAGES, True):  # (the metrics listener shows no pages)
            return json_error(status, message)
        return error_page(status, message[0].upper() + message[1:])


async def security_headers(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """On every response as it is sent (``on_response_prepare``): the handlers' own and the errors aiohttp
    makes of an HTTPException (a 404, 405 or 413 outside the API) alike."""
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    # A login link never leaks to another site as a Referer; same-origin (not no-referrer) because under
    # no-referrer Chromium sends "Origin: null" with the login form, which the origin check must refuse.
    response.headers.setdefault("Referrer-Policy", "same-origin")
    response.headers.setdefault("X-Frame-Options", "DENY")
    if request.path.startswith(("/api/", "/login")):
        response.headers.setdefault("Cache-Control", "no-store")


def web_application(*, pages: bool = True, hosts: frozenset[str] | None = None, **kwargs: Any) -> web.Application:
    """An application with the error middleware, the Host check and the security headers on every response;
    ``pages``: errors outside the API are the site's small pages (not on the metrics port, which has no site);
    ``hosts``: the names it answers to (None: any)."""
    application = web.Application(middlewares=[errors, checked_host], **kwargs)
    application[PAGES] = pages
    application[HOSTS] = HostCheck(hosts)
    application.on_response_prepare.append(security_headers)
    return application


def static_file(name: str) -> bytes:
    return resources.files("adapters.web").joinpath("static", name).read_bytes()


class WebServer:
    """Serves the page, the API, /healthz and /metrics on ``[web] host:port`` (and /metrics alone on
    ``metrics_host:metrics_port`` when set), each to requests whose Host header names it (``adapters.web.hosts``)."""

    def __init__(self, app: App, *, directories: Sequence[AdminDirectory] = (),
                 adapters: Mapping[str, Callable[[], bool]] | None = None) -> None:
        self.config = app.config.web
        self.context = WebContext(app, Auth(app.config, app.storage.web, directories, app.router.command_limiter),
                                  dict(adapters or {}))
        app.cortex.commands.on_forget.append(self.context.renderer.forget)  # (a forget-me sent in a chat too)
        self._runners: list[web.AppRunner] = []
        self.url = ""
        self.metrics_url = ""

    def build(self) -> web.Application:
        from adapters.web import api_activity, api_admin, api_items, api_me, health, login, page

        max_body = self.config.max_body_kb * 1024
        application = web_application(client_max_size=max_body, hosts=allowed_hosts(self.config, self.config.host))
        application[MAX_BODY] = max_body
        for module in (login, page, api_me, api_items, api_activity, api_admin):
            application.add_routes(module.routes(self.context))
        application.add_routes(health.routes(self.context, metrics=self.config.metrics and not self._separate_metrics))
        return application

    @property
    def _separate_metrics(self) -> bool:
        return self.config.metrics and (self.config.metrics_port is not None or bool(self.config.metrics_host))

    async def start(self) -> None:
        from adapters.web import health

        warn_if_unchecked(self.config)
        if ended := await self.context.auth.end_refused():
            log.info("ended the web sessions of %d user(s) [access] now denies", ended)
        self.url = await self._serve(self.build(), self.config.host, self.config.port)
        self.config.listening_on(self.url)  # with port 0, the port chosen: the login links point there
        if self._separate_metrics:
            metrics_host = self.config.metrics_host or self.config.host
            metrics_app = web_application(pages=False, hosts=allowed_hosts(self.config, self.config.host, metrics_host))
            metrics_app.add_routes(health.metrics_routes(self.context))
            self.metrics_url = await self._serve(metrics_app, metrics_host, self.config.metrics_port or 0,
                                                 what="/metrics", keys="metrics_host/metrics_port")
            log.info("metrics at %s/metrics", self.metrics_url)
        log.info("web page at %s (listening on %s)", self.config.public_url or self.url, self.url)
        if self.config.links_unreachable:
            log.warning("[web] host %r listens on every address and [web] public_url is not set: !dashboard's login "
                        "links name %s, which no browser opens; set public_url to the address people open the page "
                        "at", self.config.host, self.url)

    async def _serve(self, application: web.Application, host: str, port: int, *, what: str = "the web page",
                     keys: str = "host/port") -> str:
        quiet_malformed_requests()
        runner = web.AppRunner(application, access_log=None)
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await self.stop()
            raise RuntimeError(f"{what} cannot listen on {host}:{port}: {exc.strerror or exc} "
                               f"(change [web] {keys})") from None
        sockets = getattr(site._server, "sockets", None) or []
        bound = sockets[0].getsockname()[1] if sockets else port
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{bound}"

    async def stop(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
