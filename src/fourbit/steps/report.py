"""workflow/rules/report.smk: rule report (write_report). `results/report.md`,
`results/report.tsv` (one row per arm and engine) and the three plots; when the study
served its arms (the serve step's serve.json), a Serving section and its two plots; when
it scored them on a task set (the tasks step's tasks.json), a Task accuracy section and
its plot.

Every number comes from a result file of this run; a missing or unreadable file
stops the report and names the file, instead of leaving a hole in the table. The
work is in fourbit.report: records (reading and checking), rows, markdown, plots,
the frontier.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from fourbit.atomic import write_text
from fourbit.checkpoints.quantized import storage_stats
from fourbit.report.markdown import render_markdown
from fourbit.report.plots import plot, plot_serving, plot_tasks
from fourbit.report.loading import (
    RecordPaths,
    bench_records,
    check_records,
    check_same_weights,
    read_arm,
    read_records,
    read_result,
    run_facts,
)
from fourbit.report.rows import build_rows, render_tsv
from fourbit.report.serving import read_serving
from fourbit.report.tasks import read_tasks

log = logging.getLogger("fourbit")


def write_report(
    study: dict,
    *,
    report_settings: Mapping,
    records: RecordPaths,
    arm_manifests: list[str],
    markdown_path: str | os.PathLike,
    table_path: str | os.PathLike,
    plot_paths: Mapping[str, str | os.PathLike],
    baseline_checkpoint: str | os.PathLike,
    gguf_base_storage: str | os.PathLike | None = None,
    training_path: str | os.PathLike | None = None,
    corpus_manifest: str | os.PathLike | None = None,
    serve_record: str | os.PathLike | None = None,
    tasks_record: str | os.PathLike | None = None,
) -> None:
    """``report_settings``: the config's validated ``report`` block (the schema's defaults
    filled in; this module has none of its own); ``records``: engine id -> arm id (or
    "baseline") -> kind -> path (fourbit.report.loading); ``plot_paths``: by figure name
    (fourbit.report.plots.FIGURES and FRONTIER, the rule's output names; SERVING_FIGURES too
    with ``serve_record``), where to write it. ``serve_record``: the serve step's record, or
    None when the study did not serve its arms (then no Serving section and no serving plots).
    ``tasks_record``: the tasks step's record, or None when no task was enabled (then no Task
    accuracy section and no tasks_delta plot)."""
    read = read_records(records)
    serve, serving = read_serving(serve_record) if serve_record else (None, None)
    tasks_read, tasks = read_tasks(tasks_record) if tasks_record else (None, None)
    weights = check_same_weights(study["model"]["id"], read, serve, tasks_read)
    storage = {"hf": storage_stats(baseline_checkpoint)}
    if gguf_base_storage:
        storage["gguf"] = read_result(gguf_base_storage)
    benches = bench_records(study, read)
    check_records(read)
    manifests = [read_arm(p) for p in arm_manifests]
    rows = build_rows(study, read, manifests, storage, benches)
    facts = run_facts(read, benches, manifests, baseline_checkpoint=baseline_checkpoint,
                      training_path=training_path, corpus_manifest=corpus_manifest)
    facts["records_weights_sha256"] = weights
    # The markdown links each figure relative to where the report lies.
    made = plot(rows, plot_paths) + (plot_serving(serving, plot_paths) if serving else [])
    made += plot_tasks(tasks, rows, plot_paths) if tasks else []
    plots = [(title, os.path.relpath(path, Path(markdown_path).parent)) for title, path in made]
    write_text(table_path, render_tsv(rows))
    write_text(markdown_path, render_markdown(study, rows, facts, report_settings, plots, serving,
                                                  tasks))
    log.info("report: %d rows", len(rows))
