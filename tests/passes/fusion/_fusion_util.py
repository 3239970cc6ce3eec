"""Helpers of the fusion tests: the shared pass-test checks (:mod:`mograph.testing`) and the lower step."""

from __future__ import annotations

from mograph.lowering import LowerPass
from mograph.pass_infra import Pass
from mograph.testing import (  # noqa: F401 - re-exported for the fusion tests
    Pipeline,
    assert_close,
    assert_untouched,
    feeds_for,
    op_counts,
    op_types,
    parse,
    run_ort,
    run_pass,
    to_ir,
    to_proto,
)
from mograph.testing import check_pass as check_fusion  # noqa: F401

ORT = None


def lowered(pass_obj: Pass, target: str, **lower_options: object) -> Pipeline | Pass:
    """``pass_obj`` then the ``lower`` step for ``target``, as ``--passes X --target T`` runs them
    (``mograph``: the pass alone, whose ops keep their function bodies)."""
    if target == "mograph" and not lower_options:
        return pass_obj
    return Pipeline(pass_obj, LowerPass(target=target, **lower_options))
