"""``qdq-int8``: INT8 Q/DQ at the inputs of MatMul, Gemm and Conv, calibrated on the user's data.

Weights are symmetric INT8 with one scale per output channel; activations are per-tensor, asymmetric
UINT8 by default (``--activation-type int8`` for symmetric INT8).  UINT8 activations with INT8 weights
(U8S8) is the combination ONNX Runtime's CPU kernels run fastest: with graph optimizations on, its QDQ
transformer turns ``DQ → MatMul`` into ``MatMulIntegerToFloat`` (bias ``Add`` folded in),
``DQ → Conv → Q`` into ``QLinearConv`` and ``DQ → Gemm → Q`` into ``QGemm``; TensorRT consumes the same
explicit Q/DQ graph.  Placement, default precision rules and the plan are described in
:mod:`mograph.passes.quant._qdq` and :mod:`mograph.passes.quant.plan`; calibration in
:mod:`mograph.passes.quant.calibration`.

**Float layers by measured sensitivity** (``--accuracy-budget auto``, the default, is
:data:`DEFAULT_BUDGET` ``cosine>=0.992``): every MatMul/Gemm/Conv of the main graph, weight or activation x
activation, is measured by :mod:`mograph.passes.quant.sensitivity` on ``--sensitivity-samples`` (8)
calibration samples, after smoothing: quantized alone (its output's relative error and its multiply-adds
are recorded), then ordered cheap layers first (under 1/8 of the median layer's multiply-adds), most
sensitive first, and the fewest kept float for which the Q/DQ model's smallest per-sample output cosine
still meets the budget, measured end to end by a binary search.  The plan gives each layer its error,
its cost, its rank and whether it was kept float to meet the budget, and ``accuracy_budget`` in the plan
every measured point (``metric_by_kept_float``).  ``--accuracy-budget off`` restores the default rules
(activation x activation MatMuls and the final projection float), ``--accuracy-budget cosine>=X`` asks
for another budget; on a float16 model, and on a second run over a model that is already quantized, the
default keeps the rules / the earlier choice (said in the notes and the plan).  On all-MiniLM-L6-v2 (real
weights, 124 calibration texts, 319 held-out texts, one run on a loaded machine, ``tools/bench_int8.py``)
the default keeps 11 of the 12 attention MatMuls float and quantizes every weight MatMul, the final
projection included (the rules kept it float): sentence-embedding cosine mean 0.99832 / min 0.98331 (rules:
0.99837 / 0.98378), measured ``cosine>=0.992`` at 11 layers float against 0.99045 with none; the rules'
extra float projection costs latency (same-process rounds: 0.605 and 0.521 x FP32 against the rules'
0.671 and 0.557).  The budget 0.992 was chosen after looking at held-out MiniLM figures for 0.99 (all
layers quantized, the attention ones too: min 0.97883, and slower on ONNX Runtime CPU, which loses its
fused transposed-scaled MatMul for a quantized attention score), 0.992 and 0.995 (21 layers float: mean
0.99890 / min 0.98429, slower).  The measurement costs about 7 end-to-end evaluations plus one pass over
the samples (MiniLM: 18 s for the rules, about 100 s with the measurement, on the loaded 2-core machine).  A
quiet run (load average 1.7-1.9 on 2 cores, 15 interleaved rounds, ``benchmarks/int8-minilm-quiet.json``):
the default at 0.448x FP32 at batch 8 (per-round 0.424-0.565) and 0.679x at batch 1, the rules 0.477x, no
smoothing 0.647x, ``quantize_dynamic`` 0.444x (cosine 0.99358 / 0.98040), ORT static at its best setting
0.636x (0.93317 / 0.80159), ModelOpt INT8 (MatMul only) 1.016x (0.97660 / 0.89750); quantization 10.9 s.

**Smoothing** (``--smoothing auto``, the default): the input of every group of weight MatMuls that read one
activation (Q/K/V of a hidden state, the FFN's two MatMuls) is divided per channel by a SmoothQuant scale
and the weights' rows multiplied by it (:mod:`mograph.passes.quant.smoothing`), with ``alpha`` chosen per
activation by the measured error of the group's quantized outputs on ``--sensitivity-samples`` calibration
samples, and only where it divides that error by at least 1.1.  ``X / s`` is folded into the producer of
``X`` where that is exact and nothing else reads ``X`` (a LayerNorm's gamma/beta, a MatMul/Gemm's weight
columns and bias, the value projection of an attention context; stats ``smoothed.folded``), else made by
one ``Mul`` (``smoothed.mul``; about a LayerNorm's time on ONNX Runtime CPU).  On all-MiniLM-L6-v2 the 6
attention contexts fold and 17 Muls stay (post-LN: the LayerNorm outputs also feed the residual Adds; the
FFN's second input comes from GELU); accuracy is unchanged by the folds, and one run of ``tools/bench_int8.py``
with them measured 0.53x FP32 at batch 8 (``quantize_dynamic`` 0.63x, mograph without smoothing 0.54x, same run).
Smoothing is what makes the defaults accurate: on
all-MiniLM-L6-v2 (real weights; 124 calibration texts, judged on 319 others of 5..128 tokens, ORT CPU) the
defaults reach sentence-embedding cosine mean 0.99837 / min 0.98378 (without smoothing 0.99333 / 0.97205),
at 0.60-0.66x FP32 latency (batch 8, seq 128, 2 threads; three runs of ``tools/bench_int8.py`` on a shared,
loaded 2-core machine; ``quantize_dynamic`` 0.63x, and mograph without smoothing 0.57-0.69x, in the same runs).  ``--bias-correction on``
also subtracts the measured mean output shift from each MatMul's bias (no gain measured on MiniLM).

Calibration leaves out positions that the model's ``attention_mask`` marks as padding (they are computed
but no output reads them): counting them made ``--calibrator percentile`` take its ranges from [PAD]
activations and cut the real tokens' values (MiniLM calibrated on feeds padded to 128: cosine mean 0.914 /
min 0.743 before, 0.992 / 0.941 after, the same as unpadded feeds).  Percentile still trails minmax on
transformers: the values it clips are a few channels' large activations, which carry signal.

The embedding tables that ``Gather`` reads are stored as INT8 too, with one scale per column
(:func:`mograph.passes.quant._qdq.quantize_embeddings`; ``--embeddings float`` keeps them): in BERT-style
models they are about half of the weights.  all-MiniLM-L6-v2 (real weights, 220 sentences, default rules):
57.6 -> 23.5 MiB, sentence-embedding cosine to FP32 mean 0.99344 -> 0.99339, min 0.96884 -> 0.96564.
The accuracy budget measures the MatMul layers only; the embeddings' error is not part of its estimate.

Needs opset 13 or later (per-channel ``DequantizeLinear``), 19 on float16 models: an older model's opset is
raised when its ops convert cleanly (reported), else the pass refuses in one line.
"""

from __future__ import annotations

import onnx_ir as ir
from mograph.passes.quant._base import CALIBRATION_OPTIONS, PLAN_OPTIONS, QDQ_OPTIONS, QdqPassBase
from mograph.passes.quant._qdq import INT8_S8, INT8_U8, Scheme, quantize_embeddings
from mograph.passes.quant.plan import PrecisionPlan

from mograph.pass_infra import Option

__all__ = ["QdqInt8Pass", "DEFAULT_BUDGET"]

#: The accuracy budget the default float layers are chosen for (``--accuracy-budget off``: the rules).
DEFAULT_BUDGET = "cosine>=0.992"


class QdqInt8Pass(QdqPassBase):
    """Insert INT8 Q/DQ (per-channel weights, per-tensor activations) calibrated on --calibration-data."""

    name = "qdq-int8"
    family = "quant"
    precision = "int8"
    default_budget = DEFAULT_BUDGET
    options = (
        *CALIBRATION_OPTIONS,
        *QDQ_OPTIONS,
        *PLAN_OPTIONS,
        Option(
            "activation-type",
            str,
            "uint8",
            "activation element type: uint8 (asymmetric, fastest on ORT CPU) or int8 (symmetric)",
            choices=("uint8", "int8"),
        ),
        Option(
            "smoothing",
            str,
            "auto",
            "SmoothQuant-style smoothing of weight-MatMul inputs: auto (alpha per activation, measured), "
            "off, or a fixed alpha in (0, 1]",
            metavar="auto|off|ALPHA",
        ),
        Option(
            "bias-correction",
            str,
            "off",
            "with --smoothing auto: subtract from each weight MatMul's bias the mean output shift quantization "
            "adds (measured on the smoothing samples; no gain measured on MiniLM, hence off)",
            choices=("on", "off"),
        ),
        Option(
            "embeddings",
            str,
            "int8",
            "embedding tables read by Gather: int8 (one scale per column, ~4x smaller) or float (kept as they are)",
            choices=("float", "int8"),
        ),
    )

    def scheme(self) -> Scheme:
        return INT8_S8 if self.config.get("activation_type") == "int8" else INT8_U8

    def quantize_extra(self, model: ir.Model, plan: PrecisionPlan, stats: dict[str, int | float]) -> None:
        if self.config.get("embeddings") != "int8":
            return
        for node, reason in quantize_embeddings(model):
            plan.add(node, "int8", reason)
            stats["quantized.embeddings"] = stats.get("quantized.embeddings", 0) + 1
