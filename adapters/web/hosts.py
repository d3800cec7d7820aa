"""The Host header against DNS rebinding: a site of the attacker's whose name they point at the bot's
address afterwards talks to the page from the victim's browser, as the page's own origin (so no Origin
check or SameSite cookie stops it), but the browser still sends the attacker's name in ``Host``.
Requests whose Host is not a name the page is served under are a 421 Misdirected Request.

The names: the host of ``[web] public_url``, ``[web] host`` unless it is every address (0.0.0.0, ::),
``[web] allowed_hosts`` and the loopback names. When none but the loopback names is known (a wildcard
host, no public_url, no allowed_hosts), nobody can say which names the operator uses: nothing is
checked, with one warning at start. ``allowed_hosts = ["*"]`` switches the check off explicitly.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import hdrs, web

from bot.config import WebConfig, canonical_host

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

WILDCARDS = frozenset({"0.0.0.0", "[::]", ""})
LOOPBACK = frozenset({"localhost", "127.0.0.1", "[::1]"})
HOST_PORT = re.compile(r"(\[[^\]]*\]|[^:\[\]]*)(?::[0-9]*)?")
MISDIRECTED = ("this address is not one the bot's page is served under (the request's Host header); "
               "open the page at its own address")
UNCHECKED = ("[web] host %r listens on every address and neither [web] public_url nor allowed_hosts is set: "
             "the Host header of requests is not checked, so a site of someone else's could reach the page "
             "through DNS rebinding; set public_url or allowed_hosts (the names the page is opened under) "
             "to check it, or allowed_hosts = [\"*\"] to leave it unchecked without this warning")


def host_name(value: str) -> str | None:
    """``value`` (a Host header or a configured host) as names are compared (without its port, see
    ``canonical_host``); None when it is no host with an optional port."""
    name = value.strip().lower()
    if name.count(":") > 1 and not name.startswith("["):
        name = f"[{name}]"  # a bare IPv6 address, as [web] host is written
    found = HOST_PORT.fullmatch(name)
    return canonical_host(found.group(1).rstrip(".")) if found else None  # as allowed_hosts keeps its names


def allowed_hosts(config: WebConfig, *listening: str) -> frozenset[str] | None:
    """The names a server listening on the ``listening`` hosts answers to, or None: not checked (no name
    but the loopback ones is known, or ``allowed_hosts = ["*"]``)."""
    if "*" in config.allowed_hosts:
        return None
    public = urlsplit(config.public_url).netloc if config.public_url else ""
    names = {name for given in (*config.allowed_hosts, public, *listening)
             if (name := host_name(given)) is not None and name not in WILDCARDS}
    return frozenset(names | LOOPBACK) if names else None


def warn_if_unchecked(config: WebConfig) -> None:
    """One warning at start when the page's own server does not check the Host header unasked."""
    if allowed_hosts(config, config.host) is None and "*" not in config.allowed_hosts:
        log.warning(UNCHECKED, config.host)


@dataclass
class HostCheck:
    """The names one server answers to (None: every name) and whether a refusal was logged yet."""

    allowed: frozenset[str] | None
    warned: bool = False

    def allows(self, header: str) -> bool:
        return self.allowed is None or host_name(header) in self.allowed

    def refused(self, header: str) -> None:
        """The first refusal is a warning (a reverse proxy that passes its own Host needs it in allowed_hosts),
        later ones are debug lines. The header is the client's: only a short repr() of it in ASCII is logged
        (no control characters, no look-alike letters)."""
        shown = ascii(header[:80]) + ("..." if len(header) > 80 else "")
        if self.warned:
            log.debug("refused a request for the host %s (421)", shown)
            return
        self.warned = True
        log.warning("refused a request for the host %s (421): not [web] public_url's host, [web] host, a "
                    "loopback name or in [web] allowed_hosts (a reverse proxy that passes its own Host needs "
                    "that name in allowed_hosts); further refusals are logged at debug level", shown)


HOSTS = web.AppKey("hosts", HostCheck)


@web.middleware
async def checked_host(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A 421 for a request under a name the page is not served under: before any route (pages, the API,
    /healthz, /metrics, static files, login) and any 404 or 405 sees it."""
    check, header = request.app.get(HOSTS), request.headers.get(hdrs.HOST)
    # Without a Host header the client is no browser (browsers always send one), so there is no rebinding to
    # fear: an HTTP/1.0 health check of a load balancer, say.
    if check is not None and header and not check.allows(header):
        check.refused(header)
        raise web.HTTPMisdirectedRequest(reason=MISDIRECTED)
    return await handler(request)
