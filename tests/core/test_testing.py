""":mod:`mograph.testing` is the tests' one helper layer: it skips a test itself where onnxruntime is missing."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys

import numpy as np
import pytest

from mograph import testing

MODEL = '<ir_version: 8, opset_import: ["" : 17]> g (float[1] x) => (float[1] y) { y = Relu(x) }'


def _without_onnxruntime(monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtins.__import__

    def fake(name: str, *args: object, **kwargs: object) -> object:
        if name == "onnxruntime":
            raise ImportError("No module named 'onnxruntime'")
        return real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", fake)


def test_run_ort_skips_the_test_without_onnxruntime(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_onnxruntime(monkeypatch)
    with pytest.raises(pytest.skip.Exception, match=r"onnxruntime is not installed: pip install 'mograph\[ort\]'"):
        testing.run_ort(testing.parse(MODEL), {})
    with pytest.raises(pytest.skip.Exception):
        testing.check_pass(testing.Pipeline(), testing.parse(MODEL), feeds={"x": np.ones(1, np.float32)})


def test_outside_a_test_the_error_names_the_extra() -> None:
    code = ("import builtins, sys\nreal = builtins.__import__\n"
            "def fake(n, *a, **k):\n    if n == 'onnxruntime': raise ImportError(n)\n    return real(n, *a, **k)\n"
            "builtins.__import__ = fake\nfrom mograph import testing\nfrom mograph.errors import BackendUnavailableError\n"
            f"try:\n    testing.run_ort(testing.parse({MODEL!r}), {{}})\n"
            "except BackendUnavailableError as e:\n    print('error:', e)\n")
    env_free = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env_free)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "error: onnxruntime is not installed: pip install 'mograph[ort]'"


def test_run_ort_leaves_out_feeds_the_model_has_no_input_for() -> None:
    pytest.importorskip("onnxruntime")
    (y,) = testing.run_ort(testing.parse(MODEL), {"x": np.array([-1.0], np.float32), "unused": None})
    assert y.tolist() == [0.0]
