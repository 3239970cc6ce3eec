"""Make static input axes dynamic again, rewriting the constants that baked the old size in.

A model exported at batch 1 and sequence 128 is full of 1s and 128s: reshape targets ``[1, 128, 12, 64]``,
slice ends, expand shapes, position-id tables.  Renaming the input's dim is not enough; every constant
that holds the old size must become an expression of the size the model gets at run time.  This pass
does that, and refuses when it cannot tell what a constant means.

**How it decides.**  It walks the graph in order and gives every tensor dimension a *symbolic size*: an
ordered product of factors, each an integer or a symbol (``batch``, ``seq``, or a fresh symbol for a size
derived in a way the pass does not model, such as ``seq - 1``).  The static shapes that ONNX inference
derives for the original model give every factor its old numeric value.  Each op's rule derives its
outputs' symbolic sizes and checks its inputs:

- elementwise ops broadcast: a dynamic dim meeting a static dim of the same old size means the static
  operand baked the size in.  The pass traces that operand back (through casts, unsqueezes, gathers,
  elementwise ops) to where the size was made — a ``Slice`` end, an ``Expand``/``ConstantOfShape``/``Tile``
  shape, a ``Range`` limit, an ``arange`` table — and rewrites it; if the trail ends anywhere else it
  refuses.
- ``Reshape`` with a constant target: the input's factors, in order, are matched to the target's entries
  (row-major reshapes keep factor order).  Every symbol goes to one entry, and the integer runs between
  symbols must divide exactly.  When several placements fit, the one that leaves the most symbols alone
  in an entry is taken (with batch 1, ``[1*128] -> [1, 128]`` reads as ``[batch, 128]``); a tie is refused.
  The rewritten target is ``Concat`` of constants and ``Gather(Shape(witness), axis) * c`` entries.
- ``Expand`` entries equal to a dynamic dim become 1 (which keeps the input's dim); ``Slice`` ends that
  cover a dynamic axis become INT64_MAX; positive partial ends of a dynamic axis are refused (a fixed
  count and ``size - k`` read the same); ``Gather`` along a dynamic axis at index ``size - 1`` or on a size
  1 axis is refused.
- ``Resize`` with constant ``scales``: a scale of 1 keeps a dynamic axis (batch,
  channels), another scale gives a derived size.  With ``sizes``, an entry equal to a dynamic axis's
  export size becomes that axis's run-time size (``Concat(Shape(x)[:2], sizes[2:])``); a fixed size on a
  dynamic axis, sizes computed in untracked ways and non-stretch aspect-ratio policies are refused.
- Ops without a rule (custom domains, control flow, RNNs, ``Einsum`` ...) consuming a dynamic tensor are
  refused.

Before the walk, integer and boolean computations on constants (how exporters compute shapes) are
folded and shapes are inferred, so every static size is known; boolean masks and float tensors are
kept so a baked size can still be traced to its origin.  The rewrites themselves are applied only once
the whole graph has been checked, so a refusal leaves a model equivalent to the input (folded, not
rewritten).  The refusal is a ``PassFailedError`` naming the node.

With a batch of 1 in the export, a reshape target such as ``[1, 1, 16]`` for a ``[batch * 16]`` input
fits ``[batch, 1, 16]`` and ``[1, batch, 16]`` alike; where candidates differ only in where a size-1
symbol sits among literal 1s, the outermost placement is taken (batch leads).  This is a heuristic, not
a proof; ties involving symbols of other sizes are refused.

Limits: inputs must be fully static (make other dynamic dims static first with ``fix-shapes``); sizes
derived in ways the pass does not model (``seq - 1``, a concat of two dynamic dims) get fresh symbols and
their graph outputs an unnamed dim.

Option ``--dynamic NAME:AXIS=SYMBOL`` (repeatable; NAME may contain ``:``).  Give the same symbol to axes
that must agree (``input_ids:0=batch --dynamic attention_mask:0=batch``).  An axis already dynamic is left
as it is.

Code layout: this module holds the pass (options, the fold before the walk, the analyse / trace-back
rounds); the layers below it are private modules — ``_dyn_symbolic`` (the forward walk, in the size
algebra of :mod:`mograph.shapes`), ``_dyn_rules`` (one rule per op), ``_dyn_base`` (refusals, planned
rewrites, op classes), ``_dyn_traceback`` (from a baked size to the constant that made it) and
``_dyn_builder`` (the run-time size expressions that replace those constants).
"""

from __future__ import annotations

import logging
from typing import Any

import onnx_ir as ir
from mograph.passes.shape._dyn_builder import apply_plan
from mograph.passes.shape._dyn_symbolic import _Analysis, _NeedTag, _Refuse, _static_shape
from mograph.passes.shape._dyn_traceback import trace_back
from mograph.passes.shape._shapes import infer_shapes
from mograph.passes.shape._spec import find_input, parse_dynamic
from onnxscript.optimizer import _constant_folding as cf

from mograph.errors import OptionError, PassFailedError
from mograph.irutil import constants_as_tensors
from mograph.pass_infra import Option, Pass, PassResult
from mograph.shapes import Dim

__all__ = ["MakeDynamicPass"]

logger = logging.getLogger(__name__)

FOLD_INPUT_LIMIT = 1 << 20
FOLD_OUTPUT_LIMIT = 1 << 16


def _is_shape_arithmetic(node: ir.Node) -> bool:
    """Fold integer and boolean computations on constants only: they are how exporters compute shapes.

    Float results and boolean masks stay, so a baked size keeps its origin (a ``Gather`` of a position table by an
    ``arange``) for tracing back.
    """
    if node.op_type == "Constant":
        return False
    for out in node.outputs:
        if out.dtype is None or out.dtype.is_floating_point():
            return False
        if out.dtype == ir.DataType.BOOL and (out.shape is None or len(out.shape) >= 2):
            return False  # a mask (causal, padding): its comparisons show where its sizes come from
    return True



class MakeDynamicPass(Pass):
    """Turn static input axes into named dynamic ones (--dynamic NAME:AXIS=SYMBOL), rewriting baked-in sizes."""

    name = "make-dynamic"
    family = "shape"
    options = (
        Option(
            "dynamic",
            str,
            None,
            "input axis to make dynamic, NAME:AXIS=SYMBOL (e.g. input_ids:0=batch); repeatable",
            multiple=True,
            metavar="NAME:AXIS=SYMBOL",
        ),
    )

    def _requests(self, graph: ir.Graph) -> tuple[dict[ir.Value, dict[int, str]], dict[str, int], dict[str, tuple[ir.Value, int]]]:
        per_input: dict[ir.Value, dict[int, str]] = {}
        sizes: dict[str, int] = {}
        witness: dict[str, tuple[ir.Value, int]] = {}
        for spec in self.config["dynamic"]:
            name, axis, sym = parse_dynamic(spec, self.name)
            v = find_input(graph, name, self.name)
            if v.shape is None:
                raise OptionError(f"{self.name}: input '{name}' has no shape; give it one first (fix-shapes --shape)")
            rank = len(v.shape)
            if not -rank <= axis < rank:
                raise OptionError(f"{self.name}: input '{name}' has rank {rank}, so it has no dimension {axis}")
            axis %= rank
            dim = v.shape.dims[axis]
            if not isinstance(dim, int):
                logger.info("make-dynamic: input %s dimension %d is already dynamic (%s)", name, axis, dim)
                continue
            prev = per_input.setdefault(v, {}).get(axis)
            if prev is not None and prev != sym:
                raise OptionError(f"{self.name}: input '{name}' dimension {axis} given two names, '{prev}' and '{sym}'")
            if sym in sizes and sizes[sym] != dim:
                raise OptionError(
                    f"{self.name}: input '{name}' dimension {axis} is {dim}, but '{sym}' is {sizes[sym]} "
                    f"elsewhere; one name means one size"
                )
            sizes[sym] = dim
            witness.setdefault(sym, (v, axis))
            per_input[v][axis] = sym
        return {v: a for v, a in per_input.items() if a}, sizes, witness

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        per_input, sizes, witness = self._requests(graph)
        if not per_input:
            return PassResult(modified=False, stats={"dims_made_dynamic": 0})
        # Exporters compute static shapes with arithmetic on constants; fold it so every shape is known.
        cf.FoldConstantsPass(
            shape_inference=True, input_size_limit=FOLD_INPUT_LIMIT, output_size_limit=FOLD_OUTPUT_LIMIT,
            should_fold=_is_shape_arithmetic,
        )(model)
        constants_as_tensors(model)  # the folder's Constant(value_ints=...) is opset 12
        infer_shapes(model)
        seeds: dict[ir.Value, list[Dim]] = {}
        for v, axes in per_input.items():
            static = _static_shape(v)
            if static is None:
                raise OptionError(f"{self.name}: input '{v.name}' mixes static and dynamic dims; only fully static inputs "
                                  "are supported")
            dims = [Dim.lit(d) for d in static]
            for axis, sym in axes.items():
                dims[axis] = Dim.sym(sym)
            seeds[v] = dims
        overrides: dict[ir.Value, dict[int, Dim]] = {}
        sources: list[Any] = []
        for _ in range(64):
            analysis = _Analysis(graph, seeds, sizes, witness, overrides, sources)
            try:
                analysis.run()
                break
            except _NeedTag as need:
                try:
                    trace_back(analysis, need, overrides, sources)
                except _Refuse as r:
                    raise self._error(r.node, str(r)) from None
            except _Refuse as r:
                raise self._error(r.node, str(r)) from None
        else:  # pragma: no cover - every round adds an override, graphs are finite
            raise PassFailedError(self.name, "too many baked sizes to trace")
        stats = apply_plan(model, analysis, per_input, self.name)
        return PassResult(modified=True, stats=stats, details={"symbols": dict(sizes)})

    def _error(self, node: ir.Node | None, message: str) -> PassFailedError:
        where = f"node '{node.name}' ({node.op_type})" if node is not None else "the model"
        return PassFailedError(self.name, f"{where}: {message}; refusing rather than risk a model that runs but "
                               "computes the wrong thing")
