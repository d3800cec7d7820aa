"""``/login/{token}`` (a page with a button), ``POST /login`` (uses the link up, opens a session) and
``POST /api/logout``."""

from __future__ import annotations

import html

from aiohttp import web

from adapters.web.errors import BACK, page
from adapters.web.server import UNREADABLE_BODY, WebContext, ok

MAX_TOKEN_CHARS = 100


def _expired() -> web.Response:
    return page("<p>This login link has expired or was used already.</p>"
                 "<p>Send <code>!dashboard</code> (or <code>/dashboard</code> on Discord) in a chat with the bot "
                 f"for a new one.</p>{BACK}", status=410)


def routes(ctx: WebContext) -> list[web.RouteDef]:
    logins, auth = ctx.app.storage.web, ctx.auth
    session_seconds = ctx.app.config.web.session_hours * 3600

    async def show(request: web.Request) -> web.Response:
        token = request.match_info["token"]
        if len(token) > MAX_TOKEN_CHARS or not await logins.link_valid(token):
            return _expired()
        return page(
            "<p>Log in to see and edit what the bot remembers about you.</p>"
            '<form method="post" action="/login">'
            f'<input type="hidden" name="token" value="{html.escape(token, quote=True)}">'
            '<button type="submit" id="login">Log in</button></form>'
            "<p class=\"hint\">The link works once; this browser then stays logged in for "
            f"{ctx.app.config.web.session_hours:g} hours or until you log out.</p>")

    async def use(request: web.Request) -> web.StreamResponse:
        if not auth.from_page(request):  # (opened at another address than the page's: a tunnel, the bare port)
            base = html.escape(ctx.app.config.web.base_url)
            return page(f"<p>This login came from another address than the page's, {base}. Open the link as the "
                        "bot gave it (or send <code>!dashboard</code> for a new one).</p>", status=403)
        try:
            form = await request.post()
        # undecodable text, a bad charset, a broken multipart body or part header, an unknown transfer
        # encoding of a part (RuntimeError), a body that does not match its Content-Encoding
        except (ValueError, LookupError, RuntimeError, *UNREADABLE_BODY):
            return page("<p>This login request could not be read. Open the link again and press the button.</p>",
                         status=400)
        token = form.get("token")
        if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
            return _expired()
        opened = await logins.consume_link(token, session_seconds)
        if opened is None:
            return _expired()
        session_id, _ = opened
        if previous := request.cookies.get(auth.cookie, ""):  # this browser's older session ends: one at a time
            await logins.end_session(previous[:MAX_TOKEN_CHARS])
        response = web.Response(status=303, headers={"Location": "/"})
        auth.set_cookie(response, session_id, session_seconds)
        return response

    async def logout(request: web.Request) -> web.Response:
        caller = await auth.require(request, limited=False)  # a user over the change limit can still leave
        if request.query.get("everywhere", "").lower() in ("1", "true", "yes"):
            ended = await logins.end_sessions(caller.session.user_key)
        else:
            await logins.end_session(caller.session_id)
            ended = 1
        response = ok({"logged_out": True, "sessions_ended": ended})
        auth.clear_cookie(response)
        return response

    return [web.get("/login/{token}", show), web.post("/login", use), web.post("/api/logout", logout)]
