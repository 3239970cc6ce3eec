"""Fix dynamic input dimensions to concrete sizes, propagate them, and fold what becomes constant.

Exporters leave batch and sequence dimensions symbolic, and every layer then recomputes its reshape
targets at run time (``Shape -> Gather -> Unsqueeze -> Concat -> Reshape``).  A deployment that always
runs one size gains from pinning it: once the inputs are static, shape inference makes every shape in
the graph static, those shape computations fold into constants, and the model shrinks and runs faster.

Two ways to say what to pin, combinable:

- ``--shape NAME:D1xD2...`` gives an input its whole shape.  The name may contain ``:`` (the dims follow
  the last one).  Symbols of that input's dynamic dims are pinned everywhere they occur: fixing
  ``input_ids:1x128`` also fixes ``attention_mask`` when both say ``[batch, seq]``.
- ``--dim SYMBOL=SIZE`` pins a named dimension in every input that uses it.

Refused with ``OptionError`` naming the input and dimension: an unknown input or symbol, a size that is
not positive, a rank that differs from the input's, a size that contradicts a static dim of the model,
and two requests giving one symbol different sizes.

Every derived shape (node outputs, graph outputs, value_info, subgraphs included) is cleared before
shape inference runs again, so a wrong declared shape never survives: inference is derived from the
computation.  Only where inference derives nothing (ops of ``ai.onnx.ml`` such as ``ArrayFeatureExtractor``,
which onnxmltools and skl2onnx classifiers end with) does a graph output keep its declared shape, with the
pinned symbols substituted.  Such a declaration is checked when every input is static after pinning: the model
runs once (ONNX Runtime CPU, optimizations off, seeded random feeds; not above 1 GiB of weights), and a declared
size the run contradicts is provably wrong (onnxmltools' LightGBM classifier declares its ``label`` ``[1]``; at
batch 4 it computes 4 rows).  Those dims are written unknown (the whole shape when the rank is wrong), not the
size seen, which one run cannot prove for every input; ``outputs_declared_shape_corrected`` counts them and
``details["declared_outputs"]`` gives each kept output's declared, observed and written dims, or why it was
not checked.  Folding is onnxscript's constant folder followed by dead-node removal;
it folds results up to ``FOLD_OUTPUT_LIMIT`` elements (shape arithmetic is tiny; bigger folds are the
``fold-constants`` pass's business).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import onnx_ir as ir
from mograph.passes.shape._shapes import infer_shapes, reinfer_shapes, value_dims
from mograph.passes.shape._spec import find_input, parse_dim_assignment
from onnx_ir.passes import common as irp
from onnxscript.optimizer import _constant_folding as cf

from mograph.errors import ModelError, OptionError
from mograph.irutil import constants_as_tensors
from mograph.pass_infra import Option, Pass, PassResult
from mograph.specs import parse_shape

__all__ = ["FixShapesPass", "FOLD_OUTPUT_LIMIT"]

logger = logging.getLogger(__name__)

#: Largest folded tensor, in elements, that fix-shapes creates.
FOLD_OUTPUT_LIMIT = 8192
#: Largest constant input the folder reads (a position-id table of a few thousand entries is fine).
FOLD_INPUT_LIMIT = 1 << 20
#: Rounds of fold + re-inference at most.
MAX_FOLD_ROUNDS = 4


def _node_count(model: ir.Model) -> int:
    return sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))


class FixShapesPass(Pass):
    """Pin dynamic input dims (--shape NAME:1x128, --dim batch=1), re-infer shapes, fold the shape arithmetic."""

    name = "fix-shapes"
    family = "shape"
    options = (
        Option(
            "shape",
            str,
            None,
            "input shape to pin, NAME:D1xD2... (e.g. input_ids:1x128); repeatable",
            multiple=True,
            metavar="NAME:DIMS",
        ),
        Option(
            "dim",
            str,
            None,
            "named dimension to pin in every input, SYMBOL=SIZE (e.g. batch=1); repeatable",
            multiple=True,
            metavar="SYMBOL=SIZE",
        ),
    )

    # ------------------------------------------------------------------------------------------ plan
    def _plan(self, graph: ir.Graph) -> dict[str, tuple[int | str | None, ...]]:
        """New dims per input name, for the inputs whose dims change."""
        shapes: dict[str, tuple[int, ...]] = {}
        for spec in self.config["shape"]:
            name, dims = parse_shape(spec, self.name)
            if name in shapes and shapes[name] != dims:
                raise OptionError(f"{self.name}: input '{name}' given two shapes: {shapes[name]} and {dims}")
            find_input(graph, name, self.name)
            shapes[name] = dims
        symbols: dict[str, tuple[int, str]] = {}  # symbol -> (size, where it was asked)
        for spec in self.config["dim"]:
            sym, size = parse_dim_assignment(spec, self.name)
            if sym in symbols and symbols[sym][0] != size:
                raise OptionError(f"{self.name}: --dim {sym} given two sizes: {symbols[sym][0]} and {size}")
            symbols[sym] = (size, f"--dim {sym}={size}")
        inits = set(graph.initializers)
        inputs = [v for v in graph.inputs if v.name not in inits]
        used_symbols = {d for v in inputs for d in (value_dims(v) or []) if isinstance(d, str)}
        for sym in symbols:
            if sym not in used_symbols:
                known = ", ".join(sorted(used_symbols)) or "none"
                raise OptionError(f"{self.name}: --dim {sym}: no input has a dimension named '{sym}' (named: {known})")

        # --shape: check against the model, and learn the sizes of the symbols it covers.
        for v in inputs:
            if v.name not in shapes:
                continue
            want, have = shapes[v.name], value_dims(v)
            if have is None:
                continue
            if len(want) != len(have):
                raise OptionError(
                    f"{self.name}: --shape of input '{v.name}' has rank {len(want)}, the model's input has rank "
                    f"{len(have)} ({_fmt(have)})"
                )
            for axis, (w, h) in enumerate(zip(want, have)):
                if isinstance(h, int) and h != w:
                    raise OptionError(
                        f"{self.name}: --shape of input '{v.name}' dimension {axis}: the model fixes it to {h}, "
                        f"not {w}"
                    )
                if isinstance(h, str):
                    if h in symbols and symbols[h][0] != w:
                        raise OptionError(
                            f"{self.name}: input '{v.name}' dimension {axis} ('{h}') set to {w}, but "
                            f"{symbols[h][1]} sets '{h}' to {symbols[h][0]}"
                        )
                    symbols[h] = (w, f"--shape {v.name} dimension {axis}")

        plan: dict[str, tuple[int | str | None, ...]] = {}
        for v in inputs:
            have = value_dims(v)
            if have is None:
                if v.name in shapes:
                    plan[v.name] = shapes[v.name]
                continue
            new: list[int | str | None] = []
            for axis, h in enumerate(have):
                if v.name in shapes:
                    new.append(shapes[v.name][axis])
                elif isinstance(h, str) and h in symbols:
                    new.append(symbols[h][0])
                else:
                    new.append(h)
            if new != have:
                if v.name is None:  # ONNX requires graph inputs to be named
                    raise ModelError(f"{self.name}: a graph input has no name, so its new shape cannot be planned")
                plan[v.name] = tuple(new)
        return plan

    # ------------------------------------------------------------------------------------------ call
    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        plan = self._plan(graph)
        if not plan:
            return PassResult(modified=False, stats={"inputs_fixed": 0, "dims_fixed": 0})
        nodes_before = _node_count(model)
        pinned: dict[str, int] = {}
        dims_fixed = 0
        for v in graph.inputs:
            if v.name not in plan:
                continue
            old = value_dims(v)
            new = plan[v.name]
            for axis, d in enumerate(new):
                if old is None or old[axis] != d:
                    dims_fixed += 1
                if old is not None:
                    was = old[axis]
                    if isinstance(was, str) and isinstance(d, int):
                        pinned[was] = d
            v.shape = ir.Shape(list(new))

        # Forget every derived shape: declared ones may be wrong, and stale symbols must not survive.
        declared = {id(v): value_dims(v) for v in graph.outputs}
        reinfer_shapes(model)
        kept: list[ir.Value] = []
        for v in graph.outputs:
            if v.shape is None and declared.get(id(v)) is not None and not v.is_graph_input():
                dims = [pinned.get(d, d) if isinstance(d, str) else d for d in declared[id(v)]]  # type: ignore[union-attr]
                v.shape = ir.Shape(dims)
                kept.append(v)
                logger.info("fix-shapes: inference derived no shape for output %s; kept its declared one", v.name)

        # A fold can make more shapes static (an Expand whose shape was computed), which lets more fold.
        for _ in range(MAX_FOLD_ROUNDS):
            folded = cf.FoldConstantsPass(
                shape_inference=True, input_size_limit=FOLD_INPUT_LIMIT, output_size_limit=FOLD_OUTPUT_LIMIT,
                should_fold=_small_shape_vector,
            )(model)
            irp.RemoveUnusedNodesPass()(model)
            constants_as_tensors(model)  # the folder's Constant(value_ints=...) is opset 12
            if not folded.modified:
                break
            infer_shapes(model)
        nodes_after = _node_count(model)
        stats: dict[str, int | float] = {
            "inputs_fixed": len(plan),
            "dims_fixed": dims_fixed,
            "nodes_removed": nodes_before - nodes_after,
        }
        details: dict[str, Any] = {"inputs": {k: list(v) for k, v in plan.items()}, "symbols": pinned}
        if kept:
            checked = _check_declared(model, kept)
            wrong = sum(1 for c in checked.values() if c.get("corrected"))
            if len(kept) > wrong:
                stats["outputs_declared_shape_kept"] = len(kept) - wrong
            if wrong:
                stats["outputs_declared_shape_corrected"] = wrong
            details["declared_outputs"] = checked
        return PassResult(modified=True, stats=stats, details=details)


def _check_declared(model: ir.Model, kept: list[ir.Value]) -> dict[str, dict[str, Any]]:
    """Check the declared shapes of the outputs ``kept`` (inference derived none) against one run, and clear
    the dims a run contradicts (module docstring); return, per output, what was declared, seen and written."""
    out: dict[str, dict[str, Any]] = {str(v.name): {"declared": value_dims(v)} for v in kept}
    inputs = [v for v in model.graph.inputs if v.name not in model.graph.initializers]
    loose = [str(v.name) for v in inputs if v.shape is None or not v.shape.is_static()]
    why = None
    if loose:
        why = f"input(s) {loose} still dynamic: no run at one size proves a declared size wrong"
    else:
        try:
            seen = _run_once(model)
        except Exception as exc:  # noqa: BLE001 - no runtime, a refused feed, a kernel error: unchecked, said why
            why = "the check run failed: " + (" ".join(str(exc).split())[:200] or type(exc).__name__)
    for v in kept:
        entry = out[str(v.name)]
        if why is not None:
            entry["checked"] = f"no: {why}"
            continue
        shape = seen.get(str(v.name))
        if shape is None:
            entry["checked"] = "no: the output is not a tensor"
            continue
        entry["checked"] = "one run on seeded random feeds at the pinned shapes"
        entry["observed"] = list(shape)
        have = entry["declared"]
        if len(have) != len(shape):
            # its rank is wrong too: the run's rank, every dim unknown (no shape at all is a graph output
            # the ONNX checker refuses: CatBoost's regressor declares [N] and computes [N, 1])
            v.shape = ir.Shape([None] * len(shape))
        elif any(isinstance(d, int) and d != n for d, n in zip(have, shape)):
            v.shape = ir.Shape([None if isinstance(d, int) and d != n else d for d, n in zip(have, shape)])
        else:
            continue
        entry["corrected"] = True
        entry["written"] = value_dims(v)
        logger.warning("fix-shapes: output %s is declared [%s] but computes [%s] at the pinned shapes; its contradicted "
                       "dims are written unknown (shape inference derives none)", v.name, _fmt(have), _fmt(list(shape)))
    return out


def _run_once(model: ir.Model) -> dict[str, tuple[int, ...]]:
    """Output shapes of one ONNX Runtime run (CPU, optimizations off) on seeded random feeds; a model over
    :data:`mograph.output_check.ORT_MAX_BYTES` of weights is not run (:class:`ModelError`)."""
    import numpy as np
    import onnxruntime as ort

    from mograph import _spill
    from mograph.output_check import ORT_MAX_BYTES
    size = sum(v.const_value.nbytes for g in model.graphs() for v in g.initializers.values()
               if v.const_value is not None)
    if size > ORT_MAX_BYTES:
        raise ModelError(f"{size / 2**30:.1f} GiB of weights, over the {ORT_MAX_BYTES / 2**30:g} GiB a check may load")
    feeds = _static_feeds(model)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3  # its "expected shape ... does not match" warning is what this reports
    session = _spill.payload(model).session(opts, ["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return {n: tuple(np.shape(a)) for n, a in zip(names, session.run(names, feeds)) if isinstance(a, np.ndarray)}


def _static_feeds(model: ir.Model) -> dict[str, Any]:
    """Seeded feeds for a model whose inputs are all static (the caller checked): floats standard normal, integers
    and booleans zero (a valid index anywhere).  Only the output shapes are read; a shape that follows the values
    (``NonZero``) can only be written unknown, which is always safe.  (Passes do not import the verifier's feeds.)"""
    import numpy as np

    rng = np.random.default_rng(0)
    feeds: dict[str, Any] = {}
    for v in model.graph.inputs:
        if v.name in model.graph.initializers or v.dtype is None or v.shape is None:
            continue
        dims = tuple(d if isinstance(d, int) else 1 for d in v.shape)  # (static here: the caller checked)
        dtype = v.dtype.numpy()
        if np.issubdtype(dtype, np.floating):
            feeds[str(v.name)] = rng.standard_normal(dims).astype(dtype)
        else:
            feeds[str(v.name)] = np.zeros(dims, dtype)
    return feeds


def _small_shape_vector(node: ir.Node) -> bool | None:
    """Force folding of small integer vectors (shape arithmetic, ``ConstantOfShape`` included); else default."""
    if node.op_type == "Constant" or not node.outputs:
        return None
    for out in node.outputs:
        if out.dtype not in (ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL) or out.shape is None:
            return None
        if not out.shape.is_static() or len(out.shape) > 1 or math.prod(out.shape.numpy()) > 64:
            return None
    return True


def _fmt(dims: list[int | str | None]) -> str:
    return "x".join("?" if d is None else str(d) for d in dims)
