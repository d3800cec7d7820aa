"""HTTP skills: an endpoint declared in ``[[skills.http]]`` that the persona may call as a tool.

The model's arguments are checked against the entry's JSON schema, put into the URL template
(``{name}`` is replaced by the URL-quoted value), and the rest go out as query parameters (GET, DELETE)
or as a JSON body (POST, PUT, PATCH). Secret headers come from the environment, read once when the
skill is built; their values never appear in a result or a log line (a server that echoes them back
gets them redacted). Only the host written in the skill's ``url`` may be an internal address (loopback,
private, link-local such as 169.254.169.254): the admin named it. Any other host - a redirect's, or one the
model's arguments shaped - must resolve to public addresses only, checked where the connection is made.
Every failure - bad arguments, a timeout, an HTTP error status, a response larger
than ``max_response_bytes`` (never read in full), a host that is down - is a :class:`SkillResult` with
``is_error`` set, never an exception.
"""

from __future__ import annotations

import asyncio
import codecs
import ipaddress
import json
import logging
import re
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from jsonschema import exceptions as schema_errors
from jsonschema import validators
from yarl import URL

from bot.config import URL_PLACEHOLDER, HttpSkillConfig, shown_url
from cortex.skills.base import (
    SkillContext,
    SkillFailure,
    SkillInfo,
    SkillResult,
    from_environment,
    redact,
    redact_cut,
    redaction_values,
)

log = logging.getLogger(__name__)

MAX_REDIRECTS = 3  # redirects followed (aiohttp's max_redirects counts the first response too)
ERROR_BODY_CHARS = 300
_ERROR_BODY_BYTES = 4 * ERROR_BODY_CHARS + 4  # enough for 300 characters of UTF-8
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_MAX_SCHEMA_ERRORS = 5

SessionFactory = Callable[[], aiohttp.ClientSession]


class CallFailure(SkillFailure):
    """A failed call: its message, for the model and the audit, may quote the arguments (the person's words) and
    the server's answer; ``kind`` says what failed in the config's words alone (a field, a status code), for the
    log, which outlives a forget-me and an incognito pause."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class HttpSkill:
    """One ``[[skills.http]]`` entry as a skill. Owns one :class:`aiohttp.ClientSession`, made on the
    first call (by ``session_factory`` if given, else one without a cookie jar); :meth:`aclose` closes it."""

    def __init__(self, config: HttpSkillConfig, session_factory: SessionFactory | None = None) -> None:
        _check_template(config)
        self._config = config
        self._validator = _schema_validator(config)
        self._secret_headers = from_environment(config.headers_env, f"[[skills.http]] {config.name!r}", "header")
        self._redact_values = redaction_values(tuple(self._secret_headers.values()))
        self._session_factory = session_factory
        self._session: aiohttp.ClientSession | None = None
        self._trusted = trusted_origin(config.url, config.allow_internal)
        self._info = SkillInfo(
            name=config.name,
            description=config.description,
            input_schema=config.parameters,
            origin="http",
            admin_only=config.admin_only,
            triggers=tuple(config.triggers),
            secrets=tuple(self._secret_headers.values()),
        )

    @property
    def info(self) -> SkillInfo:
        return self._info

    async def run(self, arguments: dict[str, Any], context: SkillContext) -> SkillResult:
        """Call the endpoint with ``arguments``; the answer (or what went wrong) is the result."""
        try:
            self._validate(arguments)
            url, rest = fill_template(self._config.url, arguments)
            _check_scheme(url)
            content = await self._request(url, rest)
        except SkillFailure as failure:
            log.info("http skill %s failed: %s", self._config.name,
                     failure.kind if isinstance(failure, CallFailure) else "failed")
            return SkillResult(self._redact(str(failure)), is_error=True)
        return SkillResult(self._redact(content))

    async def aclose(self) -> None:
        """Close the session (if one was made); a later call makes a new one."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    def _validate(self, arguments: dict[str, Any]) -> None:
        if not isinstance(arguments, dict):
            raise CallFailure("invalid arguments: expected a JSON object", "invalid arguments (no JSON object)")
        errors = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
        if errors := errors[:_MAX_SCHEMA_ERRORS]:
            raise CallFailure("invalid arguments: " + "; ".join(_describe(e) for e in errors),
                              f"invalid arguments ({', '.join(_rule_broken(e) for e in errors)})")

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = self._session_factory() if self._session_factory else _new_session(self._trusted)
        return self._session

    async def _request(self, url: str, rest: dict[str, Any]) -> str:
        config = self._config
        headers = {**config.headers, **self._secret_headers}
        # A redirect could carry a secret header to another host: skills with secrets follow none.
        follow = not self._secret_headers
        options: dict[str, Any] = {"headers": headers, "allow_redirects": follow, "max_redirects": MAX_REDIRECTS + 1,
                                   "timeout": aiohttp.ClientTimeout(total=config.timeout_seconds),
                                   "middlewares": (self._guard,)}
        if config.method in _BODY_METHODS:
            options["json"] = rest
        elif rest:
            options["params"] = query_params(rest)
        # (the URL as written: filled, it holds their words; without its query, which may hold the API's key)
        log.debug("http skill %s: %s %s", config.name, config.method, shown_url(config.url))
        try:
            async with self._session_now().request(config.method, url, **options) as response:
                if not follow and 300 <= response.status < 400:
                    raise CallFailure(f"the server answered with a redirect ({response.status}); a skill with secret "
                                      "headers follows no redirects, so that they never reach another host",
                                      f"a redirect refused (HTTP {response.status})")
                return await self._answer(response)
        except TimeoutError as exc:
            timeout = f"timed out after {config.timeout_seconds:g} s"
            raise CallFailure(f"the request {timeout}", timeout) from exc
        except aiohttp.TooManyRedirects as exc:
            raise CallFailure(f"too many redirects (more than {MAX_REDIRECTS})", "too many redirects") from exc
        except aiohttp.ClientConnectorError as exc:  # (the host may be one the arguments made)
            raise CallFailure(f"could not connect to {exc.host}:{exc.port} ({_os_reason(exc)})",
                              "unreachable") from exc
        except (aiohttp.ClientError, ValueError) as exc:
            raise CallFailure(f"the request failed: {type(exc).__name__}: {exc}",
                              f"the request failed ({type(exc).__name__})") from exc

    async def _answer(self, response: aiohttp.ClientResponse) -> str:
        if response.status >= 400:
            body = (await read_limited(response, _ERROR_BODY_BYTES)).decode(_charset(response), errors="replace")
            excerpt = redact_cut(body, self._redact_values, ERROR_BODY_CHARS) or "(empty body)"
            raise CallFailure(f"the server answered HTTP {response.status} {response.reason or ''}".rstrip()
                              + f": {excerpt}", f"HTTP {response.status}")
        limit = self._config.max_response_bytes
        if response.content_length is not None and response.content_length > limit:
            raise CallFailure(_too_large(response.content_length, limit), "response too large")
        raw = await read_limited(response, limit + 1)
        if len(raw) > limit:
            raise CallFailure(_too_large(None, limit), "response too large")
        if not raw:
            return f"(empty response, HTTP {response.status})"
        return extract(raw.decode(_charset(response), errors="replace"), _is_json(response), self._config.result_path)

    async def _guard(self, request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
                     ) -> aiohttp.ClientResponse:
        """Every request, the first and each redirect's: an address written as the host must be public unless
        it is the skill's own host and port (a name is checked as it resolves, by :class:`PublicOnlyResolver`)."""
        host = request.url.raw_host or ""
        if not _trusted_at(host, request.url.port, self._trusted) and _is_ip(host) and not _public(host):
            raise CallFailure(_internal(host), "an internal address refused")
        return await handler(request)

    def _redact(self, text: str) -> str:
        return redact(text, self._redact_values)


def _new_session(trusted: tuple[str, int] | None = None) -> aiohttp.ClientSession:
    # No cookie jar: the session serves every user, so one user's cookies must not reach another's call.
    connector = aiohttp.TCPConnector(resolver=PublicOnlyResolver(trusted))
    return aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), connector=connector)


def trusted_host(template: str, allow_internal: bool = False) -> str | None:
    """The host the skill's author wrote in its url, when it may be an internal address: written as one (an IP
    address, localhost) or named with ``allow_internal``. None otherwise, and when a placeholder is part of it
    (then the model's arguments choose the host, and it is trusted no more than a redirect's). A public name
    is not trusted by its name: whoever runs its DNS could point it at this machine or a cloud's metadata
    service."""
    try:
        netloc = urlsplit(template).netloc
        host = None if URL_PLACEHOLDER.search(netloc) else URL(template).raw_host
    except ValueError:
        return None
    if host is None:
        return None
    written = host.casefold().rstrip(".")
    return host if allow_internal or _is_ip(host) or written == "localhost" or written.endswith(".localhost") \
        else None


def trusted_origin(template: str, allow_internal: bool = False) -> tuple[str, int] | None:
    """:func:`trusted_host` with the port the url names (or its scheme's): a redirect from the skill's own
    service to another port of that machine (its admin API, the bot's /metrics) is not the service."""
    host = trusted_host(template, allow_internal)
    port = URL(template).port if host is not None else None
    return None if host is None or port is None else (host, port)


async def needs_allow_internal(config: HttpSkillConfig, timeout: float = 5.0) -> str | None:
    """For `cortexbot doctor`: why every call of the skill would be refused, when its url names a host (no
    placeholder in it) that resolves to internal addresses only and the config does not allow it; None
    otherwise (also when the name does not resolve here: the call says so)."""
    host = trusted_host(config.url, True)  # (the host written in the url, any kind)
    if host is None or trusted_host(config.url, config.allow_internal) is not None:
        return None
    try:
        found = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None), timeout)
    except (OSError, TimeoutError):
        return None
    addresses = sorted({str(info[4][0]) for info in found})
    if not addresses or any(_public(address) for address in addresses):
        return None
    return (f"{host} resolves to {', '.join(addresses[:3])}, not a public address: every call is refused. If the "
            "service is inside your network, set allow_internal = true in its [[skills.http]] entry")


class PublicOnlyResolver(AbstractResolver):
    """Resolves as aiohttp does, but a host and port other than ``trusted`` get public addresses only (none:
    refused): a redirect, or a host the model's arguments made, never reaches the bot's own machine, its
    network or a cloud's metadata service (169.254.169.254). Checked on the addresses connected to, so a
    name that resolves differently the second time (DNS rebinding) gains nothing."""

    def __init__(self, trusted: tuple[str, int] | None) -> None:
        self._trusted = trusted
        self._inner = aiohttp.DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        if _trusted_at(host, port, self._trusted):
            return found
        public = [address for address in found if _public(address["host"])]
        if not public:
            raise OSError(_internal(host))
        return public

    async def close(self) -> None:
        await self._inner.close()


def _trusted_at(host: str, port: int | None, trusted: tuple[str, int] | None) -> bool:
    if trusted is None or port != trusted[1]:
        return False
    return host.casefold().rstrip(".") == trusted[0].casefold().rstrip(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# IPv6 forms that carry an IPv4 address (NAT64, IPv4-compatible) or reach no public host (site-local, and
# 192.0.0.0/24, the IETF's own): Python 3.11 counts them as global.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NOT_PUBLIC = (ipaddress.ip_network("fec0::/10"), ipaddress.ip_network("::/96"), ipaddress.ip_network("192.0.0.0/24"),
               ipaddress.ip_network("64:ff9b:1::/48"),  # (NAT64 for local use: a network's own)
               ipaddress.ip_network("::ffff:0:0:0/96"))  # (IPv4-translated: ::ffff:0:7f00:1)


def _public(address: str) -> bool:
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip.sixtofour is not None:  # 2002:7f00:1::1 is 127.0.0.1 through a 6to4 relay
            ip = ip.sixtofour
        elif ip in _NAT64:  # 64:ff9b::a9fe:a9fe is 169.254.169.254 on a NAT64 network
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if any(ip in net for net in _NOT_PUBLIC if net.version == ip.version):
        return False
    return ip.is_global and not ip.is_multicast


def _internal(host: str) -> str:
    return (f"refused to call {host}: it is not a public address; only the host in the skill's url may be one, "
            "written as an IP address or localhost, or named with allow_internal = true in the skill's config "
            "(a redirect or the arguments led here, or the name's DNS points inside)")


def fill_template(template: str, arguments: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The URL with each ``{name}`` replaced by the quoted argument, and the arguments not used in it."""
    used: set[str] = set()

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if arguments.get(name) is None:
            raise CallFailure(f"missing argument {name!r} (it is part of the URL)", f"missing argument {name!r}")
        used.add(name)
        return quote(_as_text(arguments[name]), safe="")

    url = URL_PLACEHOLDER.sub(replace, template)
    _check_path(template, url)
    return url, {key: value for key, value in arguments.items() if key not in used}


def _check_path(template: str, url: str) -> None:
    """Refuse a filled URL whose path gained a "." or ".." segment, or lost one to emptiness, where the
    template had a placeholder: a URL resolves those, so the call would leave the path the skill's author
    meant (``/users/{id}/profile`` with ``..`` calls ``/profile``; so does ``/{a}{b}/`` with "." twice).
    Placeholders are quoted with "/" encoded, so the template's segments and the URL's pair up."""
    def segments(text: str) -> list[str]:
        return re.split(r"[?#]", text, maxsplit=1)[0].split("/")

    for pattern, filled in zip(segments(template), segments(url), strict=False):
        if URL_PLACEHOLDER.search(pattern) and filled.strip() in ("", ".", ".."):
            raise CallFailure(f"the arguments make a part of the URL's path {filled!r}, which would change the "
                              "path called; give a real value", "arguments that would change the URL's path")


def query_params(arguments: dict[str, Any]) -> list[tuple[str, str]]:
    """Query parameters for ``arguments``: a list repeats its key, ``null`` is left out."""
    params: list[tuple[str, str]] = []
    for key, value in arguments.items():
        for item in value if isinstance(value, list) else [value]:
            if item is not None:
                params.append((key, _as_text(item)))
    return params


async def read_limited(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most ``limit`` bytes of the body, read as it streams in (a huge body is never loaded)."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await response.content.read(limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


_TOO_DEEP = "the response nests its JSON too deeply to be read"


def extract(text: str, is_json: bool, result_path: str) -> str:
    """The part of the response the model sees: ``result_path`` of a JSON body, else the text."""
    if not is_json and not result_path:
        return text
    try:
        data = json.loads(text)
    except RecursionError as exc:  # nested deeper than Python's parser goes: no data the model could use
        raise CallFailure(_TOO_DEEP, _TOO_DEEP) from exc
    except ValueError as exc:
        if result_path:
            raise CallFailure(f"the response is not JSON, so result_path {result_path!r} cannot apply",
                              "response not JSON") from exc
        return text
    if result_path:
        data = walk(data, result_path)
    try:
        return data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    except RecursionError as exc:
        raise CallFailure(_TOO_DEEP, _TOO_DEEP) from exc


def walk(data: Any, path: str) -> Any:
    """Follow a dotted path (``a.b.0.c``) through objects and list indexes."""
    done: list[str] = []
    for step in path.split("."):
        if isinstance(data, dict) and step in data:
            data = data[step]
        elif isinstance(data, list) and re.fullmatch(r"-?\d+", step) and -len(data) <= int(step) < len(data):
            data = data[int(step)]
        else:
            where = ".".join(done) or "the top level"
            raise CallFailure(f"result_path {path!r} not found in the response: no {step!r} at {where}",
                              "result_path not found in the response")
        done.append(step)
    return data


def _check_template(config: HttpSkillConfig) -> None:
    try:
        scheme = urlsplit(config.url).scheme.lower()
    except ValueError as exc:  # "Invalid IPv6 URL" alone named neither the skill nor the key
        raise ValueError(f"[[skills.http]] {config.name!r}: the url is not a valid URL ({exc})") from None
    if scheme not in ("http", "https"):
        raise ValueError(f"[[skills.http]] {config.name!r}: the url must start with http:// or https://")


def _check_scheme(url: str) -> None:
    if urlsplit(url).scheme.lower() not in ("http", "https"):
        raise CallFailure("only http and https URLs may be called", "a URL that is no http or https one")


def _schema_validator(config: HttpSkillConfig) -> Any:
    cls = validators.validator_for(config.parameters)
    try:
        cls.check_schema(config.parameters)
    except schema_errors.SchemaError as exc:
        raise ValueError(f"[[skills.http]] {config.name!r}: parameters is not a valid JSON schema: "
                         f"{exc.message}") from exc
    return cls(config.parameters)


def _describe(error: schema_errors.ValidationError) -> str:
    message = str(error.message)
    if len(message) > 200:
        message = message[:200] + "..."
    path = "/".join(str(part) for part in error.absolute_path)
    return f"{message} (at {path})" if path else message


def _rule_broken(error: schema_errors.ValidationError) -> str:
    """The rule of the skill's schema an argument broke, in the schema's own words (``properties/city/maxLength``):
    never the value, nor a key the model made up (the error's path through the arguments may hold one)."""
    return "/".join(str(part) for part in error.absolute_schema_path)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _charset(response: aiohttp.ClientResponse) -> str:
    """The text encoding the server names in Content-Type (ISO-8859-1, say), else UTF-8 (also for a name
    Python knows no text codec of: "rot13" or "base64" would fail the decoding). UTF-8 is read without a leading
    byte order mark: JSON after one failed to parse, and every call with a result_path failed."""
    named = response.charset
    if named:
        try:
            name = codecs.lookup(named).name
            b"a".decode(name, "replace")  # LookupError for a codec that is no text encoding
        except LookupError:
            return "utf-8-sig"
        return "utf-8-sig" if name == "utf-8" else name
    return "utf-8-sig"


def _is_json(response: aiohttp.ClientResponse) -> bool:
    mime = response.content_type.lower()
    return mime == "application/json" or mime.endswith("+json")


def _os_reason(exc: aiohttp.ClientConnectorError) -> str:
    error = exc.os_error
    return (error.strerror or str(error) or type(error).__name__).lower()


def _too_large(size: int | None, limit: int) -> str:
    told = f" ({size} bytes)" if size is not None else ""
    return f"the response is too large{told}: more than max_response_bytes = {limit}"
