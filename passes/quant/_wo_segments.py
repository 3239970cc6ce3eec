"""Sequential GPTQ of ``weight-only`` (:mod:`mograph.passes.quant.weight_only`): the model cut at each layer
group and run one segment at a time per calibration sample (:class:`_Segments`), and the Hessian factor of a
group's input over those runs (:func:`_hessian_factor`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.quant import _blockwise as bw

__all__ = ["_Segments", "_hessian_factor", "_reads"]


def _reads(node: ir.Node) -> list[ir.Value]:
    """The values ``node`` reads, its subgraphs' reads of outer values included."""
    out = [v for v in node.inputs if v is not None]
    for attr in node.attributes.values():
        graphs = [attr.value] if attr.type == ir.AttributeType.GRAPH else (
            list(attr.value) if attr.type == ir.AttributeType.GRAPHS else [])
        for g in graphs:
            for inner in g:
                out.extend(_reads(inner))
    return out


class _Segments:
    """``model``'s top-level nodes cut before the node indices ``cuts``; segment ``i`` holds the nodes
    ``[cuts[i-1], cuts[i])`` and turns the values live across cut ``i-1`` into those live across cut ``i``.

    A value is live across a cut when a node before it (or the graph's inputs) makes it and a node from
    the cut up to the last cut reads it; the input of the group cut at ``cuts[j]`` counts as read there.
    ``problem`` names why the graph cannot be cut this way (a live value that is not a tensor), else ``""``.
    """

    def __init__(self, model: ir.Model, nodes: list[ir.Node], cuts: list[int]) -> None:
        self.model, self.nodes, self.cuts = model, nodes, cuts
        self.problem = ""
        graph = model.graph
        fed = [v for v in graph.inputs if not v.is_initializer()]
        top = {id(v) for v in fed} | {id(o) for n in nodes for o in n.outputs}
        made: dict[int, int] = {id(v): -1 for v in fed}
        self.by_id: dict[int, ir.Value] = {id(v): v for v in fed}
        for i, n in enumerate(nodes):
            for o in n.outputs:
                made[id(o)] = i
                self.by_id[id(o)] = o
        last = cuts[-1]
        last_read: dict[int, int] = {}
        self.reads: list[list[ir.Value]] = []
        for i, n in enumerate(nodes[:last]):
            rs = _reads(n)
            self.reads.append(rs)
            for v in rs:
                if id(v) in top:
                    last_read[id(v)] = max(last_read.get(id(v), -1), i)
        for node_idx in cuts:  # a group's input is read at its cut (its other layers may lie past the last cut)
            for v in _reads(nodes[node_idx]):
                if id(v) in top:
                    last_read[id(v)] = max(last_read.get(id(v), -1), node_idx)
        self.live: list[list[ir.Value]] = []
        for c in cuts:
            self.live.append([self.by_id[k] for k, r in last_read.items() if made[k] < c <= r])
        for vals in self.live:
            for v in vals:
                if (v.type is not None and not isinstance(v.type, ir.TensorType)) or not v.name:
                    self.problem = f"value {v.name!r} crosses a layer boundary with type {v.type}"
                    return

    def _session(self, i: int, replaced: dict[str, np.ndarray], sample: dict[str, np.ndarray]
                 ) -> tuple[Any, list[str], list[str]]:
        import onnx
        from mograph.passes.quant.calibration import (
            _session,  # noqa: PLC2701 - the module's session factory
            model_folder,
        )

        lo = self.cuts[i - 1] if i else 0
        hi = self.cuts[i]
        seg = self.nodes[lo:hi]
        made = {id(o) for n in seg for o in n.outputs}
        inputs: dict[int, ir.Value] = {}
        inits: dict[str, ir.Value] = {}
        for rs in self.reads[lo:hi]:
            for v in rs:
                if id(v) in made:
                    continue
                if v.is_initializer() or (v.const_value is not None and v.producer() is None
                                          and id(v) not in self.by_id):
                    inits[v.name or ""] = v
                elif id(v) in self.by_id:
                    inputs[id(v)] = v
        live_out = [v for v in self.live[i] if id(v) in made]
        graph = onnx.GraphProto(name=f"segment{i}")
        graph.node.extend(ir.serde.serialize_node(n) for n in seg)
        for v in inputs.values():  # the element type of the values this sample holds (a graph may not record it)
            elem = onnx.helper.np_dtype_to_tensor_dtype(np.asarray(sample[v.name or ""]).dtype)
            graph.input.append(onnx.helper.make_tensor_value_info(v.name or "", elem, None))
        for v in live_out:  # ONNX Runtime infers the output types
            graph.output.append(onnx.helper.make_empty_tensor_value_info(v.name or ""))
        for name, v in inits.items():
            if name in replaced:
                graph.initializer.append(onnx.numpy_helper.from_array(replaced[name], name))
            else:
                tensor = ir.serde.serialize_tensor(v.const_value)  # type: ignore[arg-type]
                tensor.name = name
                graph.initializer.append(tensor)
        proto = onnx.ModelProto(ir_version=self.model.ir_version, graph=graph)
        for domain, version in self.model.opset_imports.items():
            proto.opset_import.append(onnx.helper.make_opsetid(domain, version))
        for f in self.model.functions.values():
            proto.functions.append(ir.serde.serialize_function(f))
        sess = _session(proto, model_folder(self.model))  # a segment too big for one protobuf is spilled
        return sess, [v.name or "" for v in inputs.values()], [v.name or "" for v in live_out]

    def advance(self, i: int, states: list[dict[str, np.ndarray]], replaced: dict[str, np.ndarray],
                source: Any = None) -> tuple[list[dict[str, np.ndarray]], int]:
        """Run segment ``i`` on each sample's values live across the previous cut; return the values live
        across cut ``i`` and the number of runs made.  Segments read the calibration feeds' own inputs: a run
        the model refuses is an :class:`OptionError` naming ``source`` and the sample's inputs."""
        lo = self.cuts[i - 1] if i else 0
        keep = [v.name or "" for v in self.live[i]]
        if lo == self.cuts[i]:
            return [{k: st[k] for k in keep} for st in states], 0
        sess, ins, outs = self._session(i, replaced, states[0])
        new_states = []
        from mograph.passes.quant.calibration import feed_rejected

        fed = {v.name for v in self.model.graph.inputs}
        for n, st in enumerate(states):
            feed = {k: st[k] for k in ins}
            try:
                got = dict(zip(outs, sess.run(outs, feed))) if outs else {}
            except Exception as exc:  # noqa: BLE001 - ORT's own exception types; a sample the model rejects
                if source is None:
                    raise
                raise feed_rejected(exc, {k: v for k, v in st.items() if k in fed}, source, n) from exc
            new_states.append({k: got[k] if k in got else st[k] for k in keep})
        return new_states, len(states) if outs else 0


def _hessian_factor(states: list[dict[str, np.ndarray]], name: str, damp: float, act_order: bool
                    ) -> tuple[np.ndarray, bw.GptqFactor]:
    """``diag H`` and the GPTQ factor of ``H = E[x x^T]`` over the value ``name`` of every state; ``H`` itself
    is given away to the factor (changed in place), so no second ``[K, K]`` copy is made."""
    h: np.ndarray | None = None
    part: np.ndarray | None = None  # each later sample's x^T x, in one buffer made once (not one per sample)
    rows = 0
    with bw.blas_threads(bw.GPTQ_BLAS_THREADS):  # the same sums at any thread count (bw.blas_threads)
        for st in states:
            x = np.asarray(st[name], np.float64)
            x = x.reshape(-1, x.shape[-1])
            if h is None:
                h = x.T @ x
            else:
                if part is None:
                    part = np.empty_like(h)
                np.matmul(x.T, x, out=part)
                h += part  # in place: the same sums as h + x.T @ x
            rows += x.shape[0]
    del part
    assert h is not None
    h /= max(rows, 1)
    return np.diag(h).copy(), bw.gptq_factor(h, damp=damp, act_order=act_order, consume=True)
