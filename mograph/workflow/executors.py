"""Where work runs: in this process, or fanned out over a Ray cluster.

An executor has one job: ``executor.map(fn, items)`` returns ``[fn(x) for x in items]``, in order.
:class:`LocalExecutor` does exactly that, in this process.  :class:`RayExecutor` sends each call to a
Ray task (``fn`` is put in the object store once; each item travels with its task) and gathers the
results in order; it starts a local Ray instance, or joins an existing cluster with ``address``
(``"auto"`` or ``"ray://host:10001"``).  Ray is an optional extra (``pip install 'mograph[ray]'``):
without it, asking for the Ray executor raises :class:`~mograph.errors.BackendUnavailableError`
(exit code 7); everything else runs locally.

Two things fan out:

* the configurations of ``mograph sweep`` (their pass pipelines are built in tasks; the measurement
  stays on the driver so every latency is taken on one machine, side by side);
* the per-layer sensitivity analysis of the quantization passes: while an executor is *active*
  (:func:`use_executor`), :func:`current_map` returns its ``map`` (with ``width``: how many calls it
  runs at once) and the analysis evaluates that many candidate mixes per round.  Passes call
  :func:`current_map` only; they never know which executor is behind it.

Why Ray and not a home-made pool: it already schedules over many machines, moves objects between
them, and restarts failed workers; mograph adds no scheduler of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from mograph.errors import BackendUnavailableError, UsageError

__all__ = [
    "Executor",
    "LocalExecutor",
    "RayExecutor",
    "make_executor",
    "use_executor",
    "current_map",
    "MapFunction",
    "EXECUTORS",
]

T = TypeVar("T")
R = TypeVar("R")

#: Names ``--executor`` accepts.
EXECUTORS = ("local", "ray")


class MapFunction:
    """``map_fn(fn, items) -> list`` plus ``width``: how many calls run at once (1: one after another)."""

    def __init__(self, fn: Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]], width: int) -> None:
        self._fn = fn
        self.width = max(1, int(width))

    def __call__(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        return self._fn(fn, list(items))


class Executor:
    """Base: a ``map`` over items, and the number of calls it runs at once."""

    name = "base"

    @property
    def width(self) -> int:
        return 1

    def map(self, fn: Callable[[T], R], items: Sequence[T], progress: Callable[[int, int], None] | None = None) -> list[R]:
        """``[fn(x) for x in items]``, in order; ``progress(done, total)`` after each call finishes."""
        raise NotImplementedError

    def as_map(self) -> MapFunction:
        return MapFunction(self.map, self.width)

    def close(self) -> None:
        """Release what the executor holds (a Ray instance it started)."""

    def release(self) -> None:
        """Stop what would compete with timing runs on this machine (a Ray instance it started here)."""

    def describe(self) -> str:
        return self.name

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalExecutor(Executor):
    """Everything in this process, one call after another."""

    name = "local"

    def map(self, fn: Callable[[T], R], items: Sequence[T], progress: Callable[[int, int], None] | None = None) -> list[R]:
        out = []
        for x in items:
            out.append(fn(x))
            if progress is not None:
                progress(len(out), len(items))
        return out


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise BackendUnavailableError("--executor ray needs Ray, which", "ray") from exc
    return ray


def _call(fn: Callable[[Any], Any], item: Any, env: dict[str, str]) -> Any:
    """What a Ray task runs: ``fn(item)``, with the driver's mograph-relevant environment."""
    os.environ.update(env)
    return fn(item)


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse at once a ``HOST:PORT`` nothing listens on (Ray itself would retry for minutes)."""
    import socket

    if address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise UsageError(f"--address {address}: expected HOST:PORT, auto, or ray://HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise UsageError(f"--address {address}: cannot join the Ray cluster (nothing answers there: {exc})") from exc


class RayExecutor(Executor):
    """Calls fanned out as Ray tasks.

    Args:
        address: an existing cluster (``"auto"``, ``"HOST:6379"``, ``"ray://HOST:10001"``), disconnected
            from on :meth:`close`; ``None`` starts a local instance on this machine and stops it on
            :meth:`close`.
        workers: CPUs of the local instance (``None``: all); each task asks for one CPU, so this is
            how many run at once.  Ignored with ``address`` (the cluster's size decides).
        join: use the Ray instance this process is already connected to (inside a Ray task).
    """

    name = "ray"

    def __init__(self, address: str | None = None, *, workers: int | None = None, join: bool = False) -> None:
        self._ray = ray = _import_ray()
        self._started = False
        self._width: int | None = None
        self.address = address
        if join:
            if not ray.is_initialized():
                raise UsageError("RayExecutor(join=True) outside a Ray task or driver")
        elif ray.is_initialized():
            raise UsageError("this process is already connected to Ray; use RayExecutor(join=True)")
        elif address:
            _check_reachable(address)
            try:
                ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
            except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ...
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise UsageError(f"--address {address}: cannot join the Ray cluster ({first})") from exc
            self._started = True  # connected by us: disconnected by close()
        else:
            if workers is not None and workers < 1:
                raise UsageError("--workers must be at least 1")
            ray.init(
                num_cpus=workers,
                include_dashboard=False,
                logging_level="ERROR",
                log_to_driver=False,
                configure_logging=False,
                _node_ip_address="127.0.0.1",
            )
            self._started = True
        self._remote = ray.remote(num_cpus=1, max_retries=0)(_call)
        self._env = {k: v for k, v in os.environ.items() if k.startswith("MOGRAPH_") or k == "OMP_NUM_THREADS"}

    @property
    def width(self) -> int:
        if self._width is None and self._ray.is_initialized():
            self._width = max(1, int(self._ray.cluster_resources().get("CPU", 1)))
        return self._width or 1

    def map(self, fn: Callable[[T], R], items: Sequence[T], progress: Callable[[int, int], None] | None = None) -> list[R]:
        if not items:
            return []
        ray = self._ray
        fn_ref = ray.put(fn)
        futures = [self._remote.remote(fn_ref, item, self._env) for item in items]
        try:
            pending = list(futures)
            while progress is not None and pending:
                _, pending = ray.wait(pending, num_returns=1)
                progress(len(futures) - len(pending), len(futures))
            return list(ray.get(futures))
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause() if hasattr(exc, "as_instanceof_cause") else exc
            if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayTaskError):
                raise cause from None
            raise

    def describe(self) -> str:
        where = self.address or "local instance"
        return f"ray ({where}, {self.width} CPU(s))"

    def release(self) -> None:
        self.close()

    def close(self) -> None:
        if self._started and self._ray.is_initialized():
            self._ray.shutdown()
            self._started = False


def make_executor(name: str = "local", *, address: str | None = None, workers: int | None = None) -> Executor:
    """The executor ``--executor NAME`` means."""
    if name == "local":
        if address:
            raise UsageError("--address needs --executor ray")
        return LocalExecutor()
    if name == "ray":
        return RayExecutor(address, workers=workers)
    raise UsageError(f"unknown executor {name!r}; choose from {', '.join(EXECUTORS)}")


_ACTIVE: contextvars.ContextVar[MapFunction | None] = contextvars.ContextVar("mograph_executor_map", default=None)


@contextlib.contextmanager
def use_executor(executor: Executor | MapFunction | None) -> Iterator[None]:
    """Make ``executor`` the one :func:`current_map` returns inside the block."""
    fn = executor.as_map() if isinstance(executor, Executor) else executor
    token = _ACTIVE.set(fn)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_map() -> MapFunction:
    """The active executor's map (width > 1 means it runs calls at once), or a serial one."""
    fn = _ACTIVE.get()
    return fn if fn is not None else LocalExecutor().as_map()
