"""``tools/bench_memory.py``'s sampling thread lets go of the frames it reads (issue 25 item 3).

A frame object kept past its function's return keeps that function's locals alive: the sampler, which
reads the main thread's stack at each peak and trace step, held the last frame it read, and with it a
model copy a pass had dropped (fp16's float16 twin, 0.5x the weights), so the tool measured itself.
Checked with a weak reference, in a subprocess running the tool's own sampler code.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROGRAM = r"""
import gc, sys, time, weakref
import numpy as np

class Held:
    pass

def callee():
    held = Held()
    held.data = np.ones(64 * 2**20 // 8)  # resident at once: the sampler reads this frame
    time.sleep(0.5)
    return weakref.ref(held)

ref = callee()
gc.collect()
time.sleep(0.2)
print("alive" if ref() is not None else "freed")
"""


def test_sampler_keeps_no_frame_alive():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_memory
    finally:
        sys.path.remove(str(ROOT / "tools"))
    sampler = bench_memory._WORKER.split("from mograph.cli import main")[0]
    assert "threading.Thread(target=sample" in sampler
    code = sampler + _PROGRAM
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"MOGRAPH_MEMORY_TRACE_MB": "8", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "freed"
