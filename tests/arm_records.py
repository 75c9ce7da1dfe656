"""An arm's records as the study's ppl and fidelity steps write them, with the fields the
report's fidelity choice reads: for tests of the steps that choose the best faithful arm
(fourbit.steps.faithful: serve, the bench's runtime variants)."""

from __future__ import annotations

import json
from pathlib import Path


def arm_records(folder: Path, *, kl: float, control_delta: float) -> dict[str, Path]:
    """An arm's ppl (as stored, as its dense expansion) and fidelity records, as the
    study's steps write them, with the fields the report's fidelity choice reads."""
    folder.mkdir(parents=True)
    paths = {kind: folder / f"{kind}.json" for kind in ("ppl_quantized", "ppl_dense", "fidelity")}
    paths["ppl_quantized"].write_text(json.dumps({"mean_nll": 2.0 + control_delta, "numerics": "exact"}))
    paths["ppl_dense"].write_text(json.dumps({"mean_nll": 2.0, "numerics": "exact"}))
    # per-window sums of 4 windows of 100 positions, a little scattered, as every engine writes them
    paths["fidelity"].write_text(json.dumps({
        "computed": True, "kl_mean": kl, "top1_agreement": 0.9, "token_ids_sha256": "t",
        "window_kl_sum": [100 * kl * (1 + d) for d in (-0.01, 0.0, 0.01, 0.0)],
        "window_top1": [90, 90, 90, 90], "window_positions": [100] * 4,
        "greedy": {"identical": 3, "prompts": 4}}))
    return paths
