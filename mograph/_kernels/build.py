"""Build mograph's CUDA kernels into ``mograph/_kernels/build/libmograph_kernels.so`` with nvcc.

Run it as ``python -m mograph._kernels.build`` (``--help`` for the options) or call :func:`build`.
Every ``src/*.cu`` file is compiled to an object in parallel (one translation unit per dtype keeps the
template-heavy compiles short), then they are linked into one shared library whose only exported symbols
are the C functions of ``include/mograph_kernels.h`` (``-fvisibility=hidden`` plus ``MOGRAPH_API``).

The default targets are machine code for sm_80 (A100) and sm_90 (H100/H200) plus compute_90 PTX, which
the driver can compile for newer chips. The CUDA runtime is linked statically (nvcc's default), so the
library needs nothing at run time but the driver; that is what lets a TensorRT plugin or a ctypes caller
load it next to a framework that brings its own runtime.

A build is skipped when the library is newer than every source and was made with the same command
(recorded in ``build/build.stamp``); ``--force`` rebuilds anyway. This module needs only the standard
library, so it can be used on machines without a GPU (and without numpy).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = [
    "DEFAULT_ARCHS",
    "DEFAULT_PTX",
    "KERNELS_DIR",
    "LIBRARY_ENV",
    "LIBRARY_NAME",
    "BuildError",
    "build",
    "default_library_path",
    "find_nvcc",
    "library_path",
    "main",
]

KERNELS_DIR = Path(__file__).resolve().parent
SOURCE_DIR = KERNELS_DIR / "src"
INCLUDE_DIR = KERNELS_DIR / "include"
LIBRARY_NAME = "libmograph_kernels.so"
LIBRARY_ENV = "MOGRAPH_KERNELS_LIB"
"""Environment variable naming the library to load instead of :func:`default_library_path`."""
DEFAULT_ARCHS: tuple[str, ...] = ("80", "90")
DEFAULT_PTX: tuple[str, ...] = ("90",)

_COMMON_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden")


class BuildError(RuntimeError):
    """nvcc is missing or one of its commands failed; the message holds the command and its output."""


def default_library_path(build_dir: Path | None = None) -> Path:
    """Where :func:`build` puts the library: ``<build_dir or mograph/_kernels/build>/libmograph_kernels.so``."""
    return (build_dir or KERNELS_DIR / "build") / LIBRARY_NAME


def library_path() -> Path:
    """The library a caller should load: ``$MOGRAPH_KERNELS_LIB`` when set, else :func:`default_library_path`."""
    env = os.environ.get(LIBRARY_ENV)
    return Path(env) if env else default_library_path()


def find_nvcc(nvcc: str | None = None) -> str | None:
    """The nvcc to use: the given path, else ``$NVCC``, else ``nvcc`` on PATH, else ``$CUDA_HOME/bin/nvcc``."""
    if nvcc:
        return nvcc
    if os.environ.get("NVCC"):
        return os.environ["NVCC"]
    found = shutil.which("nvcc")
    if found:
        return found
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def _gencode_flags(archs: Sequence[str], ptx: Sequence[str]) -> list[str]:
    """``-gencode`` flags: machine code for each of ``archs`` and PTX for each of ``ptx`` ("90" or "sm_90")."""
    flags = []
    for arch in archs:
        a = str(arch).removeprefix("sm_").removeprefix("compute_")
        flags.append(f"-gencode=arch=compute_{a},code=sm_{a}")
    for arch in ptx:
        a = str(arch).removeprefix("sm_").removeprefix("compute_")
        flags.append(f"-gencode=arch=compute_{a},code=compute_{a}")
    if not flags:
        raise BuildError("no target: give at least one machine-code arch or one PTX arch")
    return flags


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"command failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return proc.stdout + proc.stderr


def build(
    archs: Sequence[str] = DEFAULT_ARCHS,
    ptx: Sequence[str] = DEFAULT_PTX,
    build_dir: Path | None = None,
    nvcc: str | None = None,
    jobs: int | None = None,
    resource_usage: bool = False,
    extra_flags: Sequence[str] = (),
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Compile and link the kernels; returns the path of the shared library.

    Args:
        archs: compute capabilities to emit machine code for ("80", "90", ...).
        ptx: compute capabilities to embed PTX for (forward compatibility with later chips).
        build_dir: output folder (default ``mograph/_kernels/build``).
        nvcc: nvcc executable (default: see :func:`find_nvcc`).
        jobs: parallel nvcc processes (default: number of sources, at most the CPU count).
        resource_usage: ask ptxas for each kernel's registers, shared memory and spills (printed to ``log``).
        extra_flags: more nvcc flags, appended to every compile.
        force: rebuild even if the library looks up to date.
        log: callable taking one string for progress and compiler output (default: discard).

    Raises:
        BuildError: nvcc not found, or a compile or link command failed.
    """
    say = log or (lambda _msg: None)
    nvcc_path = find_nvcc(nvcc)
    if nvcc_path is None:
        raise BuildError("nvcc not found: put it on PATH, or set NVCC or CUDA_HOME")
    out_dir = Path(build_dir) if build_dir else KERNELS_DIR / "build"
    obj_dir = out_dir / "obj"
    obj_dir.mkdir(parents=True, exist_ok=True)
    library = default_library_path(out_dir)

    sources = sorted(SOURCE_DIR.glob("*.cu"))
    inputs = sources + sorted(SOURCE_DIR.glob("*.cuh")) + sorted(INCLUDE_DIR.glob("*.h"))
    gencode = _gencode_flags(archs, ptx)
    flags = [*_COMMON_FLAGS, f"-I{INCLUDE_DIR}", *gencode, *extra_flags]
    if resource_usage:
        flags.append("--resource-usage")
    stamp_text = shlex.join([nvcc_path, *flags])
    stamp = out_dir / "build.stamp"
    if (
        not force
        and library.is_file()
        and stamp.is_file()
        and stamp.read_text() == stamp_text
        and library.stat().st_mtime >= max(p.stat().st_mtime for p in inputs)
    ):
        say(f"up to date: {library}")
        return library

    def compile_one(src: Path) -> tuple[Path, str]:
        obj = obj_dir / (src.stem + ".o")
        return obj, _run([nvcc_path, *flags, "-c", str(src), "-o", str(obj)])

    workers = jobs or max(1, min(len(sources), os.cpu_count() or 1))
    say(f"compiling {len(sources)} sources with {workers} jobs: {' '.join(gencode)}")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(compile_one, sources))
    for obj, output in results:
        if output.strip():
            say(f"--- {obj.name}\n{output.rstrip()}")
    tmp = library.with_suffix(".so.tmp")
    _run([nvcc_path, "-shared", *gencode, "-o", str(tmp), *[str(obj) for obj, _ in results]])
    tmp.replace(library)  # atomic: a concurrent loader never sees a half-written library
    stamp.write_text(stamp_text)
    say(f"built {library}")
    return library


def _split_archs(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(description="Build libmograph_kernels.so with nvcc.")
    parser.add_argument(
        "--arch",
        default=",".join(DEFAULT_ARCHS),
        help="comma-separated compute capabilities to emit machine code for (default: %(default)s)",
    )
    parser.add_argument(
        "--ptx",
        default=",".join(DEFAULT_PTX),
        help="comma-separated compute capabilities to embed PTX for; empty for none (default: %(default)s)",
    )
    parser.add_argument("--build-dir", type=Path, default=None, help="output folder (default: mograph/_kernels/build)")
    parser.add_argument("--nvcc", default=None, help="nvcc executable (default: $NVCC, PATH, $CUDA_HOME/bin)")
    parser.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes")
    parser.add_argument(
        "--resource-usage", action="store_true", help="print each kernel's registers, shared memory and spills"
    )
    parser.add_argument(
        "--define",
        "-D",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="preprocessor definition for every source, e.g. -D MOGRAPH_NO_PDL (repeatable)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    try:
        path = build(
            archs=_split_archs(args.arch),
            ptx=_split_archs(args.ptx),
            build_dir=args.build_dir,
            nvcc=args.nvcc,
            jobs=args.jobs,
            resource_usage=args.resource_usage,
            extra_flags=[f"-D{d}" for d in args.define],
            force=args.force,
            log=print,
        )
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
