"""Run one benchmark case of tools/gpu_kernels.py once, for Nsight Compute: torch.compile's kernel and ours.

Both run three times to warm up, then once more inside an NVTX range named ``prof``, so that ncu profiles
exactly those two launches (Inductor's Triton kernel first, ours second)::

    ncu --clock-control none --nvtx --nvtx-include "prof/" --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section InstructionStats \\
        python tools/profile_case.py mograph/_kernels/build/libmograph_kernels.so rms_norm f16 16384 768

Arguments: the kernel library, then op, dtype (f32, f16, bf16), rows and hidden as in gpu_kernels.py.
Needs a CUDA GPU and torch. Inductor's compiled kernels (with their cubins, for ``cuobjdump -sass``) are left
under /tmp/torchinductor_<user>.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

USAGE = "usage: python tools/profile_case.py LIBRARY OP DTYPE ROWS HIDDEN"


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(USAGE, file=sys.stderr)
        return 2
    import torch

    spec = importlib.util.spec_from_file_location("gpu_kernels", Path(__file__).resolve().parent / "gpu_kernels.py")
    gk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gk)
    from mograph._kernels import abi

    lib = abi.load(argv[0])
    op, dtype, rows, hidden = argv[1], argv[2], int(argv[3]), int(argv[4])
    b = gk.Bench(torch, lib, abi, op, dtype, rows, hidden)
    compiled = torch.compile(b.decomposed())
    for _ in range(3):
        compiled(b.sets[0])
        b.ours(b.sets[0])
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    compiled(b.sets[1 % len(b.sets)])
    b.ours(b.sets[1 % len(b.sets)])
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print("done", op, dtype, rows, hidden, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
