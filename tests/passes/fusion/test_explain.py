"""``--explain`` asks the rules: the regions come from the anchors the rules declare (``Rule.anchors``), and each
is reported with the first node where the rule's own matching stopped (:mod:`mograph.pattern_explain`)."""

from __future__ import annotations

from typing import Any, ClassVar

import onnx_ir as ir
from _fusion_util import lowered
from mograph.passes.fusion._common import FusionPass
from mograph.passes.fusion.attention import FuseAttentionPass
from test_attention import attention_text

from mograph.pass_infra import graph_fingerprint
from mograph.patterns import Anchor, MatchResult, Rule
from mograph.testing import assert_untouched, parse, to_ir


class _Toy(Rule):
    """sqrt(|exp(-x)|) -> Exp(x) (nonsense math: the rule exists to declare an anchor mid-pattern)."""

    anchors: tuple[Anchor, ...] = (Anchor(("Exp",), "toy", value="e"),)
    labels = {"e": "the exponential"}  # noqa: RUF012 - read-only, as Rule declares it
    min_candidate_nodes = 2

    def pattern(self, op: Any, x: Any) -> Any:
        return op.Sqrt(op.Abs(op.Exp(op.Neg(x), _outputs=["e"])))

    def check(self, context: Any, x: ir.Value, **_: Any) -> MatchResult:  # type: ignore[override]
        if x.shape is not None and len(x.shape) == 1:
            return self.fail("the toy rule takes no vector", x)
        return self.ok()

    def rewrite(self, op: Any, x: ir.Value, **_: Any) -> Any:
        return op.Exp(x)


class _Unanchored(_Toy):
    anchors = ()


class _ToyPass(FusionPass):
    name = "fuse-toy"
    rules: ClassVar[tuple[type[Rule], ...]] = (_Toy,)


def _toy_model(tail: str, shape: str = "2,3") -> Any:
    return parse(f'''<ir_version: 8, opset_import: ["" : 17]>
g (float[{shape}] x) => (float[{shape}] y) {{
  n = Neg(x)
  e = Exp(n)
  {tail}
}}''')


#: The toy pattern up to its Abs, then a Relu where the root (Sqrt) belongs.
_NO_ROOT = "a = Abs(e)\n  r = Relu(a)\n  y = Identity(r)"


def test_a_rules_declared_anchor_drives_explain() -> None:
    """The toy rule's anchor sits in the middle of its pattern (the root is the Sqrt): a node between the anchor and
    the root that the pattern does not expect is reported at that node, though no root's match reaches it."""
    p = _ToyPass(explain=True)
    result = assert_untouched(p, _toy_model(_NO_ROOT))
    (region,) = result.details["unfused_regions"]
    assert region["op"] == "Exp" and region["kind"] == "toy" and region["rule"] == "_Toy", region
    assert region["failed_at_op"] == "Relu" and region["root"] is None, region
    assert region["reason"].startswith("expected Sqrt(the output of 'Abs#2') after Abs 'Abs#2', got Relu"), region
    # the pattern followed to its root: the reason is the rule's own (its check), at the root it was tried from
    result = assert_untouched(p, _toy_model("a = Abs(e)\n  y = Sqrt(a)", shape="6"))
    (region,) = result.details["unfused_regions"]
    assert region["reason"] == "the toy rule takes no vector" and region["root"].startswith("Sqrt"), region
    # the same rule without the anchor: --explain has no region to report
    class _Bare(_ToyPass):
        rules: ClassVar[tuple[type[Rule], ...]] = (_Unanchored,)

    result = assert_untouched(_Bare(explain=True), _toy_model(_NO_ROOT))
    assert "unfused_regions" not in result.details


def test_an_anchor_whose_pattern_below_does_not_match_is_no_region() -> None:
    """An Exp of something that is not the pattern's Neg is no region of the toy rule (the part of the pattern
    below the anchor must match): nothing is reported."""
    text = _toy_model(_NO_ROOT)
    assert _ToyPass(explain=True).call(to_ir(text)).details["unfused_regions"]
    text.graph.node[0].op_type = "Abs"
    result = assert_untouched(_ToyPass(explain=True), text)
    assert result.details["unfused_regions"] == []


def test_attention_output_side_near_miss_names_the_failing_node() -> None:
    """The heads merged by the wrong Transpose: the rule's root (the merge Reshape) is reached by no match of the
    rule, yet --explain names the Transpose and what the rule expected there, from the rule's pattern."""
    text = attention_text().replace("ot = Transpose<perm=[0,2,1,3]>(o)", "ot = Transpose<perm=[0,1,2,3]>(o)")
    proto = parse(text)
    model = to_ir(proto)
    before = graph_fingerprint(model)
    result = assert_untouched(lowered(FuseAttentionPass(explain="true"), "ort"), proto)
    (entry,) = result.details["fuse-attention"]["unfused_softmax"]
    assert entry["failed_at_op"] == "Transpose", entry
    assert "expected Transpose(P V, perm=[0, 2, 1, 3])" in entry["reason"], entry
    assert "Attribute perm mismatch" in entry["reason"], entry
    assert graph_fingerprint(model) == before


def test_attention_output_left_unmerged_is_reported() -> None:
    """No merge Reshape at all (the Transpose is the graph output): reported at the Transpose, which nothing reads."""
    text = (attention_text().replace("ot = Transpose<perm=[0,2,1,3]>(o)", "y = Transpose<perm=[0,2,1,3]>(o)")
            .replace("\n  y = Reshape(ot, shp3)", "").replace("(float[2,5,16] y)", "(float[2,5,4,4] y)"))
    result = assert_untouched(lowered(FuseAttentionPass(explain="true"), "ort"), parse(text))
    (entry,) = result.details["fuse-attention"]["unfused_softmax"]
    assert entry["failed_at_op"] == "Transpose", entry
    assert "expected Reshape(the merged heads, [batch, seq, heads * head_dim])" in entry["reason"], entry
    assert entry["reason"].endswith("got nothing (a graph output)"), entry


def test_classifier_softmax_is_no_attention() -> None:
    """A Softmax over logits that is a graph output: the rule's pattern above the probabilities has nothing to
    follow, so it is not reported as an unfused attention."""
    text = '''<ir_version: 8, opset_import: ["" : 17]>
g (float[2,4,5,8] q, float[2,4,8,5] k, float[2,4,5,5] m) => (float[2,4,5,5] y) {
  s = MatMul(q, k)
  a = Add(s, m)
  y = Softmax<axis=-1>(a)
}'''
    result = assert_untouched(FuseAttentionPass(explain="true"), parse(text))
    assert result.details["unfused_softmax"] == []


def test_attention_scores_side_stray_node_is_named() -> None:
    """An Identity between the scores and the Softmax: the rule's pattern below the probabilities is found through
    it, and --explain names it with what the rule expected there (the old walker only said the output matched)."""
    text = attention_text().replace("sm = Add(bias, s)", "sm0 = Add(bias, s)\n  sm = Identity(sm0)")
    result = assert_untouched(lowered(FuseAttentionPass(explain="true"), "ort"), parse(text))
    (entry,) = result.details["fuse-attention"]["unfused_softmax"]
    assert entry["failed_at_op"] == "Identity", entry
    assert entry["reason"].startswith("expected Add(..., mask) or Div("), entry
    assert "MatMul(Q, K^T) before Softmax" in entry["reason"] and "got Identity" in entry["reason"], entry


def test_a_graph_input_where_the_pattern_wants_a_node_is_said_plainly() -> None:
    """onnxscript's "Computed node pattern does not match uncomputed IR value" becomes words about the user's
    graph: the toy pattern wants Abs(Exp(..)), the model's Abs reads a graph input."""
    from mograph.patterns import apply_rules

    model = to_ir(parse('''<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3] a) => (float[2,3] y) {
  b = Abs(a)
  y = Sqrt(b)
}'''))
    report = apply_rules(model, [_Toy()])
    assert [m.reason for m in report.near_misses] == [
        "an input the pattern expects to be computed by a node is a graph input or a constant here"]
