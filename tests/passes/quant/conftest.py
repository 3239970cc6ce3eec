import pytest

pytest.importorskip("onnxruntime")
