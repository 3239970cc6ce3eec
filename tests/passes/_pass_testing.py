"""Helpers the pass tests of several families share (cleanup, prune): run a pass through the pass manager
with its honesty check, check that a second run changes nothing (the rest is in :mod:`mograph.testing`)."""

from __future__ import annotations

import onnx_ir as ir

from mograph.pass_infra import Pass, PassManager, PassReport
from mograph.testing import op_types

__all__ = ["assert_second_run_changes_nothing", "run_pass"]


def run_pass(p: Pass, model: ir.Model) -> PassReport:
    """Run ``p`` through the pass manager with the honesty check on (a lying ``modified`` fails)."""
    return PassManager([p], check_modified=True).run(model).passes[0]


def assert_second_run_changes_nothing(p: Pass, model: ir.Model) -> PassReport:
    ops = op_types(model)
    again = run_pass(type(p)(**p.config), model)
    assert again.modified is False
    assert op_types(model) == ops
    return again
