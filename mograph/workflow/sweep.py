"""``mograph sweep``: measure many configurations of one model side by side, into the ledger.

A sweep config is a YAML (or JSON) file.  Its schema, every key optional except ``configurations``::

    version: 1
    eval_data: eval.npz            # fixed evaluation set: folder of .npz, one stacked .npz, or module:function
    eval_samples: 16               # seeded random samples when there is no eval_data (default 16); else a cap (default: all)
    calibration_data: calib.npz    # given to every pass that takes --calibration-data
    task_metric: mymetrics:score   # optional user metric: module:function or file.py:function (imports and runs it)
    seed: 0                        # seed of random evaluation samples and of the timing feed
    shapes: {input_ids: [1, 128]}  # sizes of dynamic input dims (also given to the passes as --shape)
    provider: CPUExecutionProvider # ONNX Runtime execution provider (or a list, in priority order)
    backend: ort                   # registered backend that runs the models
    ort_optimizations: true        # ONNX Runtime graph optimizations on (as deployed)
    threads: 1                     # intra-op threads of every session
    session_config: {ep.cuda.fpa_intb_gemm: "1"}   # ONNX Runtime session config entries (backend ort only)
    warmup: 5                      # untimed rounds
    iterations: 50                 # timed rounds (each round runs every model once, order rotating)
    configurations:
      - name: int8                 # unique; 'baseline' is the unoptimized model and is always measured
        passes: [cleanup, fuse, qdq-int8]   # or "cleanup,fuse,qdq-int8"
        options: {target: ort, accuracy-budget: "cosine>=0.99"}   # pass options, as on the command line
        provider: ...              # and shapes / backend / ort_optimizations / threads / session_config, per
                                   # configuration (a configuration's session_config entries add to the top one's)

Unknown keys, unknown passes or presets and unknown pass options are refused before anything runs,
each with a one-line error naming the file, the configuration and the closest known name.  The file is
read bounded (at most 1 MiB; YAML aliases may not blow it up: :mod:`mograph._yaml`), and errors never
print a whole value.  Each configuration is built into ``<name>.onnx`` (characters other than letters,
digits, ``-``, ``_`` and ``.`` written as ``_``): two names giving one file, case ignored, are refused.
``task_metric`` and a ``module:function`` ``eval_data`` / ``calibration_data`` are imported and run:
a config is code, a ledger is not (rows record such code by name and sha256; ``mograph gate`` never
runs it from a ledger).

Each configuration's pipeline is built with :func:`mograph.api.optimize` (through the executor: in
this process, or as Ray tasks), saved, then every built model and the baseline are measured together
in one run (:func:`mograph.workflow.metrics.measure`: interleaved timed runs, peak memory, size, and
accuracy against the baseline on the evaluation set; for a model whose weights reach 256 MiB, one model
at a time, each session freed before the next is made, so the peak stays one session's, not the sum of
all of them), and one ledger row per model is written, each
in its own transaction.  A configuration that fails to build is a ``failed`` row with the error; the
others go on.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mograph._tempfiles import LOCK_NAME, owned_tempdir
from mograph._yaml import shown
from mograph.errors import MographError, UsageError

__all__ = ["SweepConfig", "Configuration", "load_config", "parse_config", "run_sweep", "BuildResult", "SweepError"]

logger = logging.getLogger(__name__)

TOP_KEYS = (
    "version", "eval_data", "eval_samples", "calibration_data", "task_metric", "seed", "shapes", "provider",
    "backend", "ort_optimizations", "threads", "warmup", "iterations", "configurations", "session_config",
)
CONFIG_KEYS = ("name", "passes", "options", "provider", "backend", "shapes", "ort_optimizations", "threads",
               "session_config")
BASELINE = "baseline"
#: Largest sweep config read (a config is a page of text).
MAX_CONFIG_BYTES = 1 << 20


class SweepError(UsageError):
    """The sweep config is malformed (exit 2)."""


@dataclass
class Configuration:
    name: str
    passes: list[str]
    options: dict[str, Any] = field(default_factory=dict)
    provider: list[str] | None = None
    backend: str = "ort"
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    ort_optimizations: bool = True
    threads: int | None = 1
    session_config: dict[str, str] = field(default_factory=dict)


@dataclass
class SweepConfig:
    configurations: list[Configuration]
    eval_data: str | None = None
    eval_samples: int | None = None
    calibration_data: str | None = None
    task_metric: str | None = None
    seed: int = 0
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    provider: list[str] | None = None
    backend: str = "ort"
    ort_optimizations: bool = True
    threads: int | None = 1
    session_config: dict[str, str] = field(default_factory=dict)
    warmup: int = 5
    iterations: int = 50
    source: str = "<config>"


def _unknown(keys: Iterable[str], known: Sequence[str], where: str) -> None:
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise SweepError(f"{where}: unknown key {shown(key)}{hint}; known: {', '.join(known)}")


def _session_config(value: Any, where: str) -> dict[str, str]:
    """A mapping of ONNX Runtime session config entries (keys and values as text; numbers and booleans as text)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SweepError(f"{where}: expected a mapping of ONNX Runtime session config entries, got {shown(value)}")
    out = {}
    for key, entry in value.items():
        if not isinstance(key, str) or not key or isinstance(entry, (dict, list)) or entry is None:
            raise SweepError(f"{where}: expected KEY: VALUE entries (text, numbers), got {shown(key)}: {shown(entry)}")
        out[key] = str(entry).lower() if isinstance(entry, bool) else str(entry)
    return out


def _int(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SweepError(f"{where}: expected an integer >= {minimum}, got {shown(value)}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise SweepError(f"{where}: expected true or false, got {shown(value)}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise SweepError(f"{where}: expected a non-empty string, got {shown(value)}")
    return value


def _providers(value: Any, where: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise SweepError(f"{where}: expected a provider name or a list of them, got {shown(value)}")


def _shapes(value: Any, where: str) -> dict[str, tuple[int, ...]]:
    from mograph.specs import parse_dims

    if value is None:
        return {}
    if isinstance(value, list):  # ["input_ids:1x128", ...]
        from mograph.specs import parse_shapes

        try:
            return dict(parse_shapes([_str(v, where) for v in value]))
        except MographError as exc:
            raise SweepError(f"{where}: {exc}") from exc
    if not isinstance(value, dict):
        raise SweepError(f"{where}: expected {{input: [dims]}} or a list of NAME:DIMS, got {shown(value)}")
    out = {}
    for name, dims in value.items():
        if isinstance(dims, str):
            try:
                out[str(name)] = tuple(parse_dims(dims, str(name), where, 'shapes'))
            except (MographError, ValueError) as exc:
                raise SweepError(f"{where}.{name}: {exc}") from exc
        elif isinstance(dims, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            out[str(name)] = tuple(dims)
        else:
            raise SweepError(f"{where}.{name}: expected a list of sizes like [1, 128] or '1x128', got {shown(dims)}")
    return out


def parse_config(data: Any, source: str = "<config>") -> SweepConfig:
    """Check a loaded sweep config (a dict) against the schema; raise :class:`SweepError` on the first fault."""
    if not isinstance(data, dict):
        raise SweepError(f"{source}: expected a mapping with a 'configurations' list at the top")
    _unknown(data, TOP_KEYS, source)
    if data.get("version", 1) != 1:
        raise SweepError(f"{source}: version {shown(data.get('version'))} is not supported (only 1)")
    if "configurations" not in data:
        raise SweepError(f"{source}: no 'configurations' list")
    raw_configs = data["configurations"]
    if not isinstance(raw_configs, list) or not raw_configs:
        raise SweepError(f"{source}: 'configurations' must be a non-empty list")
    sweep = SweepConfig(configurations=[], source=source)
    for key in ("eval_data", "calibration_data", "task_metric", "backend"):
        if data.get(key) is not None:
            setattr(sweep, key, _str(data[key], f"{source}: {key}"))
    for key in ("eval_samples", "seed", "warmup"):
        if key in data:
            setattr(sweep, key, _int(data[key], f"{source}: {key}"))
    if "iterations" in data:
        sweep.iterations = _int(data["iterations"], f"{source}: iterations", 1)
    if "threads" in data:
        sweep.threads = None if data["threads"] is None else _int(data["threads"], f"{source}: threads", 1)
    if "ort_optimizations" in data:
        sweep.ort_optimizations = _bool(data["ort_optimizations"], f"{source}: ort_optimizations")
    sweep.provider = _providers(data.get("provider"), f"{source}: provider")
    sweep.session_config = _session_config(data.get("session_config"), f"{source}: session_config")
    sweep.shapes = _shapes(data.get("shapes"), f"{source}: shapes")
    names: set[str] = set()
    files: dict[str, str] = {}  # file name (case folded) -> the configuration that builds into it
    for i, raw in enumerate(raw_configs):
        where = f"{source}: configurations[{i}]"
        if not isinstance(raw, dict):
            raise SweepError(f"{where}: expected a mapping with name and passes")
        _unknown(raw, CONFIG_KEYS, where)
        name = _str(raw.get("name"), f"{where}: name")
        where = f"{source}: configuration {shown(name)}"
        if name == BASELINE:
            raise SweepError(f"{where}: the name 'baseline' is the unoptimized model (always measured); choose another")
        if name in names:
            raise SweepError(f"{where}: the name is used twice")
        names.add(name)
        file_key = _safe_name(name).casefold()
        if file_key in files:
            raise SweepError(
                f"{where}: builds into the same file ({_safe_name(name)}.onnx) as configuration "
                f"{shown(files[file_key])} (in a file name, characters other than letters, digits, '-', '_' and '.' "
                "become '_', and case is ignored); rename one"
            )
        files[file_key] = name
        passes = raw.get("passes")
        if isinstance(passes, str):
            passes = [p.strip() for p in passes.split(",") if p.strip()]
        if not isinstance(passes, list) or not passes or not all(isinstance(p, str) and p for p in passes):
            raise SweepError(f"{where}: passes must be a non-empty list of pass names (or a comma-separated string)")
        options = raw.get("options") or {}
        if not isinstance(options, dict):
            raise SweepError(f"{where}: options must be a mapping of pass options")
        conf = Configuration(
            name=name,
            passes=list(passes),
            options={str(k).replace("-", "_"): v for k, v in options.items()},
            provider=_providers(raw.get("provider"), f"{where}: provider") or sweep.provider,
            backend=_str(raw["backend"], f"{where}: backend") if raw.get("backend") is not None else sweep.backend,
            shapes={**sweep.shapes, **_shapes(raw.get("shapes"), f"{where}: shapes")},
            ort_optimizations=_bool(raw["ort_optimizations"], f"{where}: ort_optimizations")
            if "ort_optimizations" in raw else sweep.ort_optimizations,
            threads=(None if raw["threads"] is None else _int(raw["threads"], f"{where}: threads", 1))
            if "threads" in raw else sweep.threads,
            session_config={**sweep.session_config,
                            **_session_config(raw.get("session_config"), f"{where}: session_config")},
        )
        if conf.session_config and conf.backend != "ort":
            raise SweepError(f"{where}: session_config sets ONNX Runtime sessions; backend {shown(conf.backend)} "
                             "has none")
        sweep.configurations.append(conf)
    if sweep.session_config and sweep.backend != "ort":
        raise SweepError(f"{source}: session_config sets ONNX Runtime sessions; backend {shown(sweep.backend)} has none")
    return sweep


def load_config(path: str | os.PathLike[str]) -> SweepConfig:
    """Read and check a sweep config file (YAML, or JSON which is YAML too)."""
    from mograph._yaml import load_yaml_file

    path = Path(path)
    if not path.is_file():
        raise SweepError(f"--config {path}: no such file")
    data = load_yaml_file(path, "--config", SweepError, max_bytes=MAX_CONFIG_BYTES)  # bounded before use
    sweep = parse_config(data, str(path))
    # Data paths in a config are relative to the config's folder (so a config and its data travel together).
    for key in ("eval_data", "calibration_data", "task_metric"):
        value = getattr(sweep, key)
        if value:
            setattr(sweep, key, _relative_to(value, path.parent))
    return sweep


def _relative_to(spec: str, folder: Path) -> str:
    if Path(spec).is_absolute():
        return spec
    if (folder / spec).exists():
        return str((folder / spec).resolve())
    head, sep, func = spec.rpartition(":")
    if sep and head.endswith(".py") and not Path(head).is_absolute() and (folder / head).is_file():
        return f"{(folder / head).resolve()}:{func}"
    return spec


def check_against_registry(sweep: SweepConfig, blocked: Iterable[str] = ()) -> dict[str, list[str]]:
    """Every configuration's expanded pipeline (``lower`` included), checking passes and options first."""
    from mograph.plugins import get_registry

    reg = get_registry(blocked)
    declared = reg.all_options()
    out = {}
    for conf in sweep.configurations:
        where = f"{sweep.source}: configuration {conf.name!r}"
        for key in conf.options:
            if key not in declared:
                close = difflib.get_close_matches(key, list(declared), n=1)
                hint = f" (did you mean {close[0].replace('_', '-')}?)" if close else ""
                raise SweepError(f"{where}: unknown pass option {key.replace('_', '-')!r}{hint}; `mograph passes` lists them")
        try:
            out[conf.name] = reg.plan(conf.passes, conf.options)
        except MographError as exc:
            raise SweepError(f"{where}: {exc}") from exc
        for key in conf.options:
            if not _takes(reg, out[conf.name], key):
                owners = ", ".join(declared[key][1])
                raise SweepError(
                    f"{where}: option {key.replace('_', '-')!r} is taken by {owners}, none of which is in its pipeline"
                )
    return out


# ------------------------------------------------------------------------------------------ building
@dataclass
class BuildJob:
    """What one build task needs (plain data: it travels to a Ray worker)."""

    name: str
    source: str
    passes: list[str]
    options: dict[str, Any]
    blocked: list[str]
    cwd: str
    out_dir: str | None  # write here (local); None: return the files' bytes (remote worker)


@dataclass
class BuildResult:
    name: str
    ok: bool
    pipeline: list[str] = field(default_factory=list)
    error: str | None = None
    path: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    report: list[dict[str, Any]] = field(default_factory=list)
    plan: dict[str, Any] | None = None
    seconds: float = 0.0
    host: str = ""


def _short_report(report: Any) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    rows, plan = [], None
    for p in report.passes:
        d = p.to_dict()
        details = d.pop("details", None) or {}
        if isinstance(details, dict) and isinstance(details.get("plan"), dict):
            plan = details["plan"]
        if isinstance(details, dict) and details.get("WARNING"):
            d["warning"] = details["WARNING"]
        rows.append(d)
    return rows, plan


def build_configuration(job: BuildJob, nested: bool = False) -> BuildResult:
    """Run one configuration's pipeline and save the model (in a Ray task when fanned out).

    ``nested``: inside a Ray task, make that Ray instance the active executor, so the passes' own
    fan-out (the sensitivity analysis) goes to the cluster too."""
    import socket

    from mograph import api, ir_io
    from mograph.workflow.executors import RayExecutor, use_executor

    start = time.perf_counter()
    result = BuildResult(name=job.name, ok=False, host=socket.gethostname())
    old_cwd = os.getcwd()
    try:
        os.chdir(job.cwd)
        import contextlib

        ctx = use_executor(RayExecutor(join=True)) if nested else contextlib.nullcontext()
        with ctx:
            model, report = api.optimize(job.source, job.passes, options=job.options, blocked=job.blocked)
        result.pipeline = [p.name for p in report.passes]
        result.report, result.plan = _short_report(report)
        if job.out_dir is not None:
            dest = Path(job.out_dir) / f"{job.name}.onnx"
            ir_io.save_model(model, dest, forbid=job.source)
            result.path = str(dest)
        else:
            with owned_tempdir("mograph-build-") as tmp:
                dest = tmp.path / f"{job.name}.onnx"
                ir_io.save_model(model, dest)
                result.files = {p.name: p.read_bytes() for p in tmp.path.iterdir() if p.is_file() and p.name != LOCK_NAME}
        result.ok = True
    except MographError as exc:
        result.error = str(exc)
    except SystemExit as exc:  # a plugin ending the process outside a pass (a pass's is a PluginError already)
        result.error = f"a plugin called sys.exit({exc.code!r}) while this configuration was built"
    except Exception as exc:  # noqa: BLE001 - a bug in one configuration must not lose the others' rows
        logger.debug("configuration %s crashed", job.name, exc_info=True)
        result.error = f"internal error: {type(exc).__name__}: {exc}"
    finally:
        os.chdir(old_cwd)
    result.seconds = time.perf_counter() - start
    return result


# ------------------------------------------------------------------------------------------ the sweep
def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def io_paths(
    src: Path, sweep: SweepConfig, *, config: str | None = None, eval_data: str | None = None,
    calibration_data: str | None = None, keep_models: str | os.PathLike[str] | None = None,
    blocked: Iterable[str] = (),
) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """``(writes, reads)`` of a sweep, for :func:`mograph._paths.check_io`: the built models kept in
    ``keep_models`` and the configurations' output files (``precision-plan-out``), against the model, its
    external data, the config and every data or code file it names."""
    from mograph._paths import model_files, option_io, spec_files
    from mograph.plugins import get_registry

    declared = get_registry(blocked).all_options()
    writes: list[tuple[str, Any]] = []
    reads: list[tuple[str, Any]] = [("the input model", src)]
    reads += [("the input model's external data", f) for f in model_files(src)[1:]]
    reads += [("--config", config)] if config else []
    for flag, spec in (("eval_data", eval_data or sweep.eval_data), ("calibration_data", calibration_data or sweep.calibration_data),
                       ("task_metric", sweep.task_metric)):
        reads += [(flag, f) for f in spec_files(spec)]
    for conf in sweep.configurations:
        if keep_models is not None:
            writes.append((f"--keep-models (configuration {shown(conf.name)})", Path(keep_models) / f"{_safe_name(conf.name)}.onnx"))
        w, r = option_io(declared, conf.options)
        writes += [(f"{flag} (configuration {shown(conf.name)})", path) for flag, path in w]
        reads += r
    return writes, reads


def _takes(reg: Any, names: list[str], key: str) -> bool:
    return any(any(o.key == key for o in reg.passes[n].options) for n in names if n in reg.passes)


def run_sweep(
    model_path: str | os.PathLike[str],
    sweep: SweepConfig,
    ledger: Any,
    *,
    executor: Any = None,
    eval_data: str | None = None,
    calibration_data: str | None = None,
    keep_models: str | os.PathLike[str] | None = None,
    blocked: Iterable[str] = (),
    progress: Callable[[str, int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Run a sweep; return the ledger rows written (with their ``id``), baseline first.

    ``eval_data`` / ``calibration_data`` override the config's.  ``keep_models``: a folder to keep the
    built models in (their rows' ``model_path`` points there); by default they are built in a
    temporary folder removed afterwards (``model_path`` is then ``None``).
    """
    from mograph import _spill, ir_io
    from mograph._paths import write_bytes
    from mograph.plugins import get_registry
    from mograph.validate import make_feeds
    from mograph.workflow import metrics as M
    from mograph.workflow.executors import LocalExecutor, RayExecutor
    from mograph.workflow.ledger import now_iso

    blocked = list(blocked)
    executor = executor or LocalExecutor()
    src = Path(model_path).resolve()
    if not src.is_file():
        raise UsageError(f"model {model_path}: no such file")
    pipelines = check_against_registry(sweep, blocked)
    reg = get_registry(blocked)
    eval_spec = eval_data or sweep.eval_data
    calib_spec = calibration_data or sweep.calibration_data
    if keep_models is not None:
        keep = Path(keep_models)
        if not keep.is_dir():
            raise UsageError(f"--keep-models {keep}: folder does not exist; create it first")
    task = M.load_function(sweep.task_metric, "task_metric") if sweep.task_metric else None

    model = ir_io.load_model(src)
    if eval_spec:
        samples = M.load_samples(_abs(eval_spec), model, what="eval_data", limit=sweep.eval_samples or 0)
        eval_desc = _abs(eval_spec)
    else:
        n = sweep.eval_samples or 16
        samples = M.random_samples(model, n, seed=sweep.seed, shapes=sweep.shapes)
        eval_desc = f"random:{n}:seed={sweep.seed}"
    eval_hash = M.hash_samples(samples)
    calib_hash = None
    if calib_spec:
        calib_hash = M.hash_samples(M.load_samples(_abs(calib_spec), model, what="calibration_data"))
    model_hash = M.hash_file(src)
    timing = {c.name: make_feeds(model, shapes=c.shapes, seed=sweep.seed)[0] for c in sweep.configurations}
    base_feed = make_feeds(model, shapes=sweep.shapes, seed=sweep.seed)[0]
    # Sessions of a large model side by side cost several times its weights (the baseline's, a float16
    # model's float32 copy on a CPU provider, ...): from the size mograph saves as external data, each
    # model is measured alone, its session freed before the next one is made.
    one_at_a_time = ir_io.model_size_bytes(model) >= _spill.save_external_bytes()
    del model
    vers = M.versions()
    settings_common = {
        "eval_data": eval_desc, "eval_samples": len(samples), "calibration_data": _abs(calib_spec) if calib_spec else None,
        "task_metric": sweep.task_metric, "seed": sweep.seed,
        # Code is recorded by name and hash only: `mograph gate` never runs code a ledger names (the user
        # names it on the gate's command line, and its hash must match).
        "task_metric_hash": M.code_hash(sweep.task_metric) if sweep.task_metric else None,
        "eval_data_hash": M.code_hash(eval_desc) if M.names_code(eval_desc) else None, "warmup": sweep.warmup, "iterations": sweep.iterations,
        "config": sweep.source, "executor": executor.describe(),
    }

    # A locked folder: the folders of sweeps that were killed (SIGKILL leaves them) are swept first.
    tmp = owned_tempdir("mograph-sweep-") if keep_models is None else None
    out_dir = Path(tmp.name) if tmp is not None else Path(keep_models)  # type: ignore[arg-type]
    try:
        remote = isinstance(executor, RayExecutor)
        jobs = []
        for c in sweep.configurations:
            options = dict(c.options)
            if calib_spec and (calibration_data or "calibration_data" not in options):
                options["calibration_data"] = _abs(calib_spec)
            if c.shapes and "shape" not in options:
                options["shape"] = [f"{k}:{'x'.join(map(str, v))}" for k, v in c.shapes.items()]
            options = {k: v for k, v in options.items() if k in c.options or _takes(reg, pipelines[c.name], k)}
            jobs.append(BuildJob(
                name=_safe_name(c.name), source=str(src), passes=pipelines[c.name], options=options, blocked=blocked,
                cwd=os.getcwd(), out_dir=None if remote else str(out_dir),
            ))
        if progress is not None:
            progress(f"building {len(jobs)} configuration(s) on {executor.describe()}", 0, len(jobs))
        built: list[BuildResult]
        if remote:
            def done(n: int, total: int) -> None:
                if progress is not None:
                    progress("built", n, total)

            built = executor.map(functools.partial(build_configuration, nested=True), jobs, progress=done)
        else:
            built = []
            for i, job in enumerate(jobs):
                built.append(build_configuration(job))
                # the configuration's model is saved: an IR graph is a web of cycles, freed by the collector,
                # so it is collected now, not left beside the next configuration's build or the sessions
                _spill.free_dropped()
                if progress is not None:
                    progress(f"built {job.name}", i + 1, len(jobs))
        executor.release()  # a Ray instance started for the builds must not share the CPUs with the timing
        for b in built:
            if b.ok and b.files:
                for fname, data in b.files.items():
                    write_bytes(out_dir / fname, data, "--keep-models")  # atomic, never through a link
                b.path = str(out_dir / f"{b.name}.onnx")
                b.files = {}

        rows: list[dict[str, Any]] = []
        targets = [M.Target(BASELINE, src, sweep.provider, sweep.ort_optimizations, sweep.threads, sweep.backend,
                            sweep.session_config)]
        feeds = {BASELINE: base_feed}
        for conf, b in zip(sweep.configurations, built):
            if b.ok and b.path:
                targets.append(M.Target(conf.name, Path(b.path), conf.provider, conf.ort_optimizations, conf.threads,
                                        conf.backend, conf.session_config))
                feeds[conf.name] = timing[conf.name]
        measured = M.measure(
            targets, base_feed, samples, warmup=sweep.warmup, iterations=sweep.iterations, blocked=blocked,
            progress=progress, timing_feeds=feeds, one_at_a_time=one_at_a_time,
        )
        reference = measured[BASELINE].outputs
        if measured[BASELINE].error:
            raise UsageError(f"the unoptimized model cannot be measured: {measured[BASELINE].error}")

        def finish(row: dict[str, Any], m: Any) -> None:
            if m.error:
                row.update(status="failed", error=m.error)
            else:
                metrics = dict(m.metrics)
                metrics.update(M.accuracy(reference, m.outputs))
                if task is not None:
                    metrics.update(M.call_task_metric(task, m.outputs, samples, reference))
                row["metrics"] = metrics
                row["provider"] = m.providers[0] if m.providers else None
            row.setdefault("status", "ok")
            row.setdefault("time", now_iso())
            row["id"] = ledger.add(row)
            rows.append(row)

        base_row: dict[str, Any] = {
            "name": BASELINE, "model_path": str(src), "model_hash": model_hash, "pipeline": [], "options": {},
            "provider": None, "backend": sweep.backend, "shapes": {k: list(v) for k, v in sweep.shapes.items()},
            "calib_hash": None, "eval_hash": eval_hash, "versions": vers, "baseline": True,
            "settings": {**settings_common, "output_hash": model_hash, "threads": sweep.threads,
                         "ort_optimizations": sweep.ort_optimizations, "providers": sweep.provider,
                         "session_config": sweep.session_config},
        }
        finish(base_row, measured[BASELINE])
        for job, conf, b in zip(jobs, sweep.configurations, built):
            row = {
                "name": conf.name, "model_path": b.path if keep_models is not None else None, "model_hash": model_hash,
                "pipeline": b.pipeline or pipelines[conf.name], "options": _jsonable(job.options),
                "provider": conf.provider[0] if conf.provider else None, "backend": conf.backend,
                "shapes": {k: list(v) for k, v in conf.shapes.items()},
                "calib_hash": calib_hash if "calibration_data" in job.options else None,
                "eval_hash": eval_hash, "versions": vers, "report": b.report or None, "plan": b.plan,
                "baseline": False,
                "settings": {**settings_common, "passes": conf.passes, "threads": conf.threads,
                             "ort_optimizations": conf.ort_optimizations,
                             "providers": conf.provider, "session_config": conf.session_config,
                             "build_seconds": round(b.seconds, 3), "build_host": b.host},
            }
            if not b.ok:
                row.update(status="failed", error=b.error, metrics={}, time=now_iso())
                row["id"] = ledger.add(row)
                rows.append(row)
                continue
            row["settings"]["output_hash"] = M.hash_file(b.path)  # type: ignore[arg-type]
            finish(row, measured[conf.name])
        return rows
    finally:
        if tmp is not None:
            tmp.cleanup()


def _abs(spec: str) -> str:
    """A data spec with a path made absolute (so a Ray worker or a later gate finds it); module:function as is."""
    p = Path(spec)
    if p.exists():
        return str(p.resolve())
    head = spec.rpartition(":")[0]
    if head.endswith(".py") and Path(head).exists():
        return f"{Path(head).resolve()}:{spec.rpartition(':')[2]}"
    return spec


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
