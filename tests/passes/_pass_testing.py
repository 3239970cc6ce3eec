"""Helpers the pass tests of several families share (cleanup, prune): run a pass honestly, list ops,
check that a second run changes nothing."""

from __future__ import annotations

import onnx_ir as ir

from mograph.pass_infra import Pass, PassManager, PassReport

__all__ = ["run_pass", "op_types", "assert_second_run_changes_nothing"]


def run_pass(p: Pass, model: ir.Model) -> PassReport:
    """Run ``p`` through the pass manager with the honesty check on (a lying ``modified`` fails)."""
    return PassManager([p], check_modified=True).run(model).passes[0]


def op_types(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def assert_second_run_changes_nothing(p: Pass, model: ir.Model) -> PassReport:
    ops = op_types(model)
    again = run_pass(type(p)(**p.config), model)
    assert again.modified is False
    assert op_types(model) == ops
    return again
