"""Executors without Ray: the local map, the active-executor hook, and the sensitivity search's wide rounds."""

from __future__ import annotations

import pytest

from mograph.errors import UsageError
from mograph.workflow.executors import LocalExecutor, MapFunction, current_map, make_executor, use_executor


def test_local_and_hook():
    ex = make_executor("local")
    assert isinstance(ex, LocalExecutor) and ex.width == 1
    assert ex.map(lambda x: x + 1, [1, 2, 3]) == [2, 3, 4]
    assert current_map().width == 1
    wide = MapFunction(lambda fn, items: [fn(x) for x in items], 4)
    with use_executor(wide):
        assert current_map() is wide
    assert current_map() is not wide
    with pytest.raises(UsageError, match="unknown executor 'dask'"):
        make_executor("dask")
    with pytest.raises(UsageError, match="--address needs --executor ray"):
        make_executor("local", address="auto")


@pytest.mark.parametrize("width", [2, 3])
def test_sensitivity_wide_rounds_choose_the_same_layers(monkeypatch, width):
    """qdq-int8 --accuracy-budget with a map that claims ``width`` calls at once: the same layers are kept and
    the same figure measured as with the serial binary search, in fewer rounds."""
    from mograph import api
    from mograph.cli._common import example_path

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    src = example_path("bert-tiny")
    options = {"calibration_data": str(src.with_suffix(".npz")), "accuracy_budget": "max-abs<=0.001"}

    def run(calls_at_once):
        calls = []

        def counting(fn, items):
            calls.append(len(items))
            return [fn(x) for x in items]

        with use_executor(MapFunction(counting, calls_at_once)):
            _, report = api.optimize(src, ["qdq-int8"], options=options)
        p = next(p for p in report.passes if p.name == "qdq-int8")
        plan = p.details["plan"]
        evaluations = plan["accuracy_budget"].pop("evaluations")
        plan["accuracy_budget"].pop("metric_by_kept_float")  # the points a wider search measured differ
        stats = dict(p.stats)
        stats.pop("sensitivity_evaluations")
        return stats, plan, calls, evaluations

    stats1, plan1, calls1, evals1 = run(1)
    stats_w, plan_w, calls_w, evals_w = run(width)
    assert set(calls1) == {1} and len(calls1) == evals1  # width 1: the binary search, one evaluation a round
    assert 0 < stats1["kept_float"] and stats1["quantized"] > 0  # a search that had to look
    assert stats_w == stats1 and plan_w == plan1
    assert max(calls_w) == width and len(calls_w) < len(calls1)
