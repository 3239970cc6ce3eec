"""The statistics quantization keeps of a tensor over the calibration samples, and the calibrators that turn them
into a range (:mod:`mograph.passes.quant.calibration` describes both; it re-exports this module's names).

:class:`TensorStats` streams: min, max, largest magnitude, largest reduced extent and a signed histogram over
``[-R, R]`` that doubles its range (merging neighbouring bins) when a sample exceeds it.  The calibrators
(:data:`CALIBRATORS`): ``minmax``, ``percentile``, ``entropy`` (the KL-divergence threshold, TensorRT's INT8
method).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CALIBRATORS", "TensorStats", "compute_ranges", "needs_histogram", "scaled_stats"]

_HIST_BINS = 2048  # signed histogram over [-R, R]; must be divisible by 4


@dataclass
class TensorStats:
    """Streaming statistics of one tensor over all calibration samples."""

    min: float = math.inf
    max: float = -math.inf
    samples: int = 0
    max_size: int = 0  # largest number of elements seen
    max_reduced: int = 0  # largest number of elements along the last axis seen (for reductions)
    hist: np.ndarray | None = None
    hist_range: float = 0.0  # histogram covers [-hist_range, hist_range]
    nonfinite: int = 0
    #: per-channel (last axis) minimum and maximum, when observed with ``channels=True`` (for smoothing)
    ch_min: np.ndarray | None = None
    ch_max: np.ndarray | None = None

    @property
    def amax(self) -> float:
        return max(abs(self.min), abs(self.max)) if self.samples else 0.0

    def update(self, x: np.ndarray, histogram: bool, channels: bool = False) -> None:
        x = np.asarray(x)
        if x.size == 0:
            return
        finite = np.isfinite(x)
        if not finite.all():
            self.nonfinite += int((~finite).sum())
            x = np.where(finite, x, 0.0) if channels and x.ndim else x[finite]
            if x.size == 0:
                return
        if channels and x.ndim:
            self._channel_update(x)
        lo, hi = float(x.min()), float(x.max())
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        self.samples += 1
        self.max_reduced = max(self.max_reduced, int(x.shape[-1]) if x.ndim else 1)
        self.max_size = max(self.max_size, int(x.size))
        if histogram:
            self._hist_update(x.ravel().astype(np.float32, copy=False), max(abs(lo), abs(hi)))

    def _channel_update(self, x: np.ndarray) -> None:
        rows = x.reshape(-1, x.shape[-1])
        lo, hi = rows.min(axis=0).astype(np.float64), rows.max(axis=0).astype(np.float64)
        if self.ch_min is None or self.ch_max is None or self.ch_min.shape != lo.shape:
            self.ch_min, self.ch_max = lo, hi
        else:
            self.ch_min, self.ch_max = np.minimum(self.ch_min, lo), np.maximum(self.ch_max, hi)

    @property
    def channel_amax(self) -> np.ndarray | None:
        """Largest magnitude per channel (last axis), when observed with ``channels=True``."""
        if self.ch_min is None or self.ch_max is None:
            return None
        return np.maximum(np.abs(self.ch_min), np.abs(self.ch_max))

    def _hist_update(self, x: np.ndarray, m: float) -> None:
        if self.hist is None:
            self.hist = np.zeros(_HIST_BINS, dtype=np.int64)
            self.hist_range = m if m > 0 else 1e-8
        while m > self.hist_range:  # double the range: merge bin pairs, pad a quarter on each side
            merged = self.hist.reshape(-1, 2).sum(axis=1)
            pad = _HIST_BINS // 4
            self.hist = np.concatenate([np.zeros(pad, np.int64), merged, np.zeros(pad, np.int64)])
            self.hist_range *= 2.0
        r = self.hist_range
        idx = ((x + r) * (_HIST_BINS / (2.0 * r))).astype(np.int64)
        np.clip(idx, 0, _HIST_BINS - 1, out=idx)
        self.hist += np.bincount(idx, minlength=_HIST_BINS)


# ------------------------------------------------------------------------------------------- calibrators


def _minmax(s: TensorStats, **_: Any) -> tuple[float, float]:
    return s.min, s.max


def scaled_stats(s: TensorStats, scale: np.ndarray) -> TensorStats:
    """The min/max statistics of ``X / scale`` (``scale`` per channel, positive) from those of ``X``
    observed with ``channels=True``; no histogram (re-observe for the histogram calibrators)."""
    if s.ch_min is None or s.ch_max is None:
        raise ValueError("scaled_stats needs per-channel statistics (observe with channels=...)")
    lo, hi = s.ch_min / scale, s.ch_max / scale
    return TensorStats(min=float(lo.min()), max=float(hi.max()), samples=s.samples, max_size=s.max_size,
                       max_reduced=s.max_reduced, nonfinite=s.nonfinite, ch_min=lo, ch_max=hi)


def _hist_edges(s: TensorStats) -> np.ndarray:
    return np.linspace(-s.hist_range, s.hist_range, _HIST_BINS + 1)


def _percentile(s: TensorStats, percentile: float = 99.99, **_: Any) -> tuple[float, float]:
    if s.hist is None or s.hist.sum() == 0:
        return s.min, s.max
    cdf = np.cumsum(s.hist) / s.hist.sum()
    tail = (100.0 - percentile) / 100.0
    edges = _hist_edges(s)
    lo = float(edges[int(np.searchsorted(cdf, tail, side="left"))])
    hi = float(edges[min(int(np.searchsorted(cdf, 1.0 - tail, side="left")) + 1, _HIST_BINS)])
    return max(lo, s.min), min(hi, s.max)


def _entropy(s: TensorStats, levels: int = 128, **_: Any) -> tuple[float, float]:
    if s.hist is None or s.hist.sum() == 0:
        return s.min, s.max
    half = _HIST_BINS // 2
    absh = (s.hist[half:] + s.hist[:half][::-1]).astype(np.float64)  # |x| histogram, half bins over [0, R]
    width = s.hist_range / half
    last = int(np.nonzero(absh)[0][-1]) + 1 if absh.any() else half
    if last <= levels:
        return s.min, s.max
    best_i, best_kl = last, math.inf
    for i in range(levels, last + 1, max(1, (last - levels) // 256)):
        ref = absh[:i].copy()
        ref[i - 1] += absh[i:].sum()
        # np.array_split(absh[:i], levels) in one go (a list of 128 small arrays per candidate was most of
        # the time): the first i % levels chunks one longer; each nonzero bin gets its chunk's mean over its
        # nonzero bins.  Counts are integers, so the sums are exact in any order.
        size, longer = divmod(i, levels)
        sizes = np.full(levels, size)
        sizes[:longer] += 1
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        seg = absh[:i]
        nonzero = seg > 0
        means = np.add.reduceat(seg, starts) / np.maximum(np.add.reduceat(nonzero.astype(np.int64), starts), 1)
        q = np.where(nonzero, np.repeat(means, sizes), 0.0)
        p_sum, q_sum = ref.sum(), q.sum()
        if q_sum == 0:
            continue
        p = ref / p_sum
        qq = q / q_sum
        mask = p > 0
        kl = float(np.sum(p[mask] * np.log(p[mask] / np.maximum(qq[mask], 1e-12))))
        if kl < best_kl:
            best_kl, best_i = kl, i
    t = (best_i + 0.5) * width
    return max(s.min, -t), min(s.max, t)


CALIBRATORS: dict[str, Callable[..., tuple[float, float]]] = {
    "minmax": _minmax,
    "percentile": _percentile,
    "entropy": _entropy,
}


def compute_ranges(stats: Mapping[str, TensorStats], calibrator: str, **kwargs: Any) -> dict[str, tuple[float, float]]:
    """Apply a calibrator to every tensor's statistics."""
    fn = CALIBRATORS[calibrator]
    out = {}
    for name, s in stats.items():
        if s.samples == 0:
            continue
        out[name] = fn(s, **kwargs)
    return out


def needs_histogram(calibrator: str) -> bool:
    return calibrator != "minmax"
