"""The arm the report's fidelity verdict would name among one engine's arms, read from
their records, for the steps that time only that arm beyond the bench (the serve step,
the bench's runtime variants) and must choose before the report exists."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from fourbit.report.rows import control
from fourbit.report.verdicts import closest_to_baseline, distribution_measures


def best_faithful(records: Mapping[str, Mapping[str, str | Path]],
                  tolerances: dict) -> str | None:
    """``records``: each candidate arm's id and its record paths ({"ppl_quantized",
    "ppl_dense", "fidelity"}; an arm without "fidelity" is not judged). The id of the arm
    fourbit.report.verdicts.closest_to_baseline names, or None when none was judged.
    ``tolerances``: the study's evaluation.control_tolerance."""
    rows = []
    for arm_id, paths in records.items():
        read = {kind: json.loads(Path(path).read_text()) for kind, path in paths.items()}
        if "fidelity" not in read:
            continue
        row = {"arm_id": arm_id, "control": None, "_measures": distribution_measures(read["fidelity"])}
        if "ppl_dense" in read:
            row.update(control(read["ppl_quantized"], read["ppl_dense"], tolerances))
        rows.append(row)
    best = closest_to_baseline(rows)
    return None if best is None else best["arm_id"]
