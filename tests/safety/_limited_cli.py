"""Run many ``mograph`` command lines in one child process, each under memory, file-size and time limits.

Hostile models must not be run in the test process itself: a regression could allocate tens of
gigabytes or write a terabyte-sized sparse file. The child sets ``RLIMIT_AS`` (memory), ``RLIMIT_FSIZE``
(largest file it may write; writing past it fails with ``EFBIG`` instead of killing it) and a per-job
alarm, then runs ``mograph.cli.main`` once per job in-process (one interpreter start for hundreds of
jobs). Each job's exit code, stderr and any exception escaping ``main`` are written to a results file as
soon as the job ends, so a child that dies (a crash, the kernel's OOM killer) loses only the job it was
running: that job is reported as ``"crashed"`` and a new child goes on with the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["run_cli_jobs"]

_CHILD = r"""
import contextlib, io, json, os, resource, signal, sys, traceback

limits = json.loads(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))
resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize"], limits["fsize"]))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


class JobTimeout(BaseException):
    pass


def reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM, the resident-memory high-water mark
    except OSError:
        pass


def peak_rss():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def on_alarm(*_):
    raise JobTimeout()


signal.signal(signal.SIGALRM, on_alarm)
from mograph.cli import main

results = open(sys.argv[2], "a")
for line in sys.stdin:
    job = json.loads(line)
    stdout, stderr = io.StringIO(), io.StringIO()
    result = {"id": job["id"]}
    results.write(json.dumps({"id": job["id"], "started": True}) + "\n")
    results.flush()
    os.chdir(job.get("cwd") or os.getcwd())
    reset_peak_rss()
    signal.alarm(limits["timeout"])
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            result["code"] = main(job["argv"])
    except JobTimeout:
        result["code"] = "timeout"
    except SystemExit as exc:
        result["code"] = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        result["code"] = "exception"
        result["traceback"] = traceback.format_exc()[-4000:]
    finally:
        signal.alarm(0)
    result["peak_rss"] = peak_rss()
    result["stderr"] = stderr.getvalue()[-4000:]
    result["stdout"] = stdout.getvalue()[-4000:]
    results.write(json.dumps(result) + "\n")
    results.flush()
"""


def run_cli_jobs(
    jobs: Sequence[dict[str, Any]],
    *,
    memory: int = 3 << 30,
    fsize: int = 256 << 20,
    timeout: int = 60,
) -> dict[str, dict[str, Any]]:
    """Run ``jobs`` (each ``{"id": str, "argv": [...], "cwd": optional folder}``); return results by id.

    A result has ``code`` (the exit code; ``"timeout"``, ``"exception"`` with ``traceback``, or
    ``"crashed"`` with the child's ``returncode``), ``stderr``, ``stdout`` and ``peak_rss`` (the job's
    resident-memory high-water mark in bytes, where Linux can reset it between jobs).
    """
    pending = list(jobs)
    done: dict[str, dict[str, Any]] = {}
    limits = json.dumps({"memory": memory, "fsize": fsize, "timeout": timeout})
    with tempfile.TemporaryDirectory(prefix="mograph-jobs-") as tmp:
        results_path = Path(tmp) / "results.jsonl"
        while pending:
            results_path.write_text("")
            stdin = "".join(json.dumps(job) + "\n" for job in pending)
            proc = subprocess.run(
                [sys.executable, "-c", _CHILD, limits, str(results_path)],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout * len(pending) + 120,
                env={**os.environ, "MOGRAPH_DISABLE_PLUGIN_AUTOLOAD": "1"},
            )
            started = None
            for line in results_path.read_text().splitlines():
                record = json.loads(line)
                if record.get("started"):
                    started = record["id"]
                else:
                    done[record["id"]] = record
                    started = None
            if started is not None:  # the child died inside this job
                done[started] = {
                    "id": started,
                    "code": "crashed",
                    "returncode": proc.returncode,
                    "stderr": proc.stderr[-4000:],
                    "stdout": "",
                }
            remaining = [job for job in pending if job["id"] not in done]
            if len(remaining) == len(pending):  # the child did not even start: report, do not loop
                for job in remaining:
                    done[job["id"]] = {"id": job["id"], "code": "crashed", "returncode": proc.returncode,
                                       "stderr": proc.stderr[-4000:], "stdout": ""}
                remaining = []
            pending = remaining
    return done
