"""mograph's CUDA kernels: their sources, build, C ABI binding, numpy references and GPU check harness.

The fused ops of the ``mograph`` domain have CUDA kernels (``src/``, ``include/mograph_kernels.h``) that the
TensorRT plugins launch. This package ships them with what Python needs around them:

* :mod:`mograph._kernels.reference`: the numpy reference of every fused op, the single ground truth that
  ``CustomOp.reference`` (``mograph.passes.fusion.ops``), the kernels' GPU tests and the lowerings' tests use;
* :mod:`mograph._kernels.abi`: the ctypes statement of the C ABI, :func:`~mograph._kernels.abi.load`;
* :mod:`mograph._kernels.build`: ``python -m mograph._kernels.build`` compiles the library with nvcc;
* :mod:`mograph._kernels.harness`: the GPU correctness harness (torch or CuPy, imported only when asked).

Every module imports with the standard library and numpy only; nothing here needs a GPU, nvcc or torch until
a function that uses one is called. See ``README.md`` beside this file.
"""

from __future__ import annotations

__all__: list[str] = []
