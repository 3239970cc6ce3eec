"""Where pruning's sizes come from: the core's shape query, on the model in memory.  The analysis neither
serializes the model nor runs ONNX Runtime's symbolic shape inference (it did both before the shape facility
was one), and it finds the same groups as before on a model built in code."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
from _pass_testing import run_pass
from mograph.passes.prune import PruneStructuredPass

from models.builders import bert_tiny
from mograph.testing import to_ir

ROOT = Path(__file__).resolve().parents[3]


def test_prune_and_the_shape_package_name_no_symbolic_inference() -> None:
    """No module of pruning or of the shape facility names ORT's symbolic shape inference or serializes a model."""
    files = sorted((ROOT / "passes" / "prune").glob("*.py")) + sorted((ROOT / "mograph" / "shapes").glob("*.py"))
    assert len(files) >= 10
    offenders = [f"{path.relative_to(ROOT)}: {word}" for path in files for word in
                 ("symbolic_shape_infer", "SymbolicShapeInference", "onnxruntime", "serialize_model", "shape_inference")
                 if word in path.read_text()]
    assert not offenders, offenders


def test_the_analysis_does_not_serialize_the_model(monkeypatch) -> None:
    calls: list[object] = []
    real = ir.serde.serialize_model

    def counting(model: ir.Model) -> object:
        calls.append(model)
        return real(model)

    model = to_ir(bert_tiny(layers=2, hidden=32, heads=4, ffn=64, dynamic=True))
    monkeypatch.setattr(ir.serde, "serialize_model", counting)
    # the output figure runs ONNX Runtime, which needs the model serialized; the analysis itself must not
    entry = run_pass(PruneStructuredPass(ratio=0.5, scope="all", accuracy_budget="off"), model)
    monkeypatch.setattr(ir.serde, "serialize_model", real)
    assert not calls
    s = entry.stats
    assert (s["heads.groups"], s["heads.pruned_groups"], s["ffn.groups"], s["ffn.pruned_groups"]) == (2, 2, 3, 2)
