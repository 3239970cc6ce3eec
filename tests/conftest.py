"""Shared pytest setup.

* Put the repository root on ``sys.path`` so tests can import the top-level ``models`` package
  (test-model generators), which is not installed with ``mograph``.
* Tests are collected with ``--import-mode=importlib`` (so test files in different folders may share
  a name); folders that hold private test helpers (``_something.py``) are put on ``sys.path`` so tests
  import them by plain name. Helper module names must therefore be unique across ``tests/``.
"""

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
_ROOT = str(_TESTS.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
for _helper in sorted(_TESTS.rglob("_*.py")):
    if _helper.name != "__init__.py" and "__pycache__" not in _helper.parts:
        _folder = str(_helper.parent)
        if _folder not in sys.path:
            sys.path.append(_folder)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def kernel_library(tmp_path_factory):
    """The CUDA kernel library, compiled from scratch once per test run (it takes minutes on a small CPU).

    Every test that needs a freshly built library (the build/ABI tests, the TensorRT plugin status test) shares
    this one build. Skips where no nvcc is found.
    """
    from mograph._kernels import build

    if build.find_nvcc() is None:
        pytest.skip("nvcc not found on PATH (nor NVCC / CUDA_HOME): cannot build")
    return build.build(build_dir=tmp_path_factory.mktemp("kernels_build"), force=True)


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory):
    """One folder for the models the tests export with torch, shared by every test module of the run (an export
    takes seconds to minutes; modules that export the same model find it there). ``MOGRAPH_TEST_EXPORT_DIR``
    keeps it across runs."""
    import os

    env = os.environ.get("MOGRAPH_TEST_EXPORT_DIR")
    if env:
        Path(env).mkdir(parents=True, exist_ok=True)
        return Path(env)
    return tmp_path_factory.mktemp("exports")
