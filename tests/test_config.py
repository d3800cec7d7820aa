from __future__ import annotations

import re
import time
import tomllib
from pathlib import Path
from typing import Any, get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from bot.config import Config, ConfigError, PersonaConfig, hide_url_passwords, load_config, parse_config, read_secret
from bot.prompt import resolve_variables

ROOT = Path(__file__).resolve().parents[1]


def test_no_file_gives_defaults_and_a_builtin_persona() -> None:
    config = load_config(None)
    assert config.llm.provider == "anthropic"
    assert config.history.history_tokens == 2000
    assert config.history.summary_tokens == 500
    assert config.history.min_exchanges == 3
    assert config.history.summary_trigger == 40
    assert [p.name for p in config.personas] == ["Cora"]
    assert config.storage.url.startswith("sqlite:///") and config.storage.url.endswith("bot.db")


def _sections() -> dict[str, type[BaseModel]]:
    """Every section of the config with its model ([[personas]] aside), read from the models themselves."""
    config = Config()
    return {name: type(getattr(config, name)) for name in Config.model_fields if name != "personas"}


def _tables() -> dict[str, type[BaseModel]]:
    """The arrays of tables inside a section (``[[skills.http]]``, ``[[skills.mcp]]``) with their models."""
    tables = {}
    for section, model in _sections().items():
        for key, field in model.model_fields.items():
            args = get_args(field.annotation)
            if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
                tables[f"{section}.{key}"] = args[0]
    return tables


def _default(field: Any) -> Any:
    return field.get_default(call_default_factory=True)


def test_sections_are_read_from_the_models() -> None:
    """The checks below walk the models: [skills] and [web], which a list written here once left out, are in."""
    assert {"bot", "skills", "web"} <= set(_sections()) and set(_tables()) == {"skills.http", "skills.mcp"}


def test_example_config_is_valid_and_documents_every_key() -> None:
    config = load_config(ROOT / "config.example.toml")
    text = (ROOT / "config.example.toml").read_text()
    tables = _tables()
    for section, model in _sections().items():
        assert f"[{section}]" in text, f"[{section}] is not in config.example.toml"
        for key in model.model_fields:
            if f"{section}.{key}" not in tables:
                assert re.search(rf"^(# )?{key} =", text, re.M), f"[{section}] {key} is not in config.example.toml"
    for table, model in tables.items():  # a commented-out example of each
        block = text.split(f"# [[{table}]]\n", 1)[1].split("\n\n", 1)[0]
        for key in model.model_fields:
            assert re.search(rf"^# (.* or )?{key} =|; or {key} =| or {key} = ", block, re.M), \
                f"[[{table}]] {key} is not in config.example.toml"
    persona_keys = type(config.personas[0]).model_fields
    for key in persona_keys:
        assert f"{key} =" in text, f"[[personas]] {key} is not in config.example.toml"


def test_example_config_sets_the_defaults() -> None:
    """The keys config.example.toml sets (not those commented out) hold the values the bot has without it."""
    written = tomllib.loads((ROOT / "config.example.toml").read_text())
    for section, model in _sections().items():
        for key, value in written.get(section, {}).items():
            assert value == _default(model.model_fields[key]), \
                f"config.example.toml sets [{section}] {key} = {value!r}; the default is " \
                f"{_default(model.model_fields[key])!r}"


def _readme_table() -> dict[str, str]:
    """The README's config table: each key with its default as written."""
    defaults = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        row = re.match(r"^\| ((?:`[a-z0-9_.]+`(?: / )?)+)(?: ★)? \| (.*?) \| ", line)
        if row:
            keys = re.findall(r"`([a-z0-9_.]+)`", row.group(1))
            written = row.group(2).split(" / ") if len(keys) > 1 and " / " in row.group(2) \
                else [row.group(2)] * len(keys)
            defaults.update(zip(keys, written, strict=True))
    return defaults


def test_every_key_is_in_the_readme_table() -> None:
    readme = (ROOT / "README.md").read_text()
    table = _readme_table()
    tables = _tables()
    for section, model in _sections().items():
        for key in model.model_fields:
            assert f"{section}.{key}" in table, f"{section}.{key} missing from the README config table"
    for key in PersonaConfig.model_fields:
        assert f"personas.{key}" in table, f"personas.{key} missing from the README config table"
    known = {f"{s}.{k}" for s, m in _sections().items() for k in m.model_fields} | {
        f"personas.{k}" for k in PersonaConfig.model_fields}
    assert sorted(set(table) - known) == [], "the README's config table has keys the config does not"
    skills = readme[readme.index("## Skills"):readme.index("## Web page")]
    for name, model in tables.items():  # their keys are in the Skills section
        listed = skills[skills.index(f"(`[[{name}]]`"):].split("\n- ", 1)[0]
        for key in model.model_fields:
            assert f"`{key}" in listed or f"{key} =" in skills, f"[[{name}]] {key} is not in the README's Skills"


WORKED_OUT = {"storage.url", "web.public_url"}  # the README writes what the code works out at start


def test_the_readme_table_gives_the_defaults() -> None:
    """A default the README's table writes as a value (`8000`, `"INFO"`, `[]`, `true`) is the code's."""
    models = {**_sections(), "personas": PersonaConfig}
    checked = 0
    for name, written in _readme_table().items():
        section, key = name.split(".", 1)
        literal = re.fullmatch(r"`([^`]*)`", written.strip())
        if literal is None or key not in models[section].model_fields:
            continue  # words ("first persona", "unset", "login name") say what the code works out
        if name in WORKED_OUT or re.fullmatch(r"`[a-z]+\.[a-z_]+`", written.strip()):
            continue  # (or another key's value: `llm.model`)
        value = literal.group(1)
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:  # a bare word: `default`, `OPENAI_API_KEY`
            parsed = value
        default = _default(models[section].model_fields[key])
        assert parsed == default or str(parsed) == str(default), \
            f"the README gives {name} the default {written}; it is {default!r}"
        checked += 1
    assert checked > 120


def _error(raw: dict, tmp_path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(raw, source="config.toml")
    return str(info.value)


def test_unknown_key_is_named_with_a_suggestion() -> None:
    message = _error({"llm": {"modle": "x"}})
    assert "[llm] key 'modle'" in message
    assert "did you mean 'model'" in message


@pytest.mark.parametrize(("section", "key"), [("llm", "api_key"), ("discord", "token"), ("matrix", "password"),
                                              ("storage", "password")])
def test_a_secret_written_into_the_file_is_pointed_to_the_environment(section: str, key: str) -> None:
    """`api_key = "sk-…"` got "did you mean 'api_key_env'?", which invited pasting the key into that one."""
    message = _error({section: {key: "sk-secret-value"}})
    assert f"unknown [{section}] key '{key}': secrets are not read from the config file; put it in an environment " \
           f"variable and write that variable's name as {key}_env" in message
    assert "sk-secret-value" not in message and "did you mean" not in message


def test_unknown_section_is_named() -> None:
    assert "key 'histroy' at the top level" in _error({"histroy": {}})


def test_wrong_type_names_key_and_value() -> None:
    message = _error({"llm": {"max_tokens": "lots"}})
    assert "[llm] key 'max_tokens'" in message and "'lots'" in message
    # TOML has numbers and booleans: a quoted one is a mistake, not read as what it might mean
    assert "[history] key 'history_tokens'" in _error({"history": {"history_tokens": "2000"}})
    assert "[cortex] key 'use_in_groups'" in _error({"cortex": {"use_in_groups": "on"}})
    assert parse_config({"memory": {"weight_text": 1}}).memory.weight_text == 1.0  # a whole number is a number
    section = _error({"matrix": {"enabled": True}})  # a whole section's check names the section itself
    assert ("- [matrix] is enabled, but homeserver is not set; user_id is not set; neither password_env nor "
            "access_token_env is set") in section and "Value error" not in section  # (all at once, not one a start)


@pytest.mark.parametrize(("matrix", "said"), [
    ({"homeserver": "matrix.example.org"}, "homeserver 'matrix.example.org' is not an http(s) URL: write "
                                           "it like https://matrix.example.org"),
    ({"homeserver": "ftp://matrix.example.org"}, "is not an http(s) URL: write it like https://matrix.example.org"),
    ({"user_id": "cortex"}, "[matrix] is enabled, but user_id 'cortex' is not a full Matrix user id: write it like "
                            "@cortex:example.org"),
    ({"user_id": "@cortex"}, "is not a full Matrix user id"),
    ({"user_id": "cortex:example.org"}, "is not a full Matrix user id"),
])
def test_a_matrix_homeserver_or_user_id_that_cannot_work_is_refused(matrix: dict, said: str) -> None:
    """``homeserver = "matrix.example.org"`` passed, and `run` retried nio's invalid URL forever."""
    raw = {"enabled": True, "homeserver": "https://m.org", "user_id": "@b:m.org", "password_env": "MX_PW", **matrix}
    assert said in _error({"matrix": raw})
    ok = parse_config({"matrix": {**raw, "homeserver": " http://127.0.0.1:8008", "user_id": "@b:[::1]:8448"}})
    assert ok.matrix.user_id == "@b:[::1]:8448" and ok.matrix.homeserver == "http://127.0.0.1:8008"
    parse_config({"matrix": {**raw, **matrix, "enabled": False}})  # off: a Discord bot starts whatever it holds


MATRIX_ON = {"enabled": True, "user_id": "@b:m.org", "password_env": "MX_PW"}


@pytest.mark.parametrize(("raw", "where", "keep_in"), [
    ({"llm": {"provider": "openai", "base_url": "http://bob:LlmPassw0rd@127.0.0.1:18765/v1"}},
     "[llm] key 'base_url'", "[llm] api_key_env"),
    ({"memory": {"embedder": "openai", "embedder_model": "e", "embedder_base_url": "http://bob:LlmPassw0rd@h:1/v1"}},
     "[memory] key 'embedder_base_url'", "[memory] embedder_api_key_env"),
    ({"matrix": {**MATRIX_ON, "homeserver": "https://bot:LlmPassw0rd@matrix.example.org"}},
     "[matrix] is enabled, but homeserver", "[matrix] password_env or access_token_env"),
    ({"skills": {"http": [{"name": "w", "description": "d", "url": "https://LlmPassw0rd@api.example.org/{q}"}]}},
     "[[skills.http]] #1 key 'url'", "headers_env"),
    ({"skills": {"mcp": [{"name": "m", "url": "https://u:LlmPassw0rd@mcp.example.org/mcp"}]}},
     "[[skills.mcp]] #1 key 'url'", "headers_env"),
])
def test_a_user_name_or_password_in_a_url_is_refused_without_repeating_it(raw: dict, where: str, keep_in: str) -> None:
    """Only [storage] url refused a password: `user:password@` in [llm] base_url (and the embedder's, the
    homeserver's, a skill's) was taken, and doctor printed it ("✓ LLM openai at http://bob:LlmPassw0rd@…");
    a homeserver's made aiohttp refuse every request ("Cannot combine AUTHORIZATION header with … credentials")."""
    message = _error(raw)
    assert where in message and "LlmPassw0rd" not in message, message
    assert (f"holds a user name or password (user:password@): the config file is no place for a secret; remove it "
            f"and put the secret in an environment variable named by {keep_in}") in message, message


@pytest.mark.parametrize(("raw", "where", "instead"), [
    ({"http": [{"name": "w", "description": "d", "url": "https://a.example.org/x",
                "headers": {"Authorization": "Bearer LlmPassw0rd"}}]}, "header 'Authorization'", "headers_env"),
    ({"http": [{"name": "w", "description": "d", "url": "https://a.example.org/x",
                "headers": {"X-Api-Key": "LlmPassw0rd"}}]}, "header 'X-Api-Key'", "headers_env"),
    ({"http": [{"name": "w", "description": "d", "url": "https://a.example.org/x",
                "headers": {"X-Custom": "ghp_aB3dE5fG7hJ9kL1mN3pQ5rS7tU9LlmPassw0rd"}}]}, "header 'X-Custom'",
     "headers_env"),
    ({"mcp": [{"name": "m", "command": ["x"], "env": {"GITHUB_TOKEN": "LlmPassw0rd"}}]}, "variable 'GITHUB_TOKEN'",
     "env_from"),
    ({"mcp": [{"name": "m", "command": ["x"], "env": {"DB_PASSWORD": "LlmPassw0rd"}}]}, "variable 'DB_PASSWORD'",
     "env_from"),
])
def test_a_secret_written_in_a_skills_headers_or_env_is_refused_without_repeating_it(
        raw: dict, where: str, instead: str) -> None:
    """`headers` and `env` are for fixed values ("no secrets here"), and they were taken with a key in them: it sat
    in the file, an HTTP skill's followed redirects to other hosts (a skill with headers_env follows none), and
    neither was redacted from what the tools answered or logged."""
    message = _error({"skills": raw})
    assert f"{where} holds a secret, and the config file is no place for one" in message, message
    assert f"name that in {instead} = " in message and "LlmPassw0rd" not in message, message
    plain = parse_config({"skills": {
        "http": [{"name": "w", "description": "d", "url": "https://a.example.org/x",
                  "headers": {"Accept": "application/json", "User-Agent": "cortex-bot"}}],
        "mcp": [{"name": "m", "command": ["x"], "env": {"LANG": "C.UTF-8", "NODE_ENV": "production",
                                                         "SSH_KEY_PATH": "/srv/bot/id_ed25519"}}]}})
    assert plain.skills.mcp[0].env["NODE_ENV"] == "production"  # (and a key file's path is no secret)


@pytest.mark.parametrize("url", ["localhost:3000/mcp", "mcp.example.org/mcp", "ws://localhost:3000/mcp"])
def test_an_mcp_url_without_its_scheme_is_refused_at_start(url: str) -> None:
    """It was taken, and the bot then logged the server as down ("Request URL is missing an 'http://' or
    'https://' protocol"), retrying, for as long as it ran."""
    assert (f"[[skills.mcp]] #1 key 'url': {url!r} is not an http(s) URL"
            in _error({"skills": {"mcp": [{"name": "m", "url": url}]}}))
    assert parse_config({"skills": {"mcp": [{"name": "m", "url": "http://localhost:3000/mcp"}]}}).skills.mcp[0].url \
        == "http://localhost:3000/mcp"


def test_a_list_of_tables_written_as_one_table_is_explained() -> None:
    """``[personas]`` where ``[[personas]]`` was meant said only "Input should be a valid list"."""
    assert "[personas] is a list of tables: write each entry under [[personas]] (two brackets)" in _error(
        {"personas": {"name": "Cora"}})
    assert "under [[skills.http]] (two brackets), not one [skills.http] table" in _error(
        {"skills": {"http": {"name": "x"}}})
    assert "list of tables" not in _error({"cortex": {"tiers": {"a": 1}}})  # a list of numbers, not of tables
    assert parse_config({"bot": {"log_level": "debug"}}).bot.log_level == "DEBUG"  # (refused for its case)


def test_missing_required_persona_name() -> None:
    message = _error({"personas": [{"language": "German"}]})
    assert "missing required [[personas]] #1 key 'name'" in message


def test_unknown_key_inside_persona() -> None:
    message = _error({"personas": [{"name": "A", "identiy": "x"}]})
    assert "[[personas]] #1 key 'identiy'" in message and "did you mean 'identity'" in message


def test_default_persona_must_exist() -> None:
    assert "default_persona" in _error({"bot": {"default_persona": "Nobody"}, "personas": [{"name": "A"}]})


def test_duplicate_personas_rejected() -> None:
    assert "unique" in _error({"personas": [{"name": "A"}, {"name": "a"}]})


def test_bad_soul_order_rejected() -> None:
    assert "unknown soul section" in _error({"personas": [{"name": "A", "soul_order": ["identity", "mood"]}]})


def test_storage_url_must_be_sqlite() -> None:
    assert "sqlite:///" in _error({"storage": {"url": "mysql://x"}})


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[llm\nmodel = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_secrets_come_from_the_environment_only() -> None:
    assert read_secret("CB_TEST_KEY", {"CB_TEST_KEY": " sk-123 "}) == "sk-123"
    assert read_secret("CB_TEST_KEY", {"CB_TEST_KEY": "sk-123\n"}) == "sk-123"  # (made with `echo`)
    assert read_secret("CB_TEST_KEY", {"CB_TEST_KEY": ""}) is None
    assert read_secret("CB_TEST_KEY", {}) is None
    # A key written into the file is an unknown key, not a secret the bot would use.
    assert "api_key" in _error({"llm": {"api_key": "sk-secret"}})


@pytest.mark.parametrize("value", ["sk-ant-abc\ndef", "sk-ant-abc\rdef", "sk-ant-abc\x00def", "sk-\x7fabc"])
def test_a_secret_with_a_control_character_inside_is_named(value: str) -> None:
    """An ANTHROPIC_API_KEY with a line break inside (two values pasted into one) showed ✓ in doctor, and every
    reply then said the model "cannot be reached" (httpx refuses the header)."""
    with pytest.raises(ConfigError) as info:
        read_secret("CB_TEST_KEY", {"CB_TEST_KEY": value})
    assert str(info.value) == ("environment variable CB_TEST_KEY holds a line break or another control character "
                               "inside its secret: put the secret alone in it")
    storage = parse_config({"storage": {"password_env": "CB_TEST_PW"}}).storage
    assert storage.resolve({"CB_TEST_PW": "pg-pass\n"})[1] == "pg-pass"
    with pytest.raises(ConfigError, match="CB_TEST_PW holds a line break"):
        storage.resolve({"CB_TEST_PW": value})


def test_default_key_env_follows_provider() -> None:
    assert parse_config({}).llm.key_env_name == "ANTHROPIC_API_KEY"
    assert parse_config({"llm": {"provider": "openai"}}).llm.key_env_name == "OPENAI_API_KEY"
    assert parse_config({"llm": {"api_key_env": "MY_KEY"}}).llm.key_env_name == "MY_KEY"


def test_persona_soul_sections_follow_order() -> None:
    config = parse_config({"personas": [
        {"name": "A", "tone": "dry", "identity": "I am A", "boundaries": "no", "soul_order": ["tone", "identity"]}]})
    # (the sections it leaves out follow, in their usual order)
    assert config.persona("a").soul_sections() == [("tone", "dry"), ("identity", "I am A"), ("boundaries", "no")]
    with pytest.raises(ConfigError, match="unknown persona"):
        config.persona("b")


def test_template_variables_resolve_and_other_braces_stay() -> None:
    text = "I am {char_name}, talking to {user_name} in {language} on {date}; {unknown} {json: 1}"
    out = resolve_variables(text, {"char_name": "Cora", "user_name": "Ann", "language": "German", "date": "today"})
    assert out == "I am Cora, talking to Ann in German on today; {unknown} {json: 1}"


def test_memory_embedder_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="embedder_model"):
        parse_config({"memory": {"embedder": "openai"}})
    with pytest.raises(ConfigError, match="embedder"):
        parse_config({"memory": {"embedder": "word2vec"}})
    config = parse_config({"memory": {"embedder": "openai", "embedder_model": "nomic-embed-text",
                                      "embedder_base_url": "http://127.0.0.1:11434/v1"}})
    assert config.memory.embedder_model == "nomic-embed-text"


@pytest.mark.parametrize(("toml", "named"), [
    ("[jobs]\nlease_seconds = 1e300\n", "[jobs] key 'lease_seconds'"),
    ("[jobs]\nretry_base_seconds = inf\n", "[jobs] key 'retry_base_seconds'"),
    ("[memory]\nprune_every_hours = nan\n", "[memory] key 'prune_every_hours'"),
    ("[memory]\nbackfill_seconds = 1e18\n", "[memory] key 'backfill_seconds'"),
    ("[history]\nhistory_tokens = 100000000000000000000\n", "[history] key 'history_tokens'"),
    ('[llm]\nbase_url = "localhost:11434"\n', "[llm] key 'base_url'"),
    ('[llm]\nbase_url = "http://"\n', "[llm] key 'base_url'"),
    ('[storage]\nurl = "sqlite:///a\\u0000b"\n', "[storage] key 'url'"),
    ("x = " + "[" * 500 + "]" * 500 + "\n", "too deeply"),
])
def test_values_the_bot_cannot_use_stop_start_up_clearly(tmp_path: Path, toml: str, named: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert named in str(caught.value)


def test_an_empty_server_url_is_the_providers_own_api(tmp_path: Path) -> None:
    """config.example.toml says "Empty: the provider's official API" above ``# base_url = ""``; taking the
    comment off gave "'' is not an http(s) URL"."""
    config = parse_config({"llm": {"base_url": ""}, "memory": {"embedder_base_url": "  "}})
    assert config.llm.base_url is None and config.memory.embedder_base_url is None
    example = Path(__file__).resolve().parents[1] / "config.example.toml"
    text = example.read_text().replace('# base_url = ""', 'base_url = ""')
    assert 'base_url = ""' in text
    (tmp_path / "config.toml").write_text(text)
    assert load_config(tmp_path / "config.toml").llm.base_url is None


def test_an_anthropic_base_url_ending_in_v1_is_explained() -> None:
    with pytest.raises(ConfigError, match="ends in /v1, but the Anthropic SDK adds /v1 itself"):
        parse_config({"llm": {"provider": "anthropic", "base_url": "http://localhost:8080/v1"}})
    assert parse_config({"llm": {"provider": "openai", "base_url": "http://localhost:8080/v1"}}).llm.base_url


@pytest.mark.parametrize("name", ["   ", "Co\u200bra", " Cora", "Cora\u0007", "Cora\u2800", "\u3164", "Co\u034fra"])
def test_a_persona_name_is_visible_text(name: str) -> None:
    with pytest.raises(ConfigError, match="a persona's name is visible text"):
        parse_config({"personas": [{"name": name}]})


def test_a_config_saved_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    """Some Windows editors save UTF-8 with a BOM; it gave "not valid TOML (at line 1, column 1)"."""
    path = tmp_path / "config.toml"
    path.write_bytes("\ufeff[llm]\nmodel = \"claude-x\"\n".encode())
    assert load_config(path).llm.model == "claude-x"


@pytest.mark.parametrize(("given", "origin"), [
    ("https://bot.example.org:443/", "https://bot.example.org"), ("HTTP://Bot.Example.org:80", "http://bot.example.org"),
    ("https://bot.example.org:8443", "https://bot.example.org:8443"), ("http://[::1]:8080", "http://[::1]:8080"),
    ("https://Bücher.example", "https://xn--bcher-kva.example"),  # as a browser writes it (punycode)
    ("https://straße.de", "https://xn--strae-oqa.de"),  # UTS #46 as browsers (IDNA 2003 made it strasse.de)
])
def test_the_public_url_is_the_origin_a_browser_sends(given: str, origin: str) -> None:
    """Browsers leave the default port out of ``Origin``: with ":443" kept, every login and change was
    refused as coming from another site."""
    assert parse_config({"web": {"public_url": given}}).web.public_url == origin


@pytest.mark.parametrize("given", ["https://bot.example.org/cortex", "https://bot.example.org/?a=1",
                                   "https://me@bot.example.org", "https://bot.example.org:port", "https://"])
def test_a_public_url_the_page_cannot_be_served_at_is_refused(given: str) -> None:
    with pytest.raises(ConfigError, match="public_url"):
        parse_config({"web": {"public_url": given}})


@pytest.mark.parametrize(("given", "compared"), [
    (["Bot.Example.org."], ["bot.example.org"]), (["Bücher.example"], ["xn--bcher-kva.example"]),
    (["192.168.1.5", "::1", "[0:0::1]"], ["192.168.1.5", "[::1]", "[::1]"]), (["*"], ["*"]), ([], []),
])
def test_allowed_hosts_are_kept_as_the_host_header_is_compared(given: list[str], compared: list[str]) -> None:
    assert parse_config({"web": {"allowed_hosts": given}}).web.allowed_hosts == compared


@pytest.mark.parametrize("entry", ["http://x", "a b", "bot.lan:8080", "bot.lan/page", "", " bot.lan", "[::zz]",
                                   "x" * 254, "ann@bot.lan"])
def test_a_bad_allowed_hosts_entry_is_an_error_naming_it(entry: str) -> None:
    with pytest.raises(ConfigError, match=r"\[web\] key 'allowed_hosts': " + re.escape(repr(entry[:60]))):
        parse_config({"web": {"allowed_hosts": ["bot.lan", entry]}})


@pytest.mark.parametrize(("key", "given", "fix"), [
    ("host", "http://0.0.0.0", "not a URL"), ("host", "localhost:8080", r"the port in \[web\] port"),
    ("metrics_host", "https://bot.example.org/", "not a URL"),
    ("metrics_host", "127.0.0.1:9108", r"the port in \[web\] metrics_port"), ("host", "bot lan", "not a host name"),
])
def test_a_listen_address_with_a_scheme_or_a_port_is_an_error_naming_the_key(key: str, given: str, fix: str) -> None:
    """A URL or host:port in [web] host passed the config and doctor; the start then failed to bind (after a
    warning that "http://0.0.0.0" listened on every address)."""
    with pytest.raises(ConfigError, match=rf"\[web\] key '{key}': .*{fix}"):
        parse_config({"web": {key: given, "metrics_port": 9108}})
    for fine in ("127.0.0.1", "0.0.0.0", "::", "::1", "localhost", "bot.lan"):
        assert getattr(parse_config({"web": {key: fine, "metrics_port": 9108}}).web, key) == fine


def test_allowed_hosts_holds_at_most_100_names() -> None:
    parse_config({"web": {"allowed_hosts": [f"h{n}.lan" for n in range(100)]}})
    with pytest.raises(ConfigError, match=r"allowed_hosts': at most 100 names \(got 101\)"):
        parse_config({"web": {"allowed_hosts": [f"h{n}.lan" for n in range(101)]}})


@pytest.mark.parametrize("kind", ["folder", "broken link"])
def test_a_config_toml_here_that_cannot_be_read_is_an_error_not_the_defaults(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Docker makes a folder of a bind-mounted file that did not exist yet: the bot started on the
    defaults (another model, another database) as if there were no config."""
    from bot.config import resolve_config_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CORTEXBOT_CONFIG", raising=False)
    assert resolve_config_path(None) is None  # nothing here: the defaults
    if kind == "folder":
        (tmp_path / "config.toml").mkdir()
    else:
        (tmp_path / "config.toml").symlink_to(tmp_path / "gone.toml")
    found = resolve_config_path(None)
    assert found is not None
    expected = "cannot read config file config.toml: .*Is a directory" if kind == "folder" else (
        "config file config.toml is a link to .*gone.toml, which does not exist")
    with pytest.raises(ConfigError, match=expected):
        load_config(found)


@pytest.mark.parametrize(("skills", "message"), [
    ({"builtin": ["remember", "serch_memory"]}, "'serch_memory' is no built-in skill (did you mean 'search_memory'?)"),
    ({"disabled": ["remmber"]}, "disabled: 'remmber' names no skill (did you mean 'remember'?)"),
    ({"http": [{"name": "current_time", "description": "d", "url": "http://127.0.0.1:9/t"}]},
     "'current_time': a skill of that name exists already"),
    ({"http": [{"name": "weather", "description": "d", "url": "http://127.0.0.1:9/a"},
               {"name": "Weather", "description": "d", "url": "http://127.0.0.1:9/b"}]},
     "'Weather': a skill of that name exists already"),
    ({"http": [{"name": "lookup", "description": "d", "url": "http://127.0.0.1:9/a",
                "parameters": {"type": "string"}}]},
     "[[skills.http]] #1 key 'parameters': parameters must be an object schema"),
    ({"http": [{"name": "lookup", "description": "d", "url": "http://127.0.0.1:9/a",
                "parameters": {"properties": {"q": {"type": "string"}}}}]},
     "parameters must be an object schema: type = \"object\""),
    ({"http": [{"name": "lookup", "description": "d", "url": "http://127.0.0.1:9/a",
                "parameters": {"type": "object", "properties": {"q": {"$ref": "https://schemas.example/q.json"}}}}]},
     "$ref 'https://schemas.example/q.json' points outside the schema"),
    ({"http": [{"name": "lookup", "description": "d", "url": "http://127.0.0.1:9/a",
                "parameters": {"type": "object", "properties": {"q": {"type": "text"}}}}]},
     "parameters is not a valid JSON schema: 'text' is not valid"),
    ({"http": [{"name": "lookup", "description": "d", "url": "http://127.0.0.1:9/a",
                "headers": {"X-Token": "abc\r\nX-Evil: 1"}}]},
     "the value of header 'X-Token' must be one line"),
    ({"http": [{"name": "lookup", "description": "d", "url": "http://127.0.0.1:9/a",
                "headers_env": {"X Token": "SOME_VAR"}}]},
     "'X Token' is not a header name"),
])
def test_skill_names_in_the_config_are_checked(skills: dict, message: str) -> None:
    """A typo in builtin switched the unlisted built-ins off without a word; a duplicate http skill, or one
    named like a built-in, was dropped silently."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"skills": skills})


def test_disabled_takes_any_case_and_names_it_cannot_check() -> None:
    from bot.config import BUILTIN_SKILLS
    from cortex.skills.base import SkillInfo
    from cortex.skills.policy import SkillPolicy

    config = parse_config({"skills": {"disabled": ["Weather", "some_mcp_tool", "alpha/extra", "get_current_time"],
                                      "http": [{"name": "weather", "description": "d", "url": "http://127.0.0.1:9"}],
                                      "mcp": [{"name": "alpha", "command": ["true"]}]}})
    policy = SkillPolicy(config.skills, storage=None)  # type: ignore[arg-type]  # default() reads no storage
    assert not policy.default(SkillInfo("weather", "d", {}, "http")).enabled  # "Weather" meant it
    assert not policy.default(SkillInfo("extra", "d", {}, "mcp", server="alpha", tool="extra")).enabled
    assert policy.default(SkillInfo("other", "d", {}, "mcp", server="alpha", tool="other")).enabled
    assert parse_config({}).skills.builtin == list(BUILTIN_SKILLS)
    with pytest.raises(ConfigError, match="names a tool of the MCP server 'time', which"):
        parse_config({"skills": {"disabled": ["time/current_time"], "mcp": [{"name": "alpha", "command": ["x"]}]}})


@pytest.mark.parametrize(("raw", "line"), [
    ({"skills": {"timezone": "Mars/Base"}},
     "[skills] key 'timezone': no such time zone: use an IANA name like Europe/Berlin"),
    ({"skills": {"builtin": ["remembr"]}}, "- [skills]: builtin: 'remembr' is no built-in skill"),
    ({"skills": {"http": [{"name": "w", "description": "d", "url": "http://127.0.0.1:9/", "metod": "GET"}]}},
     "- unknown [[skills.http]] #1 key 'metod': remove it or fix the spelling (did you mean 'method'?)"),
    ({"skills": {"mcp": [{"name": "m", "command": ["x"]}, {"name": "n"}]}},
     "[[skills.mcp]] 'n': neither command nor url is set: set command (a stdio server) or url (an HTTP one)"),
    ({"skills": {"mcp": [{"name": "n", "command": ["x"], "url": "http://127.0.0.1:9/mcp"}]}},
     "[[skills.mcp]] 'n': both command and url are set"),
])
def test_a_problem_deep_in_a_section_is_named_as_the_toml_reads(raw: dict, line: str) -> None:
    """A time zone current_time cannot know passed (every call then failed); a typo in an [[skills.http]]
    table was "[skills] key 'http.0.metod'", a bad builtin name "key 'skills' at the top level", and an MCP
    server with neither command nor url was told to "set either …, not both"."""
    with pytest.raises(ConfigError) as caught:
        parse_config(raw)
    assert line in str(caught.value)


@pytest.mark.parametrize(("raw", "secret"), [
    ({"llm": {"api_key_env": "sk-ant-api03-SECRETKEY1234567890"}}, "SECRETKEY"),
    ({"discord": {"enabled": True, "token_env": "MTEx.SECRET.token"}}, "MTEx"),
    ({"matrix": {"enabled": True, "homeserver": "https://m.org", "user_id": "@b:m.org",
                 "password_env": "correct horse battery staple"}}, "horse"),
    ({"memory": {"embedder_api_key_env": "sk-proj-EMBEDSECRET"}}, "EMBEDSECRET"),
    ({"storage": {"password_env": "pg-Secret-pass"}}, "pg-Secret"),
    ({"skills": {"http": [{"name": "files", "description": "d", "url": "https://x.org/{q}",
                           "headers_env": {"Authorization": "Bearer SECRET-VALUE"}}]}}, "SECRET-VALUE"),
    ({"skills": {"mcp": [{"name": "files", "command": ["x"], "env_from": {"TOKEN": "ghp-SECRET"}}]}}, "ghp-"),
])
def test_a_secret_pasted_where_a_variable_name_belongs_is_refused_and_never_repeated(raw: dict, secret: str) -> None:
    """Every such key printed its value back (at start, in doctor, in the adapters' messages): a secret pasted
    in went to the terminal and the logs."""
    message = _error(raw)
    assert "environment variable" in message and "the secret itself" in message and secret not in message


@pytest.mark.parametrize("token", [
    "syt_Y29ydGV4_lKvwjxjMMqqMJkPwMJTx_3O7cR0",  # Synapse's access tokens (a valid identifier all the same)
    "syr_Y29ydGV4_lKvwjxjMMqqMJkPwMJTx_3O7cR0",  # … and its refresh tokens
    "mat_Qx7kLm2pV9rT4wZ8nB3cY6dF1gH5jK0s",  # Matrix Authentication Service's
    "ghp_16C7e42F292c6912E7710c838347Ae178B4a",  # GitHub's (an MCP server's env_from)
    "github_pat_11ABCDEFG0123456789_abcdefghijKLMNOPqrstuvwxyz0123456789",
    "xoxb_not_slack_but_Ab3dE6gH9jK2mN5pQ8sT",
    "Ab9CdEf0123456789GhIjKlMn",  # a key of letters and digits, no prefix
    "a3f9c2e1b4d5f6a7b8c9d0e1f2a3b4c5",  # lower-case hex
    # random parts of letters alone after a prefix (they passed as names at first)
    "syt_YQ_fPKPvoytculuYLtpvgIN_LZMfpo", "ghp_IhvePHdnbzNlfMKmIbxJvwLqkIhuRjxyEWdb",
    "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",  # Hugging Face's
])
def test_a_token_that_is_also_a_variable_name_is_refused_and_never_repeated(token: str) -> None:
    """A Matrix access token pasted into access_token_env ("syt_…" holds only letters, digits and _) passed as a
    variable's name, and the start printed it: "[matrix] needs a password or an access token: set $syt_…"."""
    for raw in ({"matrix": {**MATRIX_ON, "homeserver": "https://m.org", "password_env": "", "access_token_env": token}},
                {"llm": {"api_key_env": token}},
                {"skills": {"mcp": [{"name": "files", "command": ["x"], "env_from": {"TOKEN": token}}]}}):
        message = _error(raw)
        assert "the secret itself" in message and token not in message and token[6:14] not in message, message


@pytest.mark.parametrize("name", ["DISCORD_TOKEN", "MATRIX_PASSWORD", "OPENAI_API_KEY2", "CortexMatrixToken",
                                  "cortex_matrix_token", "K8S_MATRIX_TOKEN", "MY_BOT_1_TOKEN", "AzureOpenAIKey",
                                  "CortexBot2MatrixAccessToken", "MyCortexBotMatrixAccessTokenForExampleOrg",
                                  "github_pat_for_the_bot", "sk_live_key", "BOT_V2_TOKEN_2024",
                                  "MATRIX_ACCESS_TOKEN_FOR_THE_CORTEX_BOT_ON_EXAMPLE_ORG",
                                  # a code or a number in a name, a prefix's look (refused as tokens at first)
                                  "DISCORD_TOKEN_3F2A9C1B7E4D5A60", "github_pat_for_mcp_server_2", "Bot1Discord2Token",
                                  "TOKEN_FOR_BOT_V2_2024_01_05", "AWS_S3_BUCKET_2024_V2"])
def test_variable_names_as_people_write_them_are_taken(name: str) -> None:
    assert parse_config({"llm": {"api_key_env": name}}).llm.key_env_name == name


@pytest.mark.parametrize("written", ["$OPENAI_API_KEY", "${OPENAI_API_KEY}"])
def test_a_variable_written_as_a_shell_would_is_named_as_it_should_be(written: str) -> None:
    """`api_key_env = "$OPENAI_API_KEY"`, as in a shell, was told "if it is the secret itself, remove it from the
    file": a fix for another mistake."""
    message = _error({"llm": {"api_key_env": written}})
    assert ("[llm] key 'api_key_env': write the environment variable's name alone, as OPENAI_API_KEY: the bot reads "
            "the variable itself") in message, message
    assert "the secret itself" in _error({"llm": {"api_key_env": "$sk-ant-api03-SECRETKEY1234567890"}})


def test_matrix_without_its_secrets_names_each_variable_that_would_do() -> None:
    """With both password_env and access_token_env named and neither set, the line named only the password's."""
    from adapters.matrix import MatrixError, read_secrets

    config = parse_config({"matrix": {**MATRIX_ON, "homeserver": "https://m.org", "access_token_env": "MX_TOKEN"}})
    with pytest.raises(MatrixError) as caught:
        read_secrets(config.matrix, {})
    assert str(caught.value) == ("[matrix] needs a password or an access token: set $MX_PW (the account's password) "
                                 "or $MX_TOKEN (an access token)")
    assert read_secrets(config.matrix, {"MX_TOKEN": "t"}) == ("", "t")


@pytest.mark.parametrize("password", ["hunter2", "Tr0ub4dor3", "correcthorsebatterystaple"])
def test_a_password_written_where_its_variable_belongs_is_not_repeated_when_unset(password: str) -> None:
    """A password is any word its owner chose, so one pasted into password_env passes as a variable's name; the start
    then printed it to the terminal and the log: "[matrix] needs a password or an access token: set $hunter2"."""
    from adapters.matrix import MatrixError, read_secrets

    matrix = parse_config({"matrix": {**MATRIX_ON, "homeserver": "https://m.org", "password_env": password}}).matrix
    with pytest.raises(MatrixError) as caught:
        read_secrets(matrix, {})
    assert password not in str(caught.value) and "the variable [matrix] password_env names" in str(caught.value)
    storage = parse_config({"storage": {"url": "postgresql://bot@db/cortex", "password_env": password}}).storage
    with pytest.raises(ConfigError) as refused:
        storage.resolve({})
    assert password not in str(refused.value) and "[storage] password_env" in str(refused.value)
    with pytest.raises(ConfigError, match=re.escape("set $CB_DB_PASSWORD to the database's password")):
        parse_config({"storage": {"url": "postgresql://bot@db/cortex", "password_env": "CB_DB_PASSWORD"}}
                     ).storage.resolve({})


def test_an_empty_discord_token_variable_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters.discord import read_token

    config = parse_config({"discord": {"enabled": True, "token_env": ""}})
    with pytest.raises(RuntimeError, match="token_env is empty"):
        read_token(config.discord)
    monkeypatch.delenv("CB_TEST_UNSET_TOKEN", raising=False)  # (a newcomer's first start: the variable never set)
    config = parse_config({"discord": {"enabled": True, "token_env": "CB_TEST_UNSET_TOKEN"}})
    with pytest.raises(RuntimeError, match=re.escape(
            "[discord] is enabled but $CB_TEST_UNSET_TOKEN holds no bot token: set it to the bot's token (developer "
            "portal: your application, Bot, Reset Token), or name the variable that holds it with [discord] "
            "token_env")):
        read_token(config.discord)


def test_persona_names_written_two_ways_are_one_name() -> None:
    """"Zoë" precomposed and "Zoë" with a combining diaeresis passed as two personas; the store keeps one, and the
    second one's soul was dropped without a word."""
    message = _error({"personas": [{"name": "Zo\u00eb"}, {"name": "Zoe\u0308"}]})
    assert "persona names must be unique" in message
    assert "must be unique" in _error({"personas": [{"name": "Cora"}, {"name": "CORA"}]})
    config = parse_config({"personas": [{"name": "Zo\u00eb"}], "bot": {"default_persona": "zoe\u0308"}})
    assert config.bot.default_persona == "Zo\u00eb"  # as its entry writes it: every lookup finds it


def test_a_skill_schema_with_local_references_and_one_line_headers_is_taken() -> None:
    schema = {"type": "object", "$defs": {"city": {"type": "string", "maxLength": 80}},
              "properties": {"city": {"$ref": "#/$defs/city"}, "$ref": {"type": "string"}}}
    config = parse_config({"skills": {"http": [{"name": "weather", "description": "d", "url": "http://127.0.0.1:9/a",
                                                "parameters": schema, "headers": {"Accept": "application/json"},
                                                "headers_env": {"X-Api-Key": "WEATHER_KEY"}}]}})
    assert config.skills.http[0].parameters == schema  # a property named "$ref" is no reference


@pytest.mark.parametrize(("toml", "message"), [
    ('llm = 5\n', "[llm] must be a table: [llm] on a line of its own, its keys below it (not a number)"),
    ('[[llm]]\nmodel = "x"\n', "[llm] must be a table: [llm] on a line of its own, its keys below it "
                               "(not [[llm]], which makes a list)"),
    ('[[personas]]\nname = "Cora"\n[[skills.http]]\n', None),
    ('web = "yes"\n', "[web] must be a table: [web] on a line of its own, its keys below it (not a text)"),
])
def test_a_section_written_as_a_value_or_a_list_says_how_to_write_it(tmp_path: Path, toml: str,
                                                                     message: str | None) -> None:
    """pydantic's "Input should be a valid dictionary or instance of LLMConfig" named a class of the code."""
    path = tmp_path / "config.toml"
    path.write_text(toml, encoding="utf-8")
    if message is None:  # an empty [[skills.http]] entry: what it lacks is named, no class
        with pytest.raises(ConfigError) as refused:
            load_config(path)
        assert "missing required" in str(refused.value) and "Config" not in str(refused.value)
        return
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert message in str(refused.value) and "Config" not in str(refused.value).removeprefix("config")


@pytest.mark.parametrize(("url", "wanted"), [
    ("postgresql://cortex@db.example.org:99999/cortex", "port 99999 is out of range: a port is 1 to 65535"),
    ("postgresql://cortex@db.example.org:0/cortex", "port 0 is out of range: a port is 1 to 65535"),
    ("postgresql://cortex@db.example.org:54x2/cortex", "port is not a number"),
])
def test_a_storage_urls_bad_port_is_named_as_it_is(url: str, wanted: str) -> None:
    """A port over 65535 was called "not a number"; port 0 went through to a connection that cannot work."""
    assert wanted in _error({"storage": {"url": url}})


@pytest.mark.parametrize("url", ["postgresql://cortex@db.example.org:5432", "postgresql://cortex@db.example.org/",
                                 "postgres://cortex@db.example.org:5432/?sslmode=require"])
def test_a_postgresql_url_without_a_database_is_refused(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a database name PostgreSQL connects to the one named like the user (often ``postgres``): the
    bot's tables, or a copy-data, went there."""
    monkeypatch.delenv("PGDATABASE", raising=False)
    assert "names no database: write postgresql://user@host:5432/dbname" in _error({"storage": {"url": url}})


def test_an_unencoded_at_in_a_postgresql_password_is_named() -> None:
    """`postgresql://u:p@ss@127.0.0.1/db` failed at start with a DNS error for a host that looked fine."""
    error = _error({"storage": {"url": "postgresql://u:p@ss@127.0.0.1:5432/db"}})
    assert "holds more than one @: write an @ in the user name or password as %40" in error
    assert "p@ss" not in error and "ss@127" not in error  # (the password is not shown)
    from bot.config import check_storage_url  # (as a URL from [storage] url_env is checked)

    assert check_storage_url("postgresql://u:p%40ss@127.0.0.1:5432/db") == "postgresql://u:p%40ss@127.0.0.1:5432/db"
    with pytest.raises(ValueError, match="more than one @"):
        check_storage_url("postgresql://u:p@ss@127.0.0.1:5432/db")


def test_a_postgresql_url_may_leave_the_database_to_pgdatabase(monkeypatch: pytest.MonkeyPatch) -> None:
    """libpq's variable names the database as asyncpg reads it; the URL then has no path at all (with "/" asyncpg
    would take an empty name instead)."""
    monkeypatch.setenv("PGDATABASE", "cortex")
    assert parse_config({"storage": {"url": "postgresql://cortex@db.example.org:5432/"}}).storage.url == (
        "postgresql://cortex@db.example.org:5432")
    monkeypatch.setenv("PGDATABASE", " ")
    assert "names no database" in _error({"storage": {"url": "postgresql://cortex@db.example.org:5432/"}})


@pytest.mark.parametrize(("url", "taken"), [
    ("SQLITE:////var/lib/cortex/bot.db", "sqlite:////var/lib/cortex/bot.db"),
    ("PostgreSQL://cortex@db.example.org/cortex", "postgresql://cortex@db.example.org/cortex"),
    ("postgresql+asyncpg://cortex@db.example.org/cortex", "postgresql://cortex@db.example.org/cortex"),
    ("postgresql://cortex@db.example.org/?dbname=bot", "postgresql://cortex@db.example.org?dbname=bot"),
    ("postgresql:///?host=/tmp&database=bot", "postgresql://?host=/tmp&database=bot"),
])
def test_a_storage_urls_scheme_is_read_as_urls_are(url: str, taken: str) -> None:
    """A scheme is case-insensitive, and SQLAlchemy's driver suffix names the driver the bot uses anyway:
    both got "use sqlite:////… or postgresql://…", as if the URL were of another kind."""
    assert parse_config({"storage": {"url": url}}).storage.url == taken


@pytest.mark.parametrize("url", ["sqlite:///bot.db?mode=ro", "sqlite:////var/lib/cortex/bot.db?cache=shared"])
def test_a_sqlite_url_with_options_is_refused(url: str) -> None:
    """``?mode=ro`` became part of the file name: a new, empty database called "bot.db?mode=ro"."""
    message = _error({"storage": {"url": url}})
    assert "takes no options" in message and "sqlite:////var/lib/cortex/bot.db" in message


@pytest.mark.parametrize("url", ["postgresql://cortex:hunter2@db.example.org:5432/cortex",
                                 "postgresql://cortex:hunter2@db.example.org:99999/cortex",
                                 "postgres://cortex:hunter2@db.example.org/cortex?sslmode=nope",
                                 "postgresql://cortex:hunt%40er2@db:54x/cortex",
                                 "postgresql://cortex:hunt@er2@db.example.org/cortex"])
def test_a_password_in_a_refused_storage_url_is_never_repeated(url: str) -> None:
    """The config file's URL was printed back in the refusal ("got 'postgresql://cortex:hunter2@…'"), the very
    password the message says does not belong there."""
    message = _error({"storage": {"url": url}})
    assert "[storage] key 'url'" in message and "hunt" not in message


def test_a_password_in_another_refused_url_is_never_repeated() -> None:
    message = _error({"llm": {"provider": "openai", "base_url": "http://me:hunter2@localhost:port/v1"}})
    assert "[llm] key 'base_url'" in message and "hunter2" not in message
    assert "holds a user name or password" in message and "localhost" not in message  # (the URL is not shown at all)


@pytest.mark.parametrize("url", ["postgresql://cortex@db.example.org/?dbname=",
                                 "postgresql://cortex@db.example.org/?application_name=dbname=x"])
def test_a_postgresql_url_naming_its_database_only_in_appearance_is_refused(url: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """asyncpg skips a blank ?dbname= and reads no other parameter's value as the database's name."""
    monkeypatch.delenv("PGDATABASE", raising=False)
    assert "names no database" in _error({"storage": {"url": url}})


@pytest.mark.parametrize(("url", "taken"), [
    ("postgresql://cortex@db.example.org/?database=bot", "postgresql://cortex@db.example.org?database=bot"),
    ("postgresql://?host=/tmp&database=bot", "postgresql://?host=/tmp&database=bot"),
])
def test_a_postgresql_url_naming_its_database_as_asyncpg_reads_it_is_taken(url: str, taken: str) -> None:
    """``?database=`` is asyncpg's own name for ``?dbname=``; either is read only after no path at all."""
    assert parse_config({"storage": {"url": url}}).storage.url == taken


def test_a_url_env_not_set_or_empty_says_which() -> None:
    """An unset variable was reported as "empty": the operator looked for an empty value that was not there."""
    config = parse_config({"storage": {"url_env": "CB_TEST_DB_URL"}})
    with pytest.raises(ConfigError, match="names CB_TEST_DB_URL, but that environment variable is not set"):
        config.storage.resolve({})
    with pytest.raises(ConfigError, match="names CB_TEST_DB_URL, but that environment variable is empty"):
        config.storage.resolve({"CB_TEST_DB_URL": " "})


@pytest.mark.parametrize(("entry", "said"), [
    ("bob", "'bob' is not a full Matrix user id: write it like @ann:example.org"),
    ("@bob", "'@bob' is not a full Matrix user id"),
    ("matrix:bob", "'matrix:bob' is not a full Matrix user id"),
])
def test_matrix_admin_ids_are_full_user_ids(entry: str, said: str) -> None:
    """Compared as written with each sender's id: "bob" or the access lists' "matrix:@boss:example.org" passed
    and made nobody an admin, without a word. The prefixed form is read as the id it names."""
    assert f"[matrix] key 'admin_ids': {said}" in _error({"matrix": {"admin_ids": ["@ann:example.org", entry]}})
    config = parse_config({"matrix": {"admin_ids": ["matrix:@boss:example.org", " @ann:[::1]:8448"]}})
    assert config.matrix.admin_ids == ["@boss:example.org", "@ann:[::1]:8448"]


@pytest.mark.parametrize(("entry", "said"), [
    ("https://example.org", "'https://example.org' is not a server name: write it as a user id ends, e.g. "
                            "example.org (no https:// and no /)"),
    ("example.org/", "'example.org/' is not a server name: write it as a user id ends, e.g. example.org"),
    ("@ann:example.org", "'@ann:example.org' is not a server name"),
])
def test_matrix_invite_servers_are_server_names(entry: str, said: str) -> None:
    """An inviter's server is compared with each entry: a URL matched nobody, and every invite was declined."""
    assert f"[matrix] key 'invite_servers': {said}" in _error({"matrix": {"invite_servers": [entry]}})
    config = parse_config({"matrix": {"invite_servers": ["example.org", "matrix:other.net", "localhost:8448"]}})
    assert config.matrix.invite_servers == ["example.org", "other.net", "localhost:8448"]


def test_discord_admin_ids_are_numbers_the_access_lists_form_too() -> None:
    """As the access lists write them ("discord:1234") or quoted, a Discord id is read as its number; anything
    else is refused by name (pydantic's "Input should be a valid integer" said nothing of what to write)."""
    config = parse_config({"discord": {"admin_ids": [12, "discord:345678901234567890", "34"]}})
    assert config.discord.admin_ids == [12, 345678901234567890, 34]
    for entry in ("@ann", "discord:ann", 0):
        assert (f"[discord] key 'admin_ids': {entry!r} is not a Discord user id: write the number"
                in _error({"discord": {"admin_ids": [entry]}}))


@pytest.mark.parametrize(("field", "entry", "said"), [
    ("deny_channels", "matrix:#general:example.org", "'matrix:#general:example.org' in deny_channels: that is the "
     "room's alias, which messages do not carry: write its id, matrix:!…:example.org (Element: Room settings → "
     "Advanced → Internal room ID)"),
    ("allow_servers", "matrix:#general:example.org", "that is the room's alias"),
    ("always_answer_channels", "matrix:general", "'matrix:general' in always_answer_channels: a Matrix room is "
     "written with its id, e.g. matrix:!AbCdEf:example.org (Element: Room settings → Advanced → Internal room ID)"),
    ("deny_users", "matrix:troll:example.org", "'matrix:troll:example.org' in deny_users: a Matrix user is written "
     "in full, e.g. matrix:@ann:example.org (an @, the account's name, a colon and its server)"),
    ("allow_bots", "matrix:@bot", "a Matrix user is written in full"),
    ("deny_servers", "matrix:https://example.org", "'matrix:https://example.org' in deny_servers: a Matrix entry "
     "here is a room's id (matrix:!AbCdEf:example.org) or a homeserver's name as user ids end (matrix:example.org)"),
])
def test_matrix_access_entries_that_can_match_nobody_are_refused(field: str, entry: str, said: str) -> None:
    """The lists checked the platform alone: a room's alias (as Element shows it), a user without its @ and a
    server written as a URL were taken, and matched nobody: the troll was answered in the "denied" room."""
    assert said in _error({"access": {field: [entry]}})


def test_access_entries_are_taken_without_the_spaces_around_them() -> None:
    """``"matrix:@spammer:example.org "`` (a trailing space) was taken as written and matched nobody."""
    from bot.policy import Inbound, refusal
    from bot.ports import IncomingMessage

    access = parse_config({"access": {
        "deny_users": ["matrix:@spammer:example.org ", " discord:12"],
        "deny_channels": ["matrix:!AbCdEf:example.org", "matrix:!v12RoomIdWithoutServer-_x"],
        "allow_servers": ["matrix:example.org", "matrix:!AbCdEf:example.org", "matrix:[::1]:8448"],
        "allow_users": ["console: Ann "]}}).access
    assert access.deny_users == ["matrix:@spammer:example.org", "discord:12"]
    assert access.allow_users == ["console:Ann"]
    msg = IncomingMessage(platform="matrix", channel_id="!Other:example.org", author_id="@spammer:example.org",
                          author_name="x", text="!help", server_id="!Other:example.org")
    assert refusal(Inbound(msg), access, is_command=True) == "denied user or channel"


def test_a_matrix_role_is_a_whole_power_level_and_no_deny_lists() -> None:
    """``matrix:power:mod`` matched nobody; a listed level is held from that level up, which in a deny list would
    keep out the room's admins first (the allow list does what was meant)."""
    assert ("[access] key 'allow_roles': 'matrix:power:mod' in allow_roles: a Matrix role is a power level, written "
            "matrix:power:N with N a whole number" in _error({"access": {"allow_roles": ["matrix:power:mod"]}}))
    assert "'matrix:admin' in allow_roles: a Matrix role is a power level" in _error(
        {"access": {"allow_roles": ["matrix:admin"]}})
    assert ("'matrix:power:0' in deny_roles: matrix:power:N holds from level N up, and would keep out the room's "
            "admins; to keep out those below a level, list it in allow_roles"
            in _error({"access": {"deny_roles": ["matrix:power:0"]}}))
    access = parse_config({"access": {"allow_roles": ["matrix:power:50", "matrix:power:-1", "discord:5"],
                                      "deny_roles": ["discord:6"]}}).access
    assert access.allow_roles == ["matrix:power:50", "matrix:power:-1", "discord:5"]


@pytest.mark.parametrize("value", ["a" * 60_000, "?" * 60_000, "a://:" * 12_000, "ab://u:" * 9_000])
def test_a_huge_refused_value_is_refused_at_once(value: str) -> None:
    """The refusal's secret hiding tried its URL patterns from every letter (every "?") of a long word to the
    word's end: a 100,000-character value in a number's place took 15 s to refuse, a "?" run of that size a minute."""
    started = time.monotonic()
    message = _error({"llm": {"max_retries": value}})
    assert "[llm] key 'max_retries'" in message
    assert time.monotonic() - started < 2


@settings(max_examples=60, deadline=None)
@given(before=st.text(max_size=30), after=st.text(max_size=30), user=st.from_regex(r"[a-z]{1,8}", fullmatch=True),
       password=st.from_regex(r"[A-Z0-9]{6,12}", fullmatch=True),
       scheme=st.sampled_from(["postgresql", "https", "x" * 40]))
def test_a_password_is_hidden_wherever_its_url_stands(before: str, after: str, user: str, password: str,
                                                      scheme: str) -> None:
    """The patterns made linear (a scheme of at most 32 letters is matched, a password up to its word's last "@")
    still hide a password before the host, whatever stands around the URL and however long its scheme."""
    text = f"{before} {scheme}://{user}:{password}@host/db?x=1 {after}"
    assert password not in hide_url_passwords(text).replace(before, "").replace(after, "")


@pytest.mark.parametrize(("raw", "where"), [
    ({"personas": [{"name": "Cora " * 20_000}]}, "[[personas]] #1 key 'name': String should have at most"),
    ({"llm": {"model": ["x" * 30_000] * 3}}, "[llm] key 'model'"),
    ({"matrix": {"admin_ids": ["b" * 50_000]}}, "[matrix] key 'admin_ids'"),
])
def test_a_huge_refused_value_is_shown_in_part(raw: dict, where: str) -> None:
    """Each problem repeated the refused value whole: a persona's prompt pasted as its name made a refusal of
    100,000 characters to say that a name holds at most 80."""
    message = _error(raw)
    assert where in message and "characters in all)" in message
    assert len(message) < 1100
