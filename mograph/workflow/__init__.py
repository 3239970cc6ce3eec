"""The optimization workflow around the pipeline: measure, sweep, record, compare, gate, report.

* :mod:`mograph.workflow.report` — the self-contained HTML report and the Pareto plot drawn from ledger rows.
"""
