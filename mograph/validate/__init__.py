"""Numeric validation: do two models compute the same numbers?

A pass may only change *how* a model computes, never *what*.  The check that enforces it runs the
original and the rewritten model on the same inputs and compares every output:

* **Runtime.**  ONNX Runtime on CPU with its own graph optimizations **off** (``ORT_DISABLE_ALL``):
  with them on, ONNX Runtime could fuse the original and a wrongly rewritten model into the same
  kernels and hide the difference.
* **Feeds.**  The user's own (an ``.npz`` whose keys are input names), or seeded random ones that
  respect each input's dtype and meaning: an integer input that indexes a ``Gather`` (token ids into
  an embedding table) gets values in ``[0, rows)``, ``*mask*`` inputs get ``{0, 1}`` (mostly 1),
  token-type / segment ids get ``{0, 1}``, floats are uniform in ``[-1, 1)``.  Dynamic dimensions
  take the sizes the user gave (``{"input_ids": (1, 128)}``; a symbolic dim bound by one input is
  reused by every input sharing the symbol) or a default — 1 for a leading (batch) dim, 64 for the
  spatial dims of an image-like input, else 16 — and the check reports what it chose.
* **Metrics.**  Per output, Polygraphy's comparator computes the maximum absolute and relative
  error (element-wise verdict ``|a-b| <= atol or |a-b| <= rtol*|ref|``) and the cosine similarity;
  mograph adds what Polygraphy lacks: tolerances chosen by dtype and by pass family, NaNs at the
  same place counting as equal, the fraction of differing elements for integer outputs, checks that
  the output names and shapes did not change, and one-line explanations.
* **Tolerances** (:data:`FAMILY_TOLERANCES`).  Passes that must be exact up to rounding
  (``cleanup``, ``shape``, ``fusion``) get tight element-wise bounds, tighter for float32 than for
  float16/bfloat16, and exact equality for integers.  Passes that change the numbers by design
  (``quant``, ``prune``) are judged by cosine similarity.  A check covering several families uses
  the loosest bound that applies; ``atol``/``rtol``/``min_cosine`` override the table for floating
  outputs.

A failed check is an error, not a log line: :func:`mograph.api.run_passes` raises
:class:`~mograph.errors.VerificationError` from ``check["passed"]``.

Layers (private modules; every public name is importable from ``mograph.validate``):

======================  ==========================================================
``_tolerances``         :class:`Tolerance`, :data:`TIGHT`, :data:`FAMILY_TOLERANCES`, :func:`tolerance_for`
``_feeds``              :func:`load_feeds`, :func:`make_feeds`, :func:`graph_inputs`
``_compare``            :func:`compare_outputs` (Polygraphy's comparator, imported lazily)
``_verify``             :class:`Verifier`, :func:`diff_models`
======================  ==========================================================
"""

from __future__ import annotations

from mograph.validate._compare import compare_outputs  # noqa: F401 - public, though not in __all__
from mograph.validate._feeds import FEED_LIMIT_BYTES, graph_inputs, load_feeds, make_feeds
from mograph.validate._tolerances import FAMILY_TOLERANCES, TIGHT, Tolerance, dtype_class, tolerance_for
from mograph.validate._verify import Verifier, diff_models

__all__ = [
    "Tolerance",
    "FAMILY_TOLERANCES",
    "TIGHT",
    "tolerance_for",
    "dtype_class",
    "load_feeds",
    "make_feeds",
    "FEED_LIMIT_BYTES",
    "graph_inputs",
    "Verifier",
    "diff_models",
]
