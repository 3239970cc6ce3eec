"""Helper of the fusion tests: a fusion followed by the ``lower`` step (the checks are :mod:`mograph.testing`)."""

from __future__ import annotations

import onnx_ir as ir

from mograph.lowering import LowerPass
from mograph.pass_infra import Pass
from mograph.testing import Pipeline


def lowered(pass_obj: Pass, target: str, **lower_options: object) -> Pipeline | Pass:
    """``pass_obj`` then the ``lower`` step for ``target``, as ``--passes X --target T`` runs them
    (``mograph``: the pass alone, whose ops keep their function bodies)."""
    if target == "mograph" and not lower_options:
        return pass_obj
    return Pipeline(pass_obj, LowerPass(target=target, **lower_options))


def mask_index_inputs(model: ir.Model) -> set[str]:
    """The names of the values every attention node takes as its mask index (input 3 of Attention, 4 of MHA)."""
    out = set()
    for n in model.graph:
        i = {"Attention": 3, "MultiHeadAttention": 4}.get(n.op_type) if n.domain == "com.microsoft" else None
        if i is not None and len(n.inputs) > i and n.inputs[i] is not None:
            out.add(n.inputs[i].name)
    return out
