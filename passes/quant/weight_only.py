"""``weight-only`` (presets ``int4``, ``w4``): block-wise INT4/INT8 weights for MatMul and Gemm, activations left float.

Every MatMul (and Gemm with ``transA=0``) whose second input is a constant 2-D float weight ``[K, N]``
becomes one ``mograph.WeightOnlyMatMul`` (:mod:`mograph.passes.quant.weight_only_op`): the weight cut
along ``K`` into blocks of ``--block-size`` rows (32, 64 or 128; default 128), one scale and one zero
point per block and output column, codes of ``--bits`` (4 or 8) packed two to a byte at 4 bits.  The
``lower`` step turns it into ``com.microsoft.MatMulNBits`` for ``--target ort`` and into a blocked
``DequantizeLinear`` (opset 21, INT4/UINT4) + ``MatMul`` for ``--target onnx`` / ``tensorrt``.  The op's
function body needs opset 13: an older model is raised to it (:func:`mograph.opset.upgrade_opset`, in the
stats and ``details["opset_upgrade"]``, refused in one line when it cannot be converted), like the Q/DQ passes.

``--algorithm`` (see :mod:`mograph.passes.quant._blockwise` for the math):

- ``rtn``: round to nearest (needs no data);
- ``awq``: activation-aware per-input-channel scaling (folded into a preceding LayerNormalization's
  scale and bias where that is the only reader, else one ``Mul`` in front of the layers sharing the input)
  and an activation-weighted clip search, on the calibration data;
- ``gptq``: Hessian-based error compensation from the layers' calibration inputs, ``--damping``
  (fraction of the mean Hessian diagonal, default 0.1), ``--act-order`` (default yes) and
  ``--sequential`` (default yes: each layer group from the inputs it sees with the groups before it quantized; the
  model is cut at each layer group and run once per calibration sample, the values crossing each cut kept, so a
  135M LLaMA takes 71 s on 2 cores instead of one whole-model run per group and sample); its block ranges
  come from the same activation-weighted clip search;
- ``auto`` (default): ``gptq`` when calibration data is given, else ``rtn``.

Symmetric (``--symmetric``) or asymmetric (default) blocks.  The layers' inputs are observed on the float
model (one pass over the calibration data).

**Precision plan.**  Every candidate gets ``int4``, ``int8`` or ``float`` with a reason, written like the
INT8 plan (:mod:`mograph.passes.quant.plan`; ``--precision-plan-out``, edited back with
``--precision-plan``).  Default rules: weight MatMuls take ``--bits``; the output projection / LM head
(a weight MatMul with no other one downstream) stays float (``--output-projection`` changes that);
normalization and softmax are listed as float — the pass never touches them.  Embedding tables (a float
initializer read only by ``Gather`` on axis 0, and maybe by a tied LM head) are listed as float too, unless
``--embedding-precision int8|bits`` (or the plan's entry for the ``Gather``) quantizes them: RTN blocks of
``--block-size`` along the hidden axis, one ``mograph.BlockQuantizedGather`` per Gather
(:mod:`mograph.passes.quant.gather_block_op`; ``lower`` makes it ``com.microsoft.GatherBlockQuantized``).  The
data layout is ``MatMulNBits``'s, so a table whose LM head is tied to it (the same initializer through
``Gemm(transB=1)``, or an equal copy of its transpose, as TorchScript writes a tied head) shares the head's
codes, scales and zero points when the head is quantized at the same bits without an AWQ input scale: one
copy in the file.  A table that is the float head's own initializer stays float (a quantized copy would add
size); one whose head is an equal float copy is quantized (the head keeps its copy).  A word table read by a
fused ``mograph.EmbedLayerNorm`` (``fuse-embed-layernorm``, BERT's) is quantized too: that node is expanded
back to its Gathers, Adds and ``mograph.LayerNorm`` first, and its small segment and position tables stay float
(:mod:`mograph.passes.quant._wo_fused`; stat ``expanded.embed_layernorm``).
``--accuracy-budget cosine>=X`` replaces the rules for the measured layers: each layer is measured alone at
``--bits`` (model-output cosine on ``--sensitivity-samples`` calibration samples), then the fewest of the
most sensitive are raised to INT8, and if INT8 everywhere is not enough, the fewest to float, so that
the model outputs meet the budget (binary searches, every figure measured end to end on the float model
with the dequantized weights, which is what the kernels compute).  Without a budget (``auto``, the default)
the written model is checked once against the float one (:mod:`mograph.passes.quant._output_check`: a
warning when an output is wrecked); ``off`` skips that too.

The plan stays per layer: a decoder's ``q_proj``, ``k_proj`` and ``v_proj`` are listed, decided and quantized one
by one; ``lower`` packs the three into one ``MatMulNBits`` for ``GroupQueryAttention`` only where they came out
with the same bits and block size (:mod:`mograph.passes.fusion.lowerings.packed_nbits`: exact, the per-column
blocks stacked along N), so an edited plan means what it says.

all-MiniLM-L6-v2 (real weights; 80 calibration sentences, judged on 220 others; ``tools/bench_int4.py``, one
run): 1 - mean embedding cosine 0.0147 with every MatMul at 4 bits (``--output-projection bits``), against
0.0365 for ModelOpt ``awq_clip`` and 0.0410 for ONNX Runtime's RTN, at the same file size (51.2 MiB).

Code layout: this module holds the pass; its records (layers, input statistics) are in ``_wo_layers``, the
embedding tables (which they are, the tied-head check, their blocks) in ``_wo_tables``, and the model cut into
segments for sequential GPTQ in ``_wo_segments``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from mograph.passes.quant import _blockwise as bw
from mograph.passes.quant._base import (
    CALIBRATION_OPTIONS,
    NO_BUDGET,
    PLAN_OPTIONS,
    calibration_meta,
    computed_weights_note,
    open_calibration,
    parse_shapes,
    publish_notes_and_plan,
    raise_opset,
)
from mograph.passes.quant._fp16_measure import SIGNAL_FLOOR
from mograph.passes.quant._output_check import OutputCheck
from mograph.passes.quant._qdq import (
    COMPUTED_WEIGHT_REASON,
    computed_from_constants,
    const_tensor,
    default_precision,
    find_candidates,
    sensitive_nodes,
)
from mograph.passes.quant._wo_fused import SMALL_TABLE, expand_for_tables
from mograph.passes.quant._wo_layers import _FLOAT_DTYPES, _InputStats, _Layer, gemm_alpha
from mograph.passes.quant._wo_segments import _hessian_factor, _Segments
from mograph.passes.quant._wo_tables import _same_table, _Table, find_tables, quantize_table  # noqa: F401 - _same_table: tests read it here
from mograph.passes.quant.plan import PrecisionPlan, load_plan, node_key, parse_budget
from mograph.passes.quant.weight_only_op import BODY_OPSET, FLOAT_GENERIC_OPSET, OP_NAME

from mograph import _spill
from mograph.custom_ops import DOMAIN, DOMAIN_VERSION
from mograph.errors import OptionError
from mograph.pass_infra import Option, Pass, PassResult, stamp
from mograph.patterns import constant_array
from mograph.specs import parse_bool

__all__ = ["WeightOnlyPass"]

logger = logging.getLogger(__name__)

FLOAT_NAMES = ("float", "fp32", "fp16", "bf16")
MIN_K = 16


def _block_size(raw: str) -> int:
    value = int(raw)
    if value not in (16, 32, 64, 128, 256):
        raise ValueError("block size must be 16, 32, 64, 128 or 256")
    return value


class WeightOnlyPass(Pass):
    """Block-wise INT4/INT8 weight-only MatMul/Gemm (RTN, AWQ- or GPTQ-style) with a per-layer 4/8/float plan."""

    name = "weight-only"
    family = "quant"
    options: ClassVar[tuple[Option, ...]] = (
        Option("bits", int, 4, "weight bits of the quantized layers: 4 or 8", choices=(4, 8)),
        Option("block-size", _block_size, 128, "weights per block along K (one scale and zero point each): 32, 64, 128",
               metavar="N"),
        Option("algorithm", str, "auto", "rtn (no data), awq (activation-aware scaling + clip search), gptq "
               "(Hessian error compensation), auto (gptq with --calibration-data, else rtn)",
               choices=("auto", "rtn", "awq", "gptq")),
        Option("symmetric", parse_bool, False, "symmetric blocks (zero point 2^(bits-1)) instead of asymmetric (yes/no)",
               metavar="yes|no"),
        Option("damping", float, 0.1, "gptq: fraction of the mean Hessian diagonal added to it", metavar="F"),
        Option("sequential", parse_bool, True, "gptq: each layer group from the inputs it sees with the groups before "
               "it already quantized (the model cut at each group, run once per sample) (yes/no)", metavar="yes|no"),
        Option("act-order", parse_bool, True, "gptq: quantize rows by decreasing Hessian diagonal (yes/no)",
               metavar="yes|no"),
        Option("output-projection", str, "float", "the output projection / LM head: float (default rule), int8, "
               "or bits (like the other layers)", choices=("float", "int8", "bits")),
        Option("embedding-precision", str, "float", "embedding tables read by Gather: float (default rule), int8, or "
               "bits (like the other layers): block-wise along the hidden axis (mograph.BlockQuantizedGather, "
               "ONNX Runtime's GatherBlockQuantized); a table tied to a quantized LM head shares its data",
               choices=("float", "int8", "bits")),
        Option("accuracy-budget", str, "auto", "measure per-layer sensitivity and raise the fewest layers to int8, "
               "then float, to meet this budget on the model outputs (auto, the default: the plan's default "
               "rules and a one-run output check that warns below cosine 0.8; off: the rules, nothing measured)",
               metavar="cosine>=X|max-abs<=X|auto|off"),
        Option("sensitivity-samples", int, 8, "calibration samples used by the sensitivity analysis", metavar="N"),
        Option("calibration-rows", int, 2048, "rows of each layer input kept for the awq searches", metavar="N"),
        *CALIBRATION_OPTIONS,
        *PLAN_OPTIONS,
    )
    progress: Callable[[int, int | None], None] | None = None

    # ------------------------------------------------------------------ candidates and decisions

    def _layers(self, model: ir.Model) -> tuple[list[_Layer], list[tuple[ir.Node, str]]]:
        cands, _ = find_candidates(model, ("MatMul", "Gemm"))
        layers: list[_Layer] = []
        skipped: list[tuple[ir.Node, str]] = []
        for c in cands:
            node = c.node
            if not c.has_weight:
                skipped.append((node, COMPUTED_WEIGHT_REASON if computed_from_constants(node.inputs[1])
                                else "default rule: activation x activation matmul (no weight)"))
                continue
            if node.graph is not model.graph:
                skipped.append((node, "inside a subgraph (not handled by weight-only)"))
                continue
            act, wv = node.inputs[0], node.inputs[1]
            w = constant_array(wv)
            tensor = const_tensor(wv)
            # a Constant node's output carries no type of its own in most models: its tensor's is the weight's
            w_dtype = (wv.dtype or (tensor.dtype if tensor is not None else None)) if wv is not None else None
            if wv is not None and wv.is_graph_output():
                skipped.append((node, "its weight is also a graph output"))
                continue
            if act is None or w is None or w_dtype not in _FLOAT_DTYPES \
                    or act.dtype not in (*_FLOAT_DTYPES, None):
                skipped.append((node, "input not float32/float16"))
                continue
            if w.ndim != 2:
                skipped.append((node, f"weight of rank {w.ndim} (only 2-D weights are block-quantized)"))
                continue
            w = w.astype(np.float32, copy=False)  # float32 weights stay a view (of their file's map): not copied
            bias = None
            bias_value = None
            if node.op_type == "Gemm":
                attrs = {k: a.value for k, a in node.attributes.items()}
                if int(attrs.get("transA", 0)):
                    skipped.append((node, "Gemm with transA=1"))
                    continue
                if int(attrs.get("transB", 0)):
                    w = w.T
                if float(attrs.get("alpha", 1.0)) != 1.0:
                    w = w * float(attrs.get("alpha", 1.0))
                beta = float(attrs.get("beta", 1.0))
                if len(node.inputs) > 2 and node.inputs[2] is not None:
                    c_arr = constant_array(node.inputs[2])
                    if c_arr is not None:
                        bias = (c_arr * beta).astype(w.dtype)
                    elif beta == 1.0:
                        bias_value = node.inputs[2]
                    else:
                        skipped.append((node, "Gemm with a non-constant C and beta != 1"))
                        continue
            if w.shape[0] < MIN_K:
                skipped.append((node, f"K = {w.shape[0]} < {MIN_K}: too small to block-quantize"))
                continue
            layers.append(_Layer(node, c.key, np.ascontiguousarray(w), act, bias, bias_value, w_dtype))  # type: ignore[arg-type]
        return layers, skipped

    @staticmethod
    def _constants_as_initializers(model: ir.Model, layers: list[_Layer]) -> int:
        """Make each layer weight that a ``Constant`` node of the main graph produces an initializer of the same
        name and tensor (every reader rewired, the node removed), so the measuring sessions feed it and the
        writer drops it like any initializer weight; the number of weights moved."""
        graph = model.graph
        moved = 0
        for layer in layers:
            old = layer.node.inputs[1]
            producer = old.producer() if old is not None else None
            if old is None or producer is None or producer.op_type != "Constant" or producer.graph is not graph:
                continue
            tensor = const_tensor(old)
            if tensor is None:
                continue
            name = old.name
            old.name = None  # the initializer takes the name the readers knew
            new = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
            graph.register_initializer(new)
            ir.convenience.replace_all_uses_with(old, new)
            graph.remove(producer, safe=True)
            moved += 1
        return moved

    def _decide(self, model: ir.Model, layers: list[_Layer], low: str) -> tuple[dict[str, tuple[str, str]], set[str]]:
        cands, _ = find_candidates(model, ("MatMul", "Gemm"))
        rules = default_precision(model, [c for c in cands if c.has_weight], low)
        out_proj = self.config.get("output_projection") or "float"
        decisions: dict[str, tuple[str, str]] = {}
        ruled: set[str] = set()  # kept float by a rule the budget does not overrule
        for layer in layers:
            prec, reason = rules.get(layer.key, (low, "default rule: weight matmul"))
            if prec != low:  # the INT8 rules' float cases: the final (output) projection
                if out_proj == "float":
                    decisions[layer.key] = ("float", f"{reason}: output projection / LM head kept float")
                    ruled.add(layer.key)
                else:
                    p = "int8" if out_proj == "int8" else low
                    decisions[layer.key] = (p, f"{reason} at {p} (--output-projection {out_proj})")
            else:
                decisions[layer.key] = (low, f"default rule: {layer.node.op_type} with weights")
        overridden: set[str] = set()
        plan_src = self.config.get("precision_plan")
        if plan_src:
            user = load_plan(plan_src)
            for e in user.entries:
                if e.node not in decisions:
                    continue
                prec = "float" if e.precision in FLOAT_NAMES else e.precision
                if prec not in ("int4", "int8", "float"):
                    raise OptionError(f"{self.name}: plan entry {e.node!r} has precision {e.precision!r}; "
                                      "use int4, int8 or float")
                decisions[e.node] = (prec, f"from plan {plan_src}: {e.reason}" if e.reason else f"user override (plan {plan_src})")
                overridden.add(e.node)
                ruled.discard(e.node)
        keep = set(self.config.get("keep_fp32") or [])
        for layer in layers:
            if layer.key in keep or layer.node.op_type in keep:
                decisions[layer.key] = ("float", "user override (--keep-fp32)")
                overridden.add(layer.key)
        return decisions, overridden | ruled

    # ------------------------------------------------------------------ calibration

    def _observe(self, model: ir.Model, names: list[str], source: Any, max_rows: int) -> tuple[dict[str, _InputStats], int]:
        from mograph.passes.quant.calibration import (  # noqa: PLC2701 - the module's session and feed check
            _run_feed,
            _session,
            model_folder,
        )


        proto, spilled = _spill.model_proto(model)  # a model too big for one protobuf: spilled to a file
        have = {o.name for o in proto.graph.output}
        import onnx

        values = {v.name: v for v in model.graph.inputs}
        values.update({o.name: o for n in model.graph for o in n.outputs})
        for name in names:
            if name not in have:
                v = values.get(name)
                elem = v.dtype.value if v is not None and v.dtype is not None else onnx.TensorProto.FLOAT
                proto.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
        stats: dict[str, _InputStats] = {}
        rng = np.random.default_rng(0)
        seen = 0
        total = source.count
        sess = _session(_spill.payload(proto, model_folder(model), spilled))
        for index, feed in enumerate(source):
            outs = _run_feed(sess, names, feed, source, index)  # a feed the model rejects: one clear line
            for name, arr in zip(names, outs):
                x = np.asarray(arr, np.float32).reshape(-1, arr.shape[-1])
                s = stats.get(name)
                if s is None:
                    s = stats[name] = _InputStats(np.zeros((x.shape[1],) * 2), np.zeros(x.shape[1]))
                x64 = x.astype(np.float64)
                s.hessian += x64.T @ x64
                s.abs_sum += np.abs(x64).sum(axis=0)
                s.rows += x.shape[0]
                keys = rng.random(x.shape[0])
                rows = x if s.sample is None else np.concatenate([s.sample, x])
                allkeys = keys if s.keys is None else np.concatenate([s.keys, keys])
                if rows.shape[0] > max_rows:
                    top = np.argsort(-allkeys)[:max_rows]
                    rows, allkeys = rows[top], allkeys[top]
                s.sample, s.keys = rows, allkeys
            seen += 1
            if self.progress is not None:
                self.progress(seen, total)
        if seen == 0:
            raise OptionError(f"--calibration-data: {source.description} yielded no samples")
        return stats, seen

    # ------------------------------------------------------------------ quantization

    def _quantize(self, layers: list[_Layer], bits: int, algorithm: str, stats: dict[str, _InputStats]) -> None:
        spec = bw.QuantSpec(bits, int(self.config.get("block_size") or 128), bool(self.config.get("symmetric")))
        groups: dict[str, list[_Layer]] = {}
        for layer in layers:
            groups.setdefault(layer.act.name or "", []).append(layer)
        for name, group in groups.items():
            self._quantize_group(name, group, bits, algorithm, stats, spec)
            for layer in group:  # a layer's weight may be a view of its file's map: not all resident at once
                _spill.release_pages(layer.node.inputs[1].const_value)  # type: ignore[union-attr]

    def _quantize_group(self, name: str, group: list[_Layer], bits: int, algorithm: str,
                        stats: dict[str, _InputStats], spec: bw.QuantSpec) -> None:
        st = stats.get(name)
        if algorithm == "rtn" or st is None:
            for layer in group:
                layer.quant[bits] = (bw.rtn(layer.weight, spec), None)
            return
        importance = np.diag(st.hessian) / max(st.rows, 1)
        if algorithm == "awq":
            assert st.sample is not None
            a, alpha = bw.awq_scales([layer.weight for layer in group], st.sample, spec)
            logger.debug("%s: awq alpha %.2f for %d layer(s)", name, alpha, len(group))
            scaled_imp = importance / (a.astype(np.float64) ** 2)
            for layer in group:
                ws = layer.weight * a[:, None]
                s, z = bw.search_params(ws, spec, scaled_imp)
                layer.quant[bits] = (bw.quantize(ws, s, z, spec), a if alpha > 0 else None)
        else:
            damp, act_order = float(self.config.get("damping") or 0.1), bool(self.config.get("act_order"))
            # one factor of H for the group (the same figures each layer's own made), H given away to it
            factor = bw.gptq_factor(st.hessian / max(st.rows, 1), damp=damp, act_order=act_order, consume=True)
            for layer in group:
                q = bw.gptq(layer.weight, None, spec, damp=damp, act_order=act_order, importance=importance,
                            factor=factor)
                layer.quant[bits] = (q, None)

    # ------------------------------------------------------------------ the float model with weights as feeds

    def _weight_session(self, model: ir.Model, layers: list[_Layer], outputs: list[str] = ()  # type: ignore[assignment]
                        ) -> tuple[Any, dict[str, np.ndarray], Callable[[_Layer, np.ndarray], np.ndarray]]:
        """A session of the float model whose layer weights are inputs (fed their float values by default),
        optionally with extra outputs; and ``as_input(layer, w)``: an effective ``[K, N]`` weight as that feed."""
        import onnx
        from mograph.passes.quant.calibration import (
            _session,  # noqa: PLC2701 - the module's session factory
            model_folder,
        )


        proto, spilled = _spill.model_proto(model)  # a model too big for one protobuf: spilled to a file
        names = {layer.node.inputs[1].name for layer in layers}  # type: ignore[union-attr]
        fed = [i for i in proto.graph.initializer if i.name in names]
        for init in fed:
            proto.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        kept = [i for i in proto.graph.initializer if i.name not in names]
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(kept)
        have = {o.name for o in proto.graph.output}
        elem = {layer.act.name: layer.dtype.value for layer in layers}
        for name in outputs:
            if name not in have:
                proto.graph.output.append(onnx.helper.make_tensor_value_info(name, elem.get(name, 1), None))
        sess = _session(_spill.payload(proto, model_folder(model), spilled))
        fed_names = {i.name for i in fed}
        fixed: dict[str, np.ndarray] = {}
        for layer in layers:
            name = str(layer.node.inputs[1].name)  # type: ignore[union-attr]
            w = constant_array(layer.node.inputs[1])
            if name in fed_names and w is not None:
                fixed[name] = w

        def as_input(layer: _Layer, w: np.ndarray) -> np.ndarray:
            w = w / self._alpha(layer)
            if layer.node.op_type == "Gemm" and layer.node.attributes.get("transB") is not None \
                    and layer.node.attributes["transB"].as_int():
                w = w.T
            return w.astype(fixed[str(layer.node.inputs[1].name)].dtype)  # type: ignore[union-attr]

        return sess, fixed, as_input

    def _sequential_gptq(self, model: ir.Model, layers: list[_Layer], bits: int, samples: list[dict[str, np.ndarray]],
                         keep_float: set[str], quantize_kept: bool = True, source: Any = None) -> int:
        """GPTQ layer group by layer group in graph order, each from the inputs it sees with the groups before it
        already quantized (weights kept float by the plan stay float); returns the segment runs made.

        The model is run once, cut into segments at each group's first layer: the values live across a cut
        (the residual stream, the group's input, masks, rotary tables ...) are kept per sample, the group's
        Hessian is made from its input there, its layers are quantized, and the next segment runs from the
        kept values with those layers' dequantized weights.  So every node runs once per sample (not once
        per group and sample).  ``quantize_kept``: also quantize the layers the plan keeps float (the
        accuracy budget measures them); without it their groups are skipped, and the model is not run past
        the last group that needs quantizing.
        """
        spec = bw.QuantSpec(bits, int(self.config.get("block_size") or 128), bool(self.config.get("symmetric")))
        nodes = list(model.graph)
        order = {id(n): i for i, n in enumerate(nodes)}
        groups: dict[str, list[_Layer]] = {}
        for layer in sorted(layers, key=lambda la: order[id(la.node)]):
            if quantize_kept or layer.key not in keep_float:
                groups.setdefault(layer.act.name or "", []).append(layer)
        if not groups:
            return 0
        cuts = sorted(((min(order[id(la.node)] for la in g), name) for name, g in groups.items()))
        segments = _Segments(model, nodes, [c for c, _ in cuts])
        if segments.problem:
            logger.info("sequential gptq: %s; quantizing each group from a run of the whole model", segments.problem)
            return self._sequential_gptq_whole(model, layers, bits, samples, keep_float, source)
        replaced: dict[str, np.ndarray] = {}  # weight initializer name -> effective weight fed to later segments
        # the last node (before the last cut) reading each value: a dequantized weight is dropped once the
        # segment holding its readers has run, and never made for readers past the last cut (never run)
        last_read: dict[str, int] = {}
        for p, rs in enumerate(segments.reads):
            for v in rs:
                if v.name:
                    last_read[v.name] = p
        states: list[dict[str, np.ndarray]] = [dict(s) for s in samples]
        runs = 0
        damp = float(self.config.get("damping") or 0.1)
        act_order = bool(self.config.get("act_order"))
        for i, (cut, name) in enumerate(cuts):
            states, n = segments.advance(i, states, replaced, source)
            runs += n
            self._check_width(groups[name], [st[name] for st in states], samples, source)
            for wname in [w for w in replaced if last_read.get(w, -1) < cut]:
                del replaced[wname]  # its segment has run
            importance, factor = _hessian_factor(states, name, damp, act_order)
            for layer in groups[name]:
                q = bw.gptq(layer.weight, None, spec, damp=damp, act_order=act_order, importance=importance,
                            factor=factor)
                layer.quant[bits] = (q, None)
                weight = layer.node.inputs[1]
                _spill.release_pages(weight.const_value)  # type: ignore[union-attr]  # read once: not all resident
                wname = str(weight.name)  # type: ignore[union-attr]
                if layer.key not in keep_float and last_read.get(wname, -1) >= cut:
                    replaced[wname] = self._as_weight(layer, q.dequantize())
            del factor
            if self.progress is not None:
                self.progress(i + 1, len(cuts))
        return runs

    @staticmethod
    def _check_width(group: list[_Layer], xs: list[Any], samples: list[dict[str, np.ndarray]], source: Any,
                     first: int = 0) -> None:
        """Each sample's input ``xs[n]`` of a layer group must have the weights' K as its last dim: the first group's
        input can be a graph input, which no segment run checks (a feed the model rejects, with dynamic dims of a
        random feed set to 1, reached the quantizer as a 1-wide Hessian: IndexError).  A feed that does not fit is
        the calibration's one-line :class:`OptionError` (``samples[n]`` is sample ``first + n``)."""
        from mograph.passes.quant.calibration import feed_rejected

        layer = group[0]
        k = layer.weight.shape[0]
        for n, x in enumerate(xs):
            shape = np.shape(x)
            if shape and shape[-1] == k:
                continue
            node = layer.node
            # worded like ONNX Runtime's refusal, the input not named: the message then says which inputs
            # were made up (dynamic dims set to 1) as it does for every pass
            exc = ValueError(f"{node.op_type} node '{node.name}': dimension mismatch: its data input is "
                             f"{'x'.join(map(str, shape)) or 'a scalar'}, its weight has {k} rows")
            if source is None or n >= len(samples):
                raise exc
            raise feed_rejected(exc, samples[n], source, first + n)

    def _as_weight(self, layer: _Layer, w: np.ndarray) -> np.ndarray:
        """An effective ``[K, N]`` weight as the node's own weight input (Gemm's alpha and transB undone)."""
        w = w / self._alpha(layer)
        if layer.node.op_type == "Gemm" and layer.node.attributes.get("transB") is not None \
                and layer.node.attributes["transB"].as_int():
            w = w.T
        return np.ascontiguousarray(w.astype(layer.dtype.numpy()))

    def _sequential_gptq_whole(self, model: ir.Model, layers: list[_Layer], bits: int,
                               samples: list[dict[str, np.ndarray]], keep_float: set[str], source: Any = None) -> int:
        """The slow form, for graphs that cannot be cut (a live value that is not a tensor): one run of the
        whole model per group and sample."""
        spec = bw.QuantSpec(bits, int(self.config.get("block_size") or 128), bool(self.config.get("symmetric")))
        order = {id(n): i for i, n in enumerate(model.graph)}
        groups: dict[str, list[_Layer]] = {}
        for layer in sorted(layers, key=lambda la: order[id(la.node)]):
            groups.setdefault(layer.act.name or "", []).append(layer)
        sess, fixed, as_input = self._weight_session(model, layers, list(groups))
        feeds = dict(fixed)
        runs = 0
        for name, group in groups.items():
            h: np.ndarray | None = None
            rows = 0
            for n_sample, s in enumerate(samples):
                x = np.asarray(sess.run([name], {**s, **feeds})[0], np.float64)
                self._check_width(group, [x], [s], source, n_sample)
                x = x.reshape(-1, x.shape[-1])
                h = x.T @ x if h is None else h + x.T @ x
                rows += x.shape[0]
                runs += 1
            assert h is not None
            h /= max(rows, 1)
            for layer in group:
                q = bw.gptq(layer.weight, h, spec, damp=float(self.config.get("damping") or 0.1),
                            act_order=bool(self.config.get("act_order")), importance=np.diag(h))
                layer.quant[bits] = (q, None)
                wname = str(layer.node.inputs[1].name)  # type: ignore[union-attr]
                if layer.key not in keep_float and wname in feeds:
                    feeds[wname] = as_input(layer, q.dequantize())
            if self.progress is not None:
                self.progress(runs, None)
        return runs

    # ------------------------------------------------------------------ budget

    def _budget(self, model: ir.Model, layers: list[_Layer], decisions: dict[str, tuple[str, str]],
                measured: list[_Layer], samples: list[dict[str, np.ndarray]], low_bits: int,
                budget: Any) -> dict[str, Any]:
        sess, fixed, as_input = self._weight_session(model, layers)
        # The effective (dequantized, float) weights of the last evaluation only: consecutive evaluations
        # share most of them, and keeping every (layer, bits) ever fed held two float copies of the weights.
        eff: dict[tuple[str, int], np.ndarray] = {}

        def key_of(layer: _Layer, prec: str) -> tuple[str, int] | None:
            return None if prec == "float" else (layer.key, 8 if prec == "int8" else 4)

        refs = [sess.run(None, {**s, **fixed}) for s in samples]
        _spill.drop_pages(model)  # read again only for the layers an evaluation keeps float
        evaluations = 0

        def evaluate(assign: dict[str, str]) -> float:
            nonlocal evaluations
            wanted = {key_of(layer, assign.get(layer.key, "float")) for layer in layers} - {None}
            for stale in set(eff) - wanted:  # dropped before the new ones are made
                del eff[stale]
            feeds: dict[str, np.ndarray] = dict(fixed)
            for layer in layers:
                key = key_of(layer, assign.get(layer.key, "float"))
                name = str(layer.node.inputs[1].name)  # type: ignore[union-attr]
                if key is not None and key not in eff:
                    eff[key] = as_input(layer, layer.effective(key[1]))
                feeds[name] = fixed[name] if key is None else eff[key]
            values = []
            for s, ref in zip(samples, refs):
                out = sess.run(None, {**s, **feeds})
                r = np.concatenate([np.asarray(a, np.float64).ravel() for a in ref])
                o = np.concatenate([np.asarray(a, np.float64).ravel() for a in out])
                if budget.metric == "cosine":  # all silent on both sides agree, as in sensitivity._metric
                    quiet = max(float(np.abs(r).max(initial=0.0)), float(np.abs(o).max(initial=0.0))) <= SIGNAL_FLOOR
                    values.append(1.0 if quiet else float(r @ o / (np.linalg.norm(r) * np.linalg.norm(o) + 1e-30)))
                else:
                    values.append(float(np.abs(r - o).max()))
            evaluations += 1
            if self.progress is not None:
                self.progress(evaluations, None)
            return min(values) if budget.metric == "cosine" else max(values)

        low = f"int{low_bits}"
        base = {k: p for k, (p, _) in decisions.items()}
        measured_keys = [layer.key for layer in measured]
        alone: dict[str, float] = {}
        for key in measured_keys:
            alone[key] = evaluate({key: low})
        order = sorted(measured_keys, key=lambda k: (alone[k] if budget.metric == "max-abs" else -alone[k]), reverse=True)

        def assignment(n8: int, nf: int) -> dict[str, str]:
            out = {k: v for k, v in base.items() if k not in measured_keys}
            for i, k in enumerate(order):
                out[k] = "float" if i < nf else ("int8" if i < n8 else low)
            return out

        def search(fn: Callable[[int], float], n: int) -> tuple[int, float]:
            cache: dict[int, float] = {}

            def get(k: int) -> float:
                if k not in cache:
                    cache[k] = fn(k)
                return cache[k]

            if budget.met(get(0)):
                return 0, get(0)
            lo, hi = 0, n
            if not budget.met(get(n)):
                return n, get(n)
            while lo + 1 < hi:
                mid = (lo + hi) // 2
                if budget.met(get(mid)):
                    hi = mid
                else:
                    lo = mid
            return hi, get(hi)

        n = len(order)
        n8, nf, value = 0, 0, float("nan")
        if low_bits == 4:
            n8, value = search(lambda k: evaluate(assignment(k, 0)), n)
        if low_bits == 8 or not budget.met(value):
            n8 = n
            nf, value = search(lambda k: evaluate(assignment(n, k)), n)
        final = assignment(n8, nf)
        for layer in measured:
            prec = final[layer.key]
            m = f"model-output {budget.metric} {alone[layer.key]:.5f} with this layer alone at {low}"
            decisions[layer.key] = (prec, f"measured sensitivity: {m}; " + (
                f"within {budget}" if prec == low else f"raised to {prec} to meet {budget}"))
        return {"budget": str(budget), "measured": round(value, 6), "met": bool(budget.met(value)),
                "int8": sum(1 for k in order if final[k] == "int8"), "float": sum(1 for k in order if final[k] == "float"),
                "samples": len(samples), "evaluations": evaluations}

    def _check_float(self, model: ir.Model, layers: list[_Layer], feeds: list[dict[str, np.ndarray]],
                     held: list[Any]) -> list[list[np.ndarray]]:
        """The output check's float side, as the budget measures: one session of the float model whose layer
        weights are inputs (:meth:`_weight_session`), kept in ``held`` for the quantized side.  Running the written
        model instead dequantizes every weight in ONNX Runtime's generic ops on each run (a 135M LLaMA: 22 s for
        4 runs, against about 1 s here)."""
        sess, fixed, as_input = self._weight_session(model, layers)
        held[:] = [sess, fixed, as_input]
        return [sess.run(None, {**f, **fixed}) for f in feeds]

    def _check_quantized(self, layers: list[_Layer], decisions: dict[str, tuple[str, str]],
                         feeds: list[dict[str, np.ndarray]], held: list[Any]) -> list[list[np.ndarray]]:
        sess, fixed, as_input = held
        weights = dict(fixed)
        for layer in layers:
            prec = decisions[layer.key][0]
            if prec != "float":
                weights[str(layer.node.inputs[1].name)] = as_input(layer, layer.effective(8 if prec == "int8" else 4))  # type: ignore[union-attr]
        return [sess.run(None, {**f, **weights}) for f in feeds]

    def _alpha(self, layer: _Layer) -> float:
        return gemm_alpha(layer)

    # ------------------------------------------------------------------ rewrite

    def _write(self, model: ir.Model, layer: _Layer, bits: int, awq_inputs: dict[str, ir.Value]
               ) -> tuple[ir.Value, ir.Value, ir.Value]:
        graph = model.graph
        q, a = layer.quant[bits]
        node = layer.node
        base = (node.name or node_key(node)).replace("/", "_").strip("_") or "weight_only"
        b = bw.pack_nbits(q)
        dtype = layer.dtype.numpy()
        from mograph.irutil import add_initializer

        b_val = add_initializer(graph, f"{base}_wq{bits}", b)
        s_val = add_initializer(graph, f"{base}_wscales", np.ascontiguousarray(q.scale.T).astype(dtype))
        z_val = add_initializer(graph, f"{base}_wzeros", np.ascontiguousarray(q.zero.T).astype(np.uint8))
        # the node's input now, not the one found: an earlier layer's rewrite replaces it in a chain MatMul -> MatMul
        act = node.inputs[0]
        assert act is not None
        new_nodes: list[ir.Node] = []
        if a is not None:
            act = awq_inputs[layer.act.name or ""]
        k, n = layer.weight.shape
        mm = ir.node(OP_NAME, [act, b_val, s_val, z_val], domain=DOMAIN,
                     attributes={"K": k, "N": n, "bits": bits, "block_size": q.spec.block_size})
        new_nodes.append(mm)
        out = mm.outputs[0]
        out.dtype = layer.dtype
        if layer.bias is not None or layer.bias_value is not None:
            c = layer.bias_value if layer.bias_value is not None else add_initializer(graph, f"{base}_bias", layer.bias.astype(dtype))  # type: ignore[union-attr]
            add = ir.node("Add", [out, c])
            add.outputs[0].dtype = layer.dtype
            new_nodes.append(add)
            out = add.outputs[0]
        old_out = node.outputs[0]
        out.shape = old_out.shape
        old_inputs = list(node.inputs)
        for i, nn in enumerate(new_nodes):
            own = node.name or f"weight_only/{old_out.name}"
            nn.name = own if i == 0 else f"{own}/bias"
            stamp(nn, self.name, "weight-only")
        ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, [old_out], [out])
        for v in old_inputs[1:]:
            if v is not None and v.is_initializer() and not v.uses() and not v.is_graph_output():
                graph.initializers.pop(v.name, None)  # type: ignore[arg-type]
            elif v is not None and not v.uses() and not v.is_graph_output():
                producer = v.producer()
                if producer is not None and producer.op_type == "Constant" and producer.graph is graph:
                    graph.remove(producer, safe=True)  # a Gemm bias from a Constant node, now read by the Add
        return b_val, s_val, z_val

    # ------------------------------------------------------------------ embeddings

    def _tables(self, model: ir.Model, layers: list[_Layer]) -> list[_Table]:
        """The embedding tables of ``model`` and their tied heads among ``layers`` (:func:`find_tables`)."""
        return find_tables(model, layers)

    def _write_gather(self, model: ir.Model, gather: ir.Node, table: _Table, bits: int,
                      quantized: tuple[ir.Value, ir.Value, ir.Value]) -> None:
        from mograph.passes.quant.gather_block_op import OP_NAME as GATHER_OP

        data, scales, zeros = quantized
        new = ir.node(GATHER_OP, [data, gather.inputs[1], scales, zeros], domain=DOMAIN,
                      attributes={"K": table.hidden, "bits": bits,
                                  "block_size": int(self.config.get("block_size") or 128)})
        old = gather.outputs[0]
        new.outputs[0].type, new.outputs[0].shape = old.type, old.shape
        new.name = gather.name or f"embedding/{old.name}"
        stamp(new, self.name, "embedding")
        ir.convenience.replace_nodes_and_values(model.graph, gather, [gather], [new], [old], [new.outputs[0]])

    def _embeddings(self, model: ir.Model, layers: list[_Layer], decisions: dict[str, tuple[str, str]],
                    written: dict[str, tuple[int, tuple[ir.Value, ir.Value, ir.Value]]], low: str,
                    stats: dict[str, int | float], plan: PrecisionPlan) -> set[int]:
        """Decide and write the embedding tables (``--embedding-precision``, or the plan's entry of each
        ``Gather``); return the ids of the Gather nodes given a plan entry here."""
        choice = str(self.config.get("embedding_precision") or "float")
        wanted = {"float": "float", "int8": "int8", "bits": low}[choice]
        user: dict[str, str] = {}
        plan_src = self.config.get("precision_plan")
        if plan_src:
            for e in load_plan(plan_src).entries:
                user[e.node] = "float" if e.precision in FLOAT_NAMES else e.precision
        listed: set[int] = set()
        block = int(self.config.get("block_size") or 128)
        expanded = expand_for_tables(model, layers, decisions, wanted, user, block, self.name, stats)
        if expanded:
            stats["expanded.embed_layernorm"] = expanded
        for table in self._tables(model, layers):
            keys = [node_key(g) for g in table.gathers]
            small = all(SMALL_TABLE in g.metadata_props for g in table.gathers)
            prec = next((user[k] for k in keys if k in user), "float" if small else wanted)
            why = f"from plan {plan_src}" if any(k in user for k in keys) else f"--embedding-precision {choice}"
            if prec not in ("int4", "int8", "float"):
                raise OptionError(f"{self.name}: plan entry {keys[0]!r} has precision {prec!r}; use int4, int8 or float")
            head_prec = decisions[table.head.key][0] if table.head is not None else None
            reuse = None
            if prec != "float" and table.head is not None and table.head.key in written:
                b, vals = written[table.head.key]
                a = table.head.quant[b][1]
                if f"int{b}" == prec and a is None:
                    reuse = vals
            if prec == "float" and small and why.startswith("--"):
                reason = (f"the {table.gathers[0].metadata_props[SMALL_TABLE]} table of a fused embedding layer "
                          "expanded for its word table: small, kept float")
            elif prec == "float":
                reason = "default rule: embedding lookup" if why.endswith("float") else f"{why}: kept float"
            elif table.hidden % int(self.config.get("block_size") or 128):
                prec, reason = "float", (f"{why} asked {prec}, but the hidden size {table.hidden} is not a multiple "
                                         "of --block-size (GatherBlockQuantized has no padding)")
            elif reuse is None and table.same and head_prec == "float":
                prec, reason = "float", (f"{why} asked {prec}, but the table is the float LM head's own weight: "
                                         "a quantized copy would add size, not save it (quantize the head too)")
            else:
                reason = f"{why}: {prec} blocks along the hidden axis" + (
                    ", sharing the tied LM head's quantized data" if reuse is not None else "")
            if prec != "float":
                bits = 8 if prec == "int8" else 4
                spec = bw.QuantSpec(bits, int(self.config.get("block_size") or 128), bool(self.config.get("symmetric")))
                vals = reuse if reuse is not None else quantize_table(model, table, spec)
                for g in table.gathers:
                    self._write_gather(model, g, table, bits, vals)
                if not table.value.uses():
                    model.graph.initializers.pop(str(table.value.name), None)
                stats["quantized.embeddings"] = stats.get("quantized.embeddings", 0) + len(table.gathers)
                if reuse is not None:
                    stats["embeddings.shared_with_head"] = stats.get("embeddings.shared_with_head", 0) + 1
            for g in table.gathers:
                plan.add(g, prec, reason)
                listed.add(id(g))
        return listed

    def _awq_inputs(self, model: ir.Model, layers: list[_Layer], stats: dict[str, int | float]) -> dict[str, ir.Value]:
        """For each activation with AWQ scales: the value its quantized readers take (LayerNorm folded, or a Mul)."""
        out: dict[str, ir.Value] = {}
        graph = model.graph
        by_act: dict[str, list[_Layer]] = {}
        for layer in layers:
            by_act.setdefault(layer.act.name or "", []).append(layer)
        from mograph.irutil import add_initializer

        for name, group in by_act.items():
            scales = [layer.quant[b][1] for layer in group for b in layer.quant if layer.quant[b][1] is not None]
            if not scales:
                continue
            a = scales[0]
            assert a is not None
            act = group[0].act
            dtype = group[0].dtype.numpy()
            readers = {id(u.node) for u in act.uses()}
            producer = act.producer()
            if (producer is not None and producer.op_type == "LayerNormalization" and producer.domain in ("", "ai.onnx")
                    and readers == {id(layer.node) for layer in group} and not act.is_graph_output()
                    and len(producer.inputs) >= 2):
                gamma = constant_array(producer.inputs[1])
                beta = constant_array(producer.inputs[2]) if len(producer.inputs) > 2 and producer.inputs[2] is not None else None
                if gamma is not None and gamma.shape == a.shape and (beta is None or beta.shape == a.shape):
                    base = (producer.name or "ln").replace("/", "_").strip("_")
                    old = list(producer.inputs[1:3])
                    producer.replace_input_with(1, add_initializer(graph, f"{base}_awq_scale", (gamma / a).astype(gamma.dtype)))
                    if beta is not None:
                        producer.replace_input_with(2, add_initializer(graph, f"{base}_awq_bias", (beta / a).astype(beta.dtype)))
                    for v in old:
                        if v is not None and v.is_initializer() and not v.uses() and not v.is_graph_output():
                            graph.initializers.pop(v.name, None)  # type: ignore[arg-type]
                    out[name] = act
                    stats["awq.folded"] = stats.get("awq.folded", 0) + 1
                    continue
            inv = add_initializer(graph, f"{(name or 'x').replace('/', '_')}_awq_inv_scale", (1.0 / a).astype(dtype))
            mul = ir.node("Mul", [act, inv], name=f"{name}_awq")
            mul.outputs[0].dtype, mul.outputs[0].shape = group[0].dtype, act.shape
            stamp(mul, self.name, "awq-scale")
            first = min(group, key=lambda layer: list(graph).index(layer.node))
            graph.insert_before(first.node, mul)
            out[name] = mul.outputs[0]
            stats["awq.mul"] = stats.get("awq.mul", 0) + 1
        return out

    # ------------------------------------------------------------------ the pass

    def _ensure_body_opset(self, model: ir.Model, stats: dict[str, int | float],
                           target: int = BODY_OPSET) -> dict[str, Any] | None:
        """Raise the default-domain opset to ``target`` (:data:`BODY_OPSET`: the one the written ops' function
        bodies are in, ``Unsqueeze`` with its axes as an input; :data:`FLOAT_GENERIC_OPSET` for float16
        activations, whose bodies cast the float32 weight to the activation's type with ``CastLike``) when the
        model is older, like the Q/DQ passes do; the conversion's figures go into ``stats``, and its details
        are returned (``None``: not needed).

        Raises:
            ModelError: the model cannot be converted (it is unchanged then).
        """
        from mograph.opset import model_opset

        if model_opset(model) >= target:
            return None
        why = (f"function bodies of the quantized ops (opset {target}"
               + (": CastLike to the float16 activations)" if target > BODY_OPSET else ")"))
        return raise_opset(self, model, target, f"the quantized MatMul's function body needs opset >= {target}", why,
                           stats)

    def call(self, model: ir.Model) -> PassResult:
        bits = int(self.config.get("bits") or 4)
        low = f"int{bits}"
        layers, skipped = self._layers(model)
        stats: dict[str, int | float] = {"quantized": 0, "kept_float": 0}
        computed = sum(1 for _, reason in skipped if reason == COMPUTED_WEIGHT_REASON)
        if computed:
            logger.warning("%s: %s", self.name, computed_weights_note(computed))
        if not layers:
            return PassResult(False, {}, {"notes": [computed_weights_note(computed)]} if computed else {})
        algorithm = self.config.get("algorithm") or "auto"
        has_data = self.config.get("calibration_data") is not None or int(self.config.get("calibration_random") or 0) > 0
        if algorithm == "auto":
            algorithm = "gptq" if has_data else "rtn"
        decisions, overridden = self._decide(model, layers, low)
        budget = None
        budget_text = str(self.config.get("accuracy_budget") or "auto").strip()
        if budget_text.lower() not in ("auto", *NO_BUDGET) and not self.config.get("precision_plan"):
            budget = parse_budget(budget_text)
        if budget is None and all(p == "float" for p, _ in decisions.values()):
            return PassResult(False, {}, {})  # every candidate stays float: nothing to observe or write
        # below opset 15 the bodies have no CastLike and compute float32: a float16 activation then meets a
        # float32 weight in the body's MatMul, which ONNX Runtime refuses ("B has inconsistent type")
        generic = any(layer.dtype != ir.DataType.FLOAT for layer in layers)
        upgrade = self._ensure_body_opset(model, stats, FLOAT_GENERIC_OPSET if generic else BODY_OPSET)
        if upgrade is not None:  # the nodes were rewritten: find the layers again in the converted graph
            layers, skipped = self._layers(model)
            decisions, overridden = self._decide(model, layers, low)
        promoted = self._constants_as_initializers(model, layers)
        if promoted:
            stats["constant_weights"] = promoted
        plan = PrecisionPlan(self.name, meta={"scheme": {"bits": bits, "block_size": int(self.config.get("block_size") or 128),
                                                         "symmetric": bool(self.config.get("symmetric")),
                                                         "algorithm": algorithm}})
        measured = [layer for layer in layers if layer.key not in overridden] if budget else []
        wanted_bits = {8 if p == "int8" else 4 for p, _ in decisions.values() if p != "float"}
        if budget is not None:
            wanted_bits |= {bits, 8}
        input_stats: dict[str, _InputStats] = {}
        source = None
        needs_data = algorithm != "rtn" or budget is not None
        sequential = algorithm == "gptq" and bool(self.config.get("sequential")) and needs_data
        if needs_data:
            source = open_calibration(self, model)
            if sequential and budget is None and wanted_bits <= {bits}:
                seen = sum(1 for _ in iter(source))  # sequential GPTQ makes its own statistics
                if seen == 0:
                    raise OptionError(f"--calibration-data: {source.description} yielded no samples")
            else:
                names = list(dict.fromkeys(layer.act.name for layer in layers if layer.act.name))
                input_stats, seen = self._observe(model, names, source, int(self.config.get("calibration_rows") or 2048))
            stats["calibration_samples"] = seen
            plan.meta["calibration"] = calibration_meta(source, seen, None)
            if source.random:
                stats["calibrated_on_random_data"] = 1
        check = None
        held: list[Any] = []  # the check's session, float feeds and weight feed maker (see _check_float)
        if budget is None and budget_text.lower() not in NO_BUDGET:  # nothing measures the result: check it once
            check = OutputCheck.start(self.name, model, source, samples=int(self.config.get("sensitivity_samples") or 8),
                                      shapes=parse_shapes(self.config.get("shape")),
                                      run=lambda feeds: self._check_float(model, layers, feeds, held))
        for b in sorted(wanted_bits):
            if sequential and b == bits:
                samples_all = list(iter(source))  # type: ignore[arg-type]
                keep = {k for k, (p, _) in decisions.items() if p == "float"}
                stats["sequential_runs"] = self._sequential_gptq(model, layers, b, samples_all, keep,
                                                                 quantize_kept=budget is not None, source=source)
            else:
                self._quantize(layers, b, algorithm, input_stats)
        notes: list[str] = []
        if budget is not None and source is not None:
            import itertools

            samples = list(itertools.islice(iter(source), int(self.config.get("sensitivity_samples") or 8)))
            plan.meta["accuracy_budget"] = self._budget(model, layers, decisions, measured, samples, bits, budget)
            stats["sensitivity_evaluations"] = plan.meta["accuracy_budget"]["evaluations"]
            if not plan.meta["accuracy_budget"]["met"]:
                notes.append(f"accuracy budget {budget} not met even with every measured layer in float")
        awq_layers = [layer for layer in layers if decisions[layer.key][0] != "float"]
        for layer in awq_layers:  # only the precision written keeps its AWQ scale
            want = 8 if decisions[layer.key][0] == "int8" else 4
            layer.quant = {want: layer.quant[want]}
        # one AWQ input scale per activation: layers sharing it must agree (the searches ran per activation and bits)
        by_act: dict[str, set[int]] = {}
        for layer in awq_layers:
            by_act.setdefault(layer.act.name or "", set()).add(next(iter(layer.quant)))
        for layer in awq_layers:
            if len(by_act[layer.act.name or ""]) > 1:
                b = next(iter(layer.quant))
                q, a = layer.quant[b]
                if a is not None:  # mixed bits on one input: requantize without the input scale
                    spec = q.spec
                    layer.quant[b] = (bw.rtn(layer.weight, spec), None)
        if check is not None and held:
            check.run_quantized(lambda feeds: self._check_quantized(layers, decisions, feeds, held),
                                "the float model with the dequantized layer weights (what the kernels compute)")
            held.clear()
        awq_inputs = self._awq_inputs(model, awq_layers, stats)
        written: dict[str, tuple[int, tuple[ir.Value, ir.Value, ir.Value]]] = {}
        for layer in layers:
            prec, reason = decisions[layer.key]
            if prec != "float":
                b = 8 if prec == "int8" else 4
                written[layer.key] = (b, self._write(model, layer, b, awq_inputs))
                stats["quantized"] += 1
                stats[f"quantized.int{b}"] = stats.get(f"quantized.int{b}", 0) + 1
            else:
                stats["kept_float"] += 1
            plan.add(layer.node, prec, reason)
        for node, reason in skipped:
            plan.add(node, "float", reason)
        listed = self._embeddings(model, layers, decisions, written, low, stats, plan)
        for node, reason in sensitive_nodes(model, self.registry.foreign_ops if self.registry is not None else None):
            if id(node) not in listed:
                plan.add(node, "float", reason)
        if stats.get("quantized.embeddings") or stats.get("expanded.embed_layernorm"):
            from mograph.passes.fusion.ops import custom_ops as fused_ops
            from mograph.passes.quant.gather_block_op import block_quantized_gather_op

            model.opset_imports.setdefault(DOMAIN, DOMAIN_VERSION)
            gop = block_quantized_gather_op()
            ops_g = dict(self.registry.custom_ops) if self.registry is not None else {}
            ops_g.setdefault(gop.key, gop)
            for fop in fused_ops():  # the expansion's mograph.LayerNorm
                ops_g.setdefault(fop.key, fop)
            from mograph.lowering import drop_unused_functions
            from mograph.lowering import ensure_functions as _ensure

            _ensure(model, ops_g)
            if stats.get("expanded.embed_layernorm"):  # the expanded op's body, if no node calls it any more
                drop_unused_functions(model, {k: v for k, v in ops_g.items() if k[1] == "EmbedLayerNorm"})
        if stats["quantized"]:
            model.opset_imports.setdefault(DOMAIN, DOMAIN_VERSION)
            from mograph.passes.quant.weight_only_op import weight_only_matmul_op

            from mograph.lowering import ensure_functions

            op = weight_only_matmul_op()  # the op this pass writes, declared by its own plugin
            ops = dict(self.registry.custom_ops) if self.registry is not None else {}
            ops.setdefault(op.key, op)
            ensure_functions(model, ops)
        details: dict[str, Any] = {"plan": plan.to_dict()}
        if upgrade is not None:
            details["opset_upgrade"] = upgrade
        if check is not None and (stats["quantized"] or stats.get("quantized.embeddings")):
            check.finish(model, stats, details, notes)
        publish_notes_and_plan(self, plan, details, notes)
        if (not stats["quantized"] and not stats.get("quantized.embeddings") and not stats.get("expanded.embed_layernorm")
                and upgrade is None and not promoted):
            return PassResult(False, {}, details)
        return PassResult(True, stats, details)
