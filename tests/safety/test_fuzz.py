"""Fuzz: hundreds of seeded structural mutations of small models through ``inspect`` and
``optimize --passes cleanup,fuse``.

For every mutant (``_mutations``: dropped nodes, rewired inputs, cycles, bad attributes and dtypes,
huge/zero/negative dims, lying or missing external data, unknown ops and opsets, broken outputs) both
commands run in one child process under a 3 GiB memory limit, a 256 MiB file-size limit and a per-run
timeout (``_limited_cli``), and the test asserts:

* no traceback, no timeout, no crash: the exit code is 0 or one of the documented 2-7;
* the input folder is unchanged: the model and its data byte for byte, nothing new but the output of a
  successful ``optimize``, no temporary folder left;
* an output written with exit 0 is a valid model: mograph loads it (structure and external data
  checked), ONNX loads it with its data, and it passes ``onnx.checker`` whenever the input did.

``MOGRAPH_FUZZ_MUTANTS`` sets the number of mutants (default 500, seconds to a minute on two cores);
``MOGRAPH_FUZZ_SEED`` shifts the seeds.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from pathlib import Path

import onnx
import pytest
from _limited_cli import run_cli_jobs
from _mutations import base_models, mutant

import mograph

MUTANTS = int(os.environ.get("MOGRAPH_FUZZ_MUTANTS", "500"))
FIRST_SEED = int(os.environ.get("MOGRAPH_FUZZ_SEED", "0"))
DOCUMENTED = {0, 2, 3, 4, 5, 6, 7}


def _snapshot(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _checker_passes(proto: onnx.ModelProto) -> bool:
    try:
        onnx.checker.check_model(proto)
    except Exception:  # noqa: BLE001 - any checker complaint
        return False
    return True


def _output_problem(folder: Path, input_valid: bool) -> str | None:
    out = folder / "out.onnx"
    if not out.is_file():
        return "exit 0 but no output file"
    try:
        mograph.load(out)
    except Exception as exc:  # noqa: BLE001
        return f"mograph cannot load its own output: {exc}"
    try:
        proto = onnx.load(str(out))
    except Exception as exc:  # noqa: BLE001
        return f"onnx cannot load the output with its data: {exc}"
    if input_valid and not _checker_passes(proto):
        try:
            onnx.checker.check_model(proto)
        except Exception as exc:  # noqa: BLE001
            return f"the input passed onnx.checker, the output does not: {exc}"
    return None


@pytest.mark.slow
def test_fuzz_mutants_through_inspect_and_optimize(tmp_path):
    bases = base_models()
    mutants, jobs, before, valid = {}, [], {}, {}
    for seed in range(FIRST_SEED, FIRST_SEED + MUTANTS):
        m = mutant(seed, bases)
        folder = tmp_path / f"m{seed:04d}"
        path = m.write(folder)
        mutants[seed] = m
        before[seed] = _snapshot(folder)
        valid[seed] = _checker_passes(m.proto)
        jobs.append({"id": f"{seed}/inspect", "argv": ["inspect", "--json", str(path)], "cwd": str(folder)})
        jobs.append(
            {
                "id": f"{seed}/optimize",
                "argv": ["optimize", str(path), "-o", str(folder / "out.onnx"), "--passes", "cleanup,fuse", "-q"],
                "cwd": str(tmp_path),
            }
        )
    results = run_cli_jobs(jobs, memory=3 << 30, fsize=256 << 20, timeout=60)

    failures: list[str] = []
    histogram: dict[str, Counter[object]] = {"inspect": Counter(), "optimize": Counter()}
    for seed, m in mutants.items():
        folder = tmp_path / f"m{seed:04d}"
        what = f"mutant {seed} ({m.base}: {'; '.join(m.applied) or 'unchanged'})"
        for command in ("inspect", "optimize"):
            result = results[f"{seed}/{command}"]
            code = result["code"]
            histogram[command][code] += 1
            if code not in DOCUMENTED:
                detail = result.get("traceback") or result["stderr"]
                failures.append(f"{what}: {command} -> {code}\n{detail[-1500:]}")
            elif "Traceback" in result["stderr"]:
                failures.append(f"{what}: {command} printed a traceback\n{result['stderr'][-1500:]}")
        after = _snapshot(folder)
        expected = dict(before[seed])
        if results[f"{seed}/optimize"]["code"] == 0:
            new = {k: v for k, v in after.items() if k not in before[seed]}
            if not new or any(not (k == "out.onnx" or (k.startswith("out.onnx.") and k.endswith(".data"))) for k in new):
                failures.append(f"{what}: optimize exited 0 and left {sorted(new)}")
            expected.update(new)
            problem = _output_problem(folder, valid[seed])
            if problem:
                failures.append(f"{what}: {problem}")
        if after != expected:
            changed = sorted(k for k in set(after) | set(expected) if after.get(k) != expected.get(k))
            failures.append(f"{what}: the folder changed: {changed}")

    summary = ", ".join(
        f"{command}: " + " ".join(f"{code}x{n}" for code, n in sorted(h.items(), key=lambda kv: str(kv[0])))
        for command, h in histogram.items()
    )
    print(f"\nfuzz: {MUTANTS} mutants of {len(bases)} models, exit codes {summary}")
    assert len(results) == len(jobs) == 2 * MUTANTS  # every run reported back
    assert not failures, f"{len(failures)} failure(s):\n\n" + "\n\n".join(failures[:15])
