"""HTTP skills (``[[skills.http]]``) against a real aiohttp server on 127.0.0.1: URL templates, query
parameters and JSON bodies, secret headers that reach the server but never the result, result_path,
argument checks, and every failure (timeout, error status, oversize body, refused connection) as an
error result rather than an exception."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from bot.config import HttpSkillConfig
from cortex.skills.base import SkillContext
from cortex.skills.http import HttpSkill

SECRET = "s3cr3t-token-value-0123456789"
SECRET_ENV = "CORTEX_TEST_HTTP_SKILL_KEY"
BIG_TOTAL = 64 * 1024 * 1024
CONTEXT_FIELDS: dict[str, Any] = {
    "user_db_id": 1, "user_key": "discord:1", "user_name": "Ann", "persona": "Cora", "channel_key": "c1",
    "server_key": None, "is_dm": True, "is_admin": False,
}


def _context() -> SkillContext:
    return SkillContext(**CONTEXT_FIELDS, now=datetime.now(UTC))


class Recorder:
    """What the test server saw."""

    def __init__(self) -> None:
        self.requests: list[web.Request] = []
        self.big_sent = 0
        self.release = asyncio.Event()  # set at teardown: the slow handlers end


def _routes(seen: Recorder) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        seen.requests.append(request)
        body = await request.json() if request.can_read_body else None
        return web.json_response({"method": request.method, "path": request.raw_path.split("?")[0],
                                  "query": [[k, v] for k, v in request.query.items()], "body": body})

    async def reflect_key(request: web.Request) -> web.Response:
        seen.requests.append(request)
        return web.Response(text=f"your key is {request.headers.get('X-Api-Key')}")

    async def cookie(request: web.Request) -> web.Response:
        seen.requests.append(request)
        response = web.Response(text="ok")
        response.set_cookie("session", "ann-private")
        return response

    async def nested(request: web.Request) -> web.Response:
        return web.json_response({"data": {"items": [{"name": "first", "tags": ["a", "b"]}, {"name": "second"}]}})

    async def slow(request: web.Request) -> web.Response:
        await asyncio.wait_for(seen.release.wait(), 5)
        return web.Response(text="too late")

    async def slow_body(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(b"the start, ")
        await asyncio.wait_for(seen.release.wait(), 5)
        await response.write(b"the end")
        return response

    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom " + "x" * 1000)

    async def unknown(request: web.Request) -> web.Response:  # an error body that quotes the arguments
        return web.Response(status=404, text=f"no forecast for {request.query.get('city')}")

    async def big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        chunk = b"y" * 65536
        while seen.big_sent < BIG_TOTAL:
            await response.write(chunk)
            seen.big_sent += len(chunk)
        return response

    async def declared_big(request: web.Request) -> web.Response:
        return web.Response(body=b"z" * 5000)

    async def hop(request: web.Request) -> web.Response:
        seen.requests.append(request)
        left = int(request.match_info["left"])
        if left == 0:
            return web.Response(text="arrived")
        raise web.HTTPFound(f"/hop/{left - 1}")

    async def deep(request: web.Request) -> web.Response:
        depth = int(request.query.get("depth", "100000"))
        return web.Response(text="[" * depth + "]" * depth, content_type="application/json")

    async def latin(request: web.Request) -> web.Response:
        kind = request.query.get("kind", "text/plain")
        text = '{"name": "Jürgen Müller"}' if kind == "application/json" else "Jürgen Müller, Straße 5"
        return web.Response(body=text.encode("iso-8859-1"), content_type=kind, charset=request.query.get("charset"))

    async def bom(request: web.Request) -> web.Response:  # a JSON body written by a tool that starts with a BOM
        return web.Response(body=b'\xef\xbb\xbf{"data": {"temp": 21}}', content_type="application/json",
                            charset=request.query.get("charset"))

    async def go(request: web.Request) -> web.Response:
        seen.requests.append(request)
        raise web.HTTPFound(request.query["to"])

    app = web.Application()
    app.router.add_get("/go", go)
    app.router.add_get("/deep", deep)
    app.router.add_get("/latin", latin)
    app.router.add_get("/bom", bom)
    app.router.add_route("*", "/echo/{tail:.*}", echo)
    app.router.add_get("/reflect", reflect_key)
    app.router.add_get("/nested", nested)
    app.router.add_get("/cookie", cookie)
    app.router.add_get("/slow", slow)
    app.router.add_get("/slow-body", slow_body)
    app.router.add_get("/fail", fail)
    app.router.add_get("/unknown", unknown)
    app.router.add_get("/big", big)
    app.router.add_get("/declared-big", declared_big)
    app.router.add_get("/hop/{left}", hop)
    return app


@pytest_asyncio.fixture
async def server() -> AsyncIterator[tuple[str, Recorder]]:
    seen = Recorder()
    runner = web.AppRunner(_routes(seen))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        seen.release.set()
        await runner.cleanup()


@pytest_asyncio.fixture
async def make() -> AsyncIterator[Callable[..., HttpSkill]]:
    skills: list[HttpSkill] = []

    def build(**fields: Any) -> HttpSkill:
        fields.setdefault("name", "probe")
        fields.setdefault("description", "A test endpoint.")
        skill = HttpSkill(HttpSkillConfig(**fields))
        skills.append(skill)
        return skill

    yield build
    for skill in skills:
        await skill.aclose()


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
    "required": ["city"],
    "additionalProperties": False,
}


async def test_get_fills_the_template_and_sends_the_rest_as_query(server: tuple[str, Recorder], make: Any) -> None:
    base, _ = server
    skill = make(url=base + "/echo/weather/{city}?lang=en", parameters=CITY_SCHEMA, triggers=["weather"])
    result = await skill.run({"city": "New York/NY", "days": 3, "metric": True}, _context())
    assert not result.is_error, result.content
    data = json.loads(result.content)
    assert data["method"] == "GET" and data["body"] is None
    assert data["path"] == "/echo/weather/New%20York%2FNY"  # one path segment, slash quoted
    assert data["query"] == [["lang", "en"], ["days", "3"], ["metric", "true"]]
    assert result.content == json.dumps(data, separators=(",", ":"))  # compact
    info = skill.info
    assert (info.name, info.origin, info.triggers, info.input_schema) == ("probe", "http", ("weather",), CITY_SCHEMA)
    assert info.secrets == () and not info.admin_only


async def test_post_sends_unused_arguments_as_json_body(server: tuple[str, Recorder], make: Any) -> None:
    base, _ = server
    schema = {"type": "object", "properties": {"list": {"type": "string"}, "item": {"type": "object"},
                                               "count": {"type": "number"}}}
    skill = make(url=base + "/echo/lists/{list}", method="POST", parameters=schema, admin_only=True)
    result = await skill.run({"list": "groceries", "item": {"name": "milk", "qty": 2}, "count": 1.5}, _context())
    assert not result.is_error, result.content
    data = json.loads(result.content)
    assert data["method"] == "POST" and data["path"] == "/echo/lists/groceries" and data["query"] == []
    assert data["body"] == {"item": {"name": "milk", "qty": 2}, "count": 1.5}
    assert skill.info.admin_only


async def test_secret_header_reaches_the_server_but_not_the_result(
    server: tuple[str, Recorder], make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, seen = server
    monkeypatch.setenv(SECRET_ENV, SECRET)
    skill = make(url=base + "/reflect", headers={"X-Fixed": "plain"}, headers_env={"X-Api-Key": SECRET_ENV})
    result = await skill.run({}, _context())
    assert not result.is_error, result.content
    assert seen.requests[-1].headers["X-Api-Key"] == SECRET
    assert seen.requests[-1].headers["X-Fixed"] == "plain"
    assert SECRET not in result.content and result.content == "your key is [redacted]"
    assert skill.info.secrets == (SECRET,)
    assert SECRET not in repr(skill.info.input_schema)


async def test_a_failure_is_logged_by_its_kind_never_with_the_persons_words(
        server: tuple[str, Recorder], make: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A failed call was logged at INFO, the default level, with jsonschema's message, which quotes the argument
    (the person's words), or the start of the server's error body, and the log outlives a forget-me and an
    incognito pause. It names the rule broken or the status now; the model is still told everything."""
    base, _ = server
    caplog.set_level(logging.DEBUG, logger="cortex.skills.http")
    words = "Lisbon, where I'm going for my HIV treatment next week"
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}}
    skill = make(name="weather", url=base + "/unknown", parameters=schema)
    invalid = await skill.run({"city": words}, _context())
    assert invalid.is_error and words in invalid.content and "(at city)" in invalid.content
    refused = await skill.run({"city": "Lisbon, at the clinic"}, _context())
    assert refused.is_error and "no forecast for Lisbon, at the clinic" in refused.content
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == [
        "http skill weather failed: invalid arguments (properties/city/maxLength)",
        "http skill weather failed: HTTP 404"]
    assert "Lisbon" not in caplog.text and "forecast" not in caplog.text  # (nor the URL filled, at DEBUG)


async def test_result_path_walks_objects_and_list_indexes(server: tuple[str, Recorder], make: Any) -> None:
    base, _ = server
    first = await make(url=base + "/nested", result_path="data.items.0.name").run({}, _context())
    assert (first.content, first.is_error) == ("first", False)  # a string as it is, not JSON-quoted
    tags = await make(url=base + "/nested", result_path="data.items.0.tags").run({}, _context())
    assert tags.content == '["a","b"]' and not tags.is_error
    missing = await make(url=base + "/nested", result_path="data.items.5.name").run({}, _context())
    assert missing.is_error and "data.items.5.name" in missing.content and "'5'" in missing.content


async def test_dot_segments_cannot_leave_the_templates_path(server: tuple[str, Recorder], make: Any) -> None:
    """A URL resolves "." and "..": /users/{id}/profile with id ".." would call /profile."""
    base, seen = server
    skill = make(url=base + "/echo/weather/{city}/today", parameters=CITY_SCHEMA)
    for value in ("..", ".", ""):
        result = await skill.run({"city": value}, _context())
        assert result.is_error and "part of the URL's path" in result.content, value
    loose = {"type": "object", "properties": {}}
    for template, arguments in [("/echo/{a}{b}/x", {"a": ".", "b": "."}), ("/echo/{name}.{ext}/raw", {"name": ".",
                                                                                                      "ext": ""}),
                                ("/echo/{a}./x", {"a": "."})]:
        joined = await make(url=base + template, parameters=loose).run(arguments, _context())
        assert joined.is_error and "part of the URL's path" in joined.content, template
    assert seen.requests == []
    fine = await skill.run({"city": "...x"}, _context())
    assert json.loads(fine.content)["path"] == "/echo/weather/...x/today"
    inside = make(url=base + "/echo/weather/{city}.json?q={q}", parameters={"type": "object", "properties": {}})
    harmless = await inside.run({"city": ".", "q": ""}, _context())  # inside a segment, and in the query
    assert not harmless.is_error and json.loads(harmless.content)["path"] == "/echo/weather/..json"


async def test_missing_required_argument_is_an_error_and_no_request(
    server: tuple[str, Recorder], make: Any
) -> None:
    base, seen = server
    skill = make(url=base + "/echo/weather/{city}", parameters=CITY_SCHEMA)
    result = await skill.run({"days": 2}, _context())
    assert result.is_error and "'city' is a required property" in result.content
    assert seen.requests == []
    loose = make(url=base + "/echo/weather/{city}", parameters={"type": "object", "properties": {}})
    unfilled = await loose.run({}, _context())
    assert unfilled.is_error and "missing argument 'city'" in unfilled.content and seen.requests == []
    with pytest.raises(ValueError, match=r"url uses \{town\}, which parameters does not define: add it under "
                                         r"parameters.properties"):  # a typo the schema shows: refused at the start
        make(url=base + "/echo/weather/{town}", parameters=CITY_SCHEMA)


async def test_wrong_type_and_unknown_key_are_errors(server: tuple[str, Recorder], make: Any) -> None:
    base, seen = server
    skill = make(url=base + "/echo/weather/{city}", parameters=CITY_SCHEMA)
    wrong = await skill.run({"city": "Lyon", "days": "three"}, _context())
    assert wrong.is_error and "'three' is not of type 'integer'" in wrong.content and "days" in wrong.content
    boolean = await skill.run({"city": "Lyon", "days": True}, _context())
    assert boolean.is_error and "not of type 'integer'" in boolean.content  # a bool is not an integer
    unknown = await skill.run({"city": "Lyon", "colour": "red"}, _context())
    assert unknown.is_error and "'colour' was unexpected" in unknown.content
    assert seen.requests == []


async def test_timeout_is_an_error(server: tuple[str, Recorder], make: Any) -> None:
    base, _ = server
    started = asyncio.get_running_loop().time()
    result = await make(url=base + "/slow", timeout_seconds=0.3).run({}, _context())
    assert result.is_error and result.content == "the request timed out after 0.3 s"
    stalled = await make(url=base + "/slow-body", timeout_seconds=0.3).run({}, _context())
    assert stalled.is_error and stalled.content == "the request timed out after 0.3 s"  # the body counts too
    assert asyncio.get_running_loop().time() - started < 2


async def test_error_status_gives_status_and_start_of_body(server: tuple[str, Recorder], make: Any) -> None:
    base, _ = server
    result = await make(url=base + "/fail").run({}, _context())
    assert result.is_error and "HTTP 500" in result.content and "boom xxx" in result.content
    excerpt = result.content.split(": ", 1)[1]
    assert len(excerpt) == 300


async def test_oversize_response_is_refused_without_reading_it_all(
    server: tuple[str, Recorder], make: Any
) -> None:
    base, seen = server
    result = await make(url=base + "/big", max_response_bytes=1000).run({}, _context())
    assert result.is_error and "too large" in result.content and "1000" in result.content
    assert "y" * 100 not in result.content
    assert seen.big_sent < BIG_TOTAL  # the client stopped reading; the server never got to send it all
    declared = await make(url=base + "/declared-big", max_response_bytes=4999).run({}, _context())
    assert declared.is_error and "5000 bytes" in declared.content
    fits = await make(url=base + "/declared-big", max_response_bytes=5000).run({}, _context())
    assert not fits.is_error and fits.content == "z" * 5000


async def test_connection_refused_is_an_error(make: Any) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = await make(url=f"http://127.0.0.1:{port}/x").run({}, _context())
    assert result.is_error and f"could not connect to 127.0.0.1:{port}" in result.content


async def test_three_redirects_are_followed_not_four(server: tuple[str, Recorder], make: Any) -> None:
    base, seen = server
    three = await make(url=base + "/hop/3").run({}, _context())
    assert (three.content, three.is_error) == ("arrived", False)
    assert len(seen.requests) == 4  # the first request and three redirects
    four = await make(url=base + "/hop/4").run({}, _context())
    assert four.is_error and four.content == "too many redirects (more than 3)"
    assert len(seen.requests) == 8  # stopped at the fourth redirect, /hop/0 never reached


def test_missing_env_variable_fails_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    config = HttpSkillConfig(name="probe", description="d", url="https://example.invalid/",
                             headers_env={"Authorization": SECRET_ENV})
    with pytest.raises(ValueError, match=SECRET_ENV):
        HttpSkill(config)
    monkeypatch.setenv(SECRET_ENV, f"Bearer {SECRET}")
    assert HttpSkill(config).info.secrets == (f"Bearer {SECRET}",)


def test_only_http_urls_and_valid_schemas_are_accepted() -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        HttpSkill(HttpSkillConfig(name="probe", description="d", url="file:///etc/passwd"))
    invalid = r"^\[\[skills.http\]\] 'probe': the url is not a valid URL \(Invalid IPv6 URL\)$"
    with pytest.raises(ValueError, match=invalid):
        HttpSkill(HttpSkillConfig(name="probe", description="d", url="http://[::1/x"))
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        HttpSkill(HttpSkillConfig(name="probe", description="d", url="https://x.invalid/",
                                  parameters={"type": "object", "properties": {"a": {"type": "nope"}}}))


async def test_cookies_are_not_kept_between_calls(server: tuple[str, Recorder], make: Any) -> None:
    base, seen = server
    skill = make(url=base.replace("127.0.0.1", "localhost") + "/cookie")  # a jar keeps no cookies of IPs
    assert (await skill.run({}, _context())).content == "ok"
    assert (await skill.run({}, _context())).content == "ok"
    assert len(seen.requests) == 2 and "session" not in seen.requests[1].cookies  # no jar shared by users


async def test_a_skill_with_secret_headers_follows_no_redirect(server: tuple[str, Recorder], make: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    base, seen = server
    monkeypatch.setenv(SECRET_ENV, f"Bearer {SECRET}")
    result = await make(url=base + "/hop/1", headers_env={"Authorization": SECRET_ENV}).run({}, _context())
    assert result.is_error and "follows no redirects" in result.content
    assert len(seen.requests) == 1  # the redirect's target was never asked


@asynccontextmanager
async def internal_service(host: str, answer: str) -> AsyncIterator[tuple[int, list[str]]]:
    """A service on this machine answering ``answer`` to every GET, on ``host`` and a free port: (the port,
    the paths asked for)."""
    asked: list[str] = []

    async def answering(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(text=answer)

    app = web.Application()
    app.router.add_get("/{tail:.*}", answering)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, 0).start()
    try:
        yield runner.addresses[0][1], asked
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture
async def metadata() -> AsyncIterator[tuple[int, list[str]]]:
    """An internal service (a cloud's metadata endpoint, say) on another loopback address: 127.0.0.2."""
    async with internal_service("127.0.0.2", "AccessKeyId=ASIA-instance-role-secret") as service:
        yield service


async def test_only_the_configured_host_may_be_internal(
    server: tuple[str, Recorder], metadata: tuple[int, list[str]], make: Any
) -> None:
    """The admin wrote the skill's host (here localhost, so it may be internal); a redirect the endpoint
    answers (an open redirect, a hostile API) or a host the model's arguments make never reaches another
    internal address, by address or by a name that resolves to one."""
    base, seen = server
    port, asked = metadata
    local = base.replace("127.0.0.1", "localhost")
    skill = make(url=local + "/go", parameters={"type": "object", "properties": {"to": {"type": "string"}}})
    for target in (f"http://127.0.0.2:{port}/latest/meta-data/", f"http://[::ffff:127.0.0.2]:{port}/x",
                   f"http://[::1]:{port}/x", f"http://0.0.0.0:{port}/x"):
        result = await skill.run({"to": target}, _context())
        assert result.is_error and "not a public address" in result.content, (target, result)
        assert "ASIA" not in result.content
    assert len(seen.requests) == 4 and asked == []
    shaped = make(url="http://{host}:" + str(port) + "/latest/meta-data/",
                  parameters={"type": "object", "properties": {"host": {"type": "string"}}})
    for host in ("localhost", "127.0.0.2"):
        named = await shaped.run({"host": host}, _context())
        assert named.is_error and "not a public address" in named.content, (host, named)
    assert asked == []
    back = await skill.run({"to": local + "/hop/0"}, _context())  # the configured host itself: still fine
    assert (back.content, back.is_error) == ("arrived", False)
    direct = await make(url=f"http://127.0.0.2:{port}/written-by-the-admin").run({}, _context())
    assert (direct.content, direct.is_error) == ("AccessKeyId=ASIA-instance-role-secret", False)


async def test_the_configured_port_is_trusted_not_the_whole_machine(server: tuple[str, Recorder], make: Any) -> None:
    """Trust was by host: an open redirect of a skill on 127.0.0.1 reached every port of the machine (a local
    admin API, the bot's own /metrics). A redirect to another port of the skill's host is held to public
    addresses like any other, by address or by name."""
    base, seen = server
    async with internal_service("127.0.0.1", "SECRET-INTERNAL") as (other, asked):
        for written in (base, base.replace("127.0.0.1", "localhost")):
            skill = make(url=written + "/go", parameters={"type": "object", "properties": {"to": {"type": "string"}}})
            for target in (f"http://127.0.0.1:{other}/admin", f"http://localhost:{other}/admin"):
                result = await skill.run({"to": target}, _context())
                assert result.is_error and "not a public address" in result.content, (written, target, result)
            back = await skill.run({"to": written + "/hop/0"}, _context())  # its own port: still fine
            assert (back.content, back.is_error) == ("arrived", False)
        assert asked == []


async def test_json_nested_too_deeply_is_an_error_result_not_an_exception(
    server: tuple[str, Recorder], make: Any
) -> None:
    base, _ = server
    for depth, path in ((100_000, ""), (100_000, "0"), (990, "0")):
        skill = make(url=f"{base}/deep?depth={depth}", max_response_bytes=1_000_000, result_path=path)
        result = await skill.run({}, _context())  # a skill never raises for what a server sends
        assert result.is_error and "nests its JSON too deeply" in result.content, (depth, path)
    shallow = await make(url=f"{base}/deep?depth=3", result_path="0").run({}, _context())
    assert (shallow.content, shallow.is_error) == ("[[]]", False)


async def test_the_charset_the_server_names_is_used(server: tuple[str, Recorder], make: Any) -> None:
    """A body in ISO-8859-1, said so in Content-Type, lost every umlaut to U+FFFD (read as UTF-8)."""
    base, _ = server
    plain = await make(url=base + "/latin?charset=iso-8859-1").run({}, _context())
    assert (plain.content, plain.is_error) == ("Jürgen Müller, Straße 5", False)
    data = await make(url=base + "/latin?charset=iso-8859-1&kind=application/json", result_path="name").run(
        {}, _context())
    assert (data.content, data.is_error) == ("Jürgen Müller", False)
    for odd in ("no-such-codec", "rot13", "base64"):  # UTF-8, as if it said nothing
        unknown = await make(url=base + f"/latin?charset={odd}").run({}, _context())
        assert unknown.content == "J\ufffdrgen M\ufffdller, Stra\ufffde 5" and not unknown.is_error, odd
    unsaid = await make(url=base + "/latin").run({}, _context())
    assert "\ufffd" in unsaid.content and not unsaid.is_error


async def test_a_json_answer_starting_with_a_bom_is_read(server: tuple[str, Recorder], make: Any) -> None:
    """A UTF-8 byte order mark before a JSON answer (some Windows servers write one) made every call fail: "the
    response is not JSON, so result_path 'data.temp' cannot apply"; without result_path the model got the mark."""
    base, _ = server
    for query in ("", "?charset=utf-8", "?charset=UTF8"):
        temp = await make(url=base + "/bom" + query, result_path="data.temp").run({}, _context())
        assert (temp.content, temp.is_error) == ("21", False), query
        whole = await make(url=base + "/bom" + query).run({}, _context())
        assert (whole.content, whole.is_error) == ('{"data":{"temp":21}}', False), query


async def test_a_named_host_is_held_to_public_addresses_unless_the_config_allows_internal(
        server: tuple[str, Recorder], make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host written in the url was trusted by its name: whoever runs a public name's DNS pointed it at
    127.0.0.1 and redirected to any path there, and the skill handed the machine's own answer to the model.
    An IP address or localhost written in the url, or a name with allow_internal, may still be internal."""
    import aiohttp

    base, seen = server
    port = base.rsplit(":", 1)[1]
    real = aiohttp.DefaultResolver.resolve

    async def dns(self: Any, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> Any:
        if host in ("api.weather-public.example", "ollama"):  # a public name whose DNS now answers 127.0.0.1
            return [{"hostname": host, "host": "127.0.0.1", "port": port, "family": socket.AF_INET, "proto": 0,
                     "flags": 0}]
        return await real(self, host, port, family)

    monkeypatch.setattr(aiohttp.DefaultResolver, "resolve", dns)
    public = make(url=f"http://api.weather-public.example:{port}/echo/weather/{{city}}", parameters=CITY_SCHEMA)
    refused = await public.run({"city": "Paris"}, _context())
    assert refused.is_error and "is not a public address" in refused.content and "allow_internal" in refused.content
    assert seen.requests == []
    internal = make(url=f"http://ollama:{port}/echo/weather/{{city}}", parameters=CITY_SCHEMA, allow_internal=True)
    assert not (await internal.run({"city": "Paris"}, _context())).is_error
    literal = make(url=f"http://127.0.0.1:{port}/echo/weather/{{city}}", parameters=CITY_SCHEMA)
    assert not (await literal.run({"city": "Paris"}, _context())).is_error
    assert len(seen.requests) == 2


@pytest.mark.parametrize(("address", "public"), [
    ("93.184.216.34", True), ("2606:2800:220:1:248:1893:25c8:1946", True), ("64:ff9b::5db8:d822", True),
    ("127.0.0.1", False), ("169.254.169.254", False), ("::ffff:127.0.0.1", False),
    ("64:ff9b::a9fe:a9fe", False), ("64:ff9b::a00:1", False),  # NAT64 of the metadata service, of 10.0.0.1
    ("2002:7f00:1::1", False), ("::7f00:1", False), ("fec0::1", False), ("192.0.0.8", False),  # 6to4, v4-compat.,
    ("64:ff9b:1::a00:1", False), ("224.0.0.1", False),  # site-local, IETF, local NAT64, multicast
    ("::ffff:0:7f00:1", False)])  # IPv4-translated
def test_addresses_that_reach_inside_are_not_public(address: str, public: bool) -> None:
    """Python 3.11 counts NAT64, 6to4, IPv4-compatible and site-local forms as global: a redirect to
    [64:ff9b::a00:1] reached 10.0.0.1 on an IPv6-only host with NAT64."""
    from cortex.skills.http import _public

    assert _public(address) is public


async def test_doctor_names_a_skill_host_that_needs_allow_internal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Since a named host is held to public addresses, a skill calling a service inside the network by name
    (http://ollama:11434) is refused at every call: `cortexbot doctor` says so, and what to set."""
    from cortex.skills.http import needs_allow_internal

    loop = asyncio.get_running_loop()
    answers = {"ollama": "172.18.0.5", "api.example.org": "93.184.216.34"}

    async def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> Any:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[host], 0))]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)

    def skill(url: str, **fields: Any) -> HttpSkillConfig:
        return HttpSkillConfig(name="s", description="d", url=url, **fields)

    said = await needs_allow_internal(skill("http://ollama:11434/api/{q}"))
    assert said is not None and "ollama resolves to 172.18.0.5" in said and "allow_internal = true" in said
    assert await needs_allow_internal(skill("http://ollama:11434/api/{q}", allow_internal=True)) is None
    assert await needs_allow_internal(skill("https://api.example.org/{q}")) is None
    assert await needs_allow_internal(skill("http://127.0.0.1:8080/{q}")) is None  # (written as internal)
    assert await needs_allow_internal(skill("https://{host}/x")) is None  # (the arguments choose the host)
    from bot.cli import _doctor_skills
    from bot.config import parse_config

    reports: list[tuple[bool, str, str]] = []
    config = parse_config({"skills": {"http": [
        {"name": "local", "description": "d", "url": "http://ollama:11434/api/{q}"},
        {"name": "public", "description": "d", "url": "https://api.example.org/{q}"}]}})
    await _doctor_skills(config, lambda ok, what, detail="": reports.append((ok, what, detail)))
    assert [(ok, what) for ok, what, _ in reports] == [(False, "http skill local"), (True, "http skill public")]
    assert "allow_internal = true" in reports[0][2]


async def test_doctor_and_the_log_show_a_skill_url_without_its_query(make: Any, server: tuple[str, Recorder],
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """An API key in a skill's query (OpenWeatherMap's ?appid=…: the service takes it nowhere else) was printed by
    doctor ("✓ http skill weather: https://api.example.org/w?appid=…") and logged at DEBUG with every call."""
    from bot.cli import _doctor_skills
    from bot.config import parse_config

    base, _seen = server
    url = f"{base}/echo/weather/{{city}}?appid=QUERYSECRET42&units=metric"
    reports: list[tuple[bool, str, str]] = []
    config = parse_config({"skills": {"http": [{"name": "weather", "description": "d", "url": url}]}})
    await _doctor_skills(config, lambda ok, what, detail="": reports.append((ok, what, detail)))
    assert reports == [(True, "http skill weather", f"{base}/echo/weather/{{city}}?…")]
    with caplog.at_level(logging.DEBUG, logger="cortex.skills.http"):
        done = await make(url=url, parameters=CITY_SCHEMA).run({"city": "Paris"}, _context())
    assert not done.is_error and "/echo/weather/{city}?…" in caplog.text and "QUERYSECRET42" not in caplog.text


@pytest.mark.parametrize("before", [280, 295, 1190])  # (across the 300-character cut; past the body's read limit)
async def test_a_secret_an_error_page_echoes_is_redacted_whole_where_the_excerpt_is_cut(
        make: Any, monkeypatch: pytest.MonkeyPatch, before: int) -> None:
    """The error page was cut to 300 characters before redaction: a secret across the cut was left with its end
    cut off, which no longer matched, and its first 20 characters reached the model, the audit and the log."""
    from aiohttp import web

    monkeypatch.setenv(SECRET_ENV, SECRET)

    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=500, text="x" * before + request.headers["X-Api-Key"] + " and more")

    app = web.Application()
    app.router.add_get("/fail", fail)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        skill = make(url=f"http://127.0.0.1:{runner.addresses[0][1]}/fail", headers_env={"X-Api-Key": SECRET_ENV})
        result = await skill.run({}, _context())
    finally:
        await runner.cleanup()
    assert result.is_error and "HTTP 500" in result.content
    assert not any(SECRET[:size] in result.content for size in range(4, len(SECRET) + 1)), result.content[-80:]


def test_redact_cut_leaves_no_start_of_a_secret_at_the_end() -> None:
    from cortex.skills.base import redact_cut

    secret = "s3cr3t-token-value-0123456789"
    assert redact_cut(f"key {secret} ok", (secret,), 100) == "key [redacted] ok"
    assert redact_cut("x" * 10 + secret + " more", (secret,), 20) == "x" * 10 + "[redacted…"  # (redacted, then cut)
    assert redact_cut("abc s3cr", (secret,), 100) == "abc [redacted]"  # (a read that ended inside it)
    assert redact_cut("abc s3c", (secret,), 100) == "abc s3c"  # (three characters: too few to be one)
