"""The embedding tables of ``weight-only`` (:mod:`mograph.passes.quant.weight_only`, ``--embedding-precision``):
which float initializers are tables read by ``Gather`` (and maybe by a tied LM head), the check that a head is
its table transposed, and a table's RTN blocks along the hidden axis."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from mograph.passes.quant import _blockwise as bw
from mograph.passes.quant._wo_layers import _FLOAT_DTYPES, _Layer, gemm_alpha

from mograph import _spill

__all__ = ["_Table", "_same_table", "find_tables", "quantize_table"]


@dataclass
class _Table:
    """An embedding table: its initializer, the Gathers reading it, and the LM head tied to it (if any; ``same``:
    it reads this very initializer)."""

    value: ir.Value
    gathers: list[ir.Node]
    rows: int
    hidden: int
    head: _Layer | None
    same: bool


def _same_table(layer: _Layer, table: ir.TensorProtocol) -> bool:
    """Whether ``layer``'s weight ``[hidden, rows]`` is the embedding ``table`` ``[rows, hidden]`` transposed:
    ``np.array_equal(layer.weight.T, table)``, a slice of rows at a time, stopping at the first slice that
    differs (an untied head differs in its first rows).  Both are memory maps of the weights, which the pass
    has forgotten by then: the whole compare held both back in memory with a boolean temporary, the
    int4 pass's peak on a decoder with a large vocabulary; the pages read are forgotten again."""
    arr = table.numpy()
    rows = arr.shape[0]
    step = max(1, (1 << 22) // max(arr.shape[1], 1))
    same = True
    try:
        for lo in range(0, rows, step):
            if not np.array_equal(layer.weight[:, lo:lo + step].T, arr[lo:lo + step]):
                same = False
                break
    finally:
        _spill.release_pages(table)
        _spill.release_pages(layer.node.inputs[1].const_value if len(layer.node.inputs) > 1
                             and layer.node.inputs[1] is not None else None)
    return same


def find_tables(model: ir.Model, layers: list[_Layer]) -> list[_Table]:
    """Float 2-D initializers read only by default-domain ``Gather`` (axis 0, as the data) and, maybe, by a
    weight layer whose ``[K, N]`` weight is the table transposed (a tied LM head: the same initializer
    through ``Gemm(transB=1)``, or an equal copy, as TorchScript exports write it)."""
    by_weight: dict[int, list[_Layer]] = {}
    for layer in layers:
        if layer.node.inputs[1] is not None:
            by_weight.setdefault(id(layer.node.inputs[1]), []).append(layer)
    out: list[_Table] = []
    for value in list(model.graph.initializers.values()):
        if value.dtype not in _FLOAT_DTYPES or value.const_value is None or value.const_value.shape.rank() != 2 \
                or value.is_graph_output():
            continue
        uses = list(value.uses())
        gathers = [u.node for u in uses if u.node.op_type == "Gather" and u.node.domain in ("", "ai.onnx")
                   and u.idx == 0 and u.node.graph is model.graph
                   and int(u.node.attributes["axis"].as_int() if "axis" in u.node.attributes else 0) == 0]
        others = [u for u in uses if u.node not in gathers]
        if not gathers or any(id(u.node) not in {id(la.node) for la in by_weight.get(id(value), [])}
                              for u in others):
            continue
        rows, hidden = (int(d) for d in value.const_value.shape.numpy())
        head = None
        same = False
        if others:  # the same initializer: Gemm(transB=1) / MatMul reading it as its weight
            heads = by_weight[id(value)]
            if len(heads) == 1 and heads[0].weight.shape == (hidden, rows):
                head, same = heads[0], True
            else:
                continue
        else:
            for layer in layers:
                if layer.weight.shape == (hidden, rows) and layer.bias is None and gemm_alpha(layer) == 1.0 \
                        and _same_table(layer, value.const_value):
                    head = layer
                    break
        out.append(_Table(value, gathers, rows, hidden, head, same))
    return out


def quantize_table(model: ir.Model, table: _Table, spec: bw.QuantSpec) -> tuple[ir.Value, ir.Value, ir.Value]:
    """RTN block-wise along the hidden axis, a slice of rows at a time (the float temporaries stay one
    slice large, however long the vocabulary), blocks as ``spec`` says."""
    arr = table.value.const_value.numpy()  # type: ignore[union-attr]
    datas, scales, zeros = [], [], []
    step = max(1, (1 << 22) // max(table.hidden, 1))
    for lo in range(0, table.rows, step):
        q = bw.rtn(np.asarray(arr[lo:lo + step], np.float32).T, spec)
        datas.append(bw.pack_nbits(q))
        scales.append(np.ascontiguousarray(q.scale.T))
        zeros.append(np.ascontiguousarray(q.zero.T).astype(np.uint8))
    _spill.release_pages(table.value.const_value)  # type: ignore[arg-type]
    from mograph.irutil import add_initializer

    base = (table.value.name or "embedding").replace("/", "_")
    dtype = table.value.dtype.numpy()  # type: ignore[union-attr]
    return (add_initializer(model.graph, f"{base}_q{spec.bits}", np.concatenate(datas)),
            add_initializer(model.graph, f"{base}_scales", np.concatenate(scales).astype(dtype)),
            add_initializer(model.graph, f"{base}_zeros", np.concatenate(zeros)))
