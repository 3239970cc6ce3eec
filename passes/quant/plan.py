"""The precision plan: which precision every relevant node runs in, and why.

Every quantization pass decides per node and writes the decision down, so an accuracy problem can be
traced to a layer and a reason, and a person can overrule the decision::

    pass: qdq-int8
    calibration: {source: folder calib/, samples: 64, calibrator: minmax, random: false}
    nodes:
    - {node: /encoder/layer.0/attention/self/query/MatMul, op: MatMul, precision: int8,
       reason: 'default rule: weight matmul'}
    - {node: /encoder/layer.5/output/dense/MatMul, op: MatMul, precision: fp32,
       reason: 'default rule: final projection'}
    - {node: /embeddings/word_embeddings/Gather, op: Gather, precision: fp32,
       reason: 'default rule: embedding lookup'}

Reasons start with one of three words: ``default rule``, ``measured sensitivity`` (with the measured
value) or ``user override`` (``--keep-fp32`` or an edited plan).  ``--precision-plan plan.yaml`` applies an
edited plan instead of deciding again: each node it names gets the precision it gives; nodes it does not
name fall back to the default rules.  The same plan is returned in the pass report's ``details``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx_ir as ir
import yaml

from mograph._paths import write_text
from mograph._yaml import load_yaml_file
from mograph.errors import OptionError

__all__ = ["PlanEntry", "PrecisionPlan", "node_key", "load_plan", "Budget", "parse_budget"]


def node_key(node: ir.Node) -> str:
    """The name a plan uses for ``node``: its name, or ``Op->first output`` when it has none."""
    if node.name:
        return node.name
    out = node.outputs[0].name if node.outputs else "?"
    return f"{node.op_type}->{out}"


@dataclass
class PlanEntry:
    node: str
    op: str
    precision: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"node": self.node, "op": self.op, "precision": self.precision, "reason": self.reason}


@dataclass
class PrecisionPlan:
    """Ordered per-node decisions plus free-form context (calibration source, budget)."""

    pass_name: str
    entries: list[PlanEntry] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, node: ir.Node, precision: str, reason: str) -> PlanEntry:
        entry = PlanEntry(node_key(node), node.op_type, precision, reason)
        self.entries.append(entry)
        return entry

    def precision_of(self, key: str) -> str | None:
        for e in self.entries:
            if e.node == key:
                return e.precision
        return None

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.precision] = out.get(e.precision, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pass": self.pass_name}
        out.update(self.meta)
        out["nodes"] = [e.to_dict() for e in self.entries]
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, width=120)

    def write(self, path: str | Path) -> None:
        """Write the plan atomically, never through a symbolic link; a missing folder is an error (exit 2)."""
        write_text(path, self.to_yaml(), "--precision-plan-out")

    @classmethod
    def from_dict(cls, data: Any, origin: str = "plan") -> PrecisionPlan:
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
            raise OptionError(f"--precision-plan {origin}: expected a mapping with a 'nodes' list")
        plan = cls(_text(data.get("pass", ""), origin, "pass"))
        for i, item in enumerate(data["nodes"]):
            if not isinstance(item, dict) or "node" not in item or "precision" not in item:
                raise OptionError(f"--precision-plan {origin}: entry {i} needs 'node' and 'precision'")
            for key in ("node", "op", "precision", "reason"):
                _text(item.get(key, ""), origin, f"entry {i}: {key}")
            plan.entries.append(
                PlanEntry(str(item["node"]), str(item.get("op", "")), str(item["precision"]).lower(),
                          str(item.get("reason", "")))
            )
        plan.meta = {k: v for k, v in data.items() if k not in ("pass", "nodes")}
        return plan


def load_plan(source: str | Path | dict[str, Any] | PrecisionPlan) -> PrecisionPlan:
    """Read a plan from a YAML file (or accept a dict / plan object from the Python API)."""
    if isinstance(source, PrecisionPlan):
        return source
    if isinstance(source, dict):
        return PrecisionPlan.from_dict(source)
    path = Path(source)
    if not path.exists():
        raise OptionError(f"--precision-plan: file {path} does not exist")
    data = load_yaml_file(path, "--precision-plan", OptionError)  # bounded: size, aliases, binary
    return PrecisionPlan.from_dict(data, str(path))


def _text(value: Any, origin: str, where: str) -> str:
    """A plan field: a string (or a number written bare); anything else is refused without showing it."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise OptionError(f"--precision-plan {origin}: {where} must be a string, not a {type(value).__name__}")
    return str(value)


@dataclass(frozen=True)
class Budget:
    """An accuracy budget on the model outputs: ``cosine >= value`` or ``max-abs <= value``."""

    metric: str
    value: float

    def met(self, measured: float) -> bool:
        return measured >= self.value if self.metric == "cosine" else measured <= self.value

    def __str__(self) -> str:
        return f"{self.metric}{'>=' if self.metric == 'cosine' else '<='}{self.value:g}"


_BUDGET = re.compile(r"^\s*(cosine|max-abs)\s*(>=|<=)\s*([0-9.eE+-]+)\s*$")


def parse_budget(text: str) -> Budget:
    """Parse ``cosine>=0.995`` or ``max-abs<=0.05``."""
    m = _BUDGET.match(text or "")
    if not m:
        raise OptionError(f"--accuracy-budget {text!r}: expected 'cosine>=0.995' or 'max-abs<=0.05'")
    metric, op, value = m.group(1), m.group(2), float(m.group(3))
    if (metric == "cosine") != (op == ">="):
        raise OptionError(f"--accuracy-budget {text!r}: use cosine>=X or max-abs<=X")
    return Budget(metric, value)
