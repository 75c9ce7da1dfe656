"""Reading the result records the report is made from, and refusing sets that do not
belong together (other weights, other bench jobs).

The workflow says which file is which: ``records`` maps engine id -> arm id (or
"baseline") -> kind -> path (workflow/rules/common.smk, all_results), so nothing here
works out an id from where a file lies. Kinds: "ppl_quantized" and "ppl_dense" (an arm
scored as stored and as its dense expansion; the baseline has only "ppl_dense"),
"bench" and "fidelity".
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from fourbit import records as record_schema

# Each kind's record schema (fourbit.records); the two ppl kinds are one record kind.
RECORD_KINDS = {"ppl_quantized": "ppl", "ppl_dense": "ppl", "bench": "bench", "fidelity": "fidelity"}
# The rules that write each record kind: what to rerun when one must be remade (a ppl
# record is an arm's ppl job's or the baseline's, on an engine that keeps fidelity sides
# or not).
WRITTEN_BY = {"ppl": "ppl ppl_baseline ppl_with_side ppl_baseline_with_side", "bench": "bench",
              "fidelity": "fidelity", "serve": "serve", "tasks": "tasks",
              "arm": "quantize (quantize_gguf for a llama.cpp arm)"}

RecordPaths = Mapping[str, Mapping[str, Mapping[str, str | os.PathLike]]]


class ReportInputError(ValueError):
    """A result file the report needs is missing or corrupt."""


class Record(NamedTuple):
    """One result file as read: where it lies (for messages) and what it says."""

    path: str
    data: dict


Records = dict[str, dict[str, dict[str, Record]]]


def read_result(path: str | os.PathLike) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as error:
        raise ReportInputError(f"{path}: result file is missing; rerun the step that writes it") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ReportInputError(f"{path}: result file is corrupt ({error}); delete it and rerun") from error


def record_paths(records: RecordPaths) -> list[str]:
    """Every path of ``records``, in its order: the report rule's input list."""
    return [str(path) for arms in records.values() for kinds in arms.values() for path in kinds.values()]


def read_records(records: RecordPaths) -> Records:
    """Each file of ``records`` read once, in its order (the first bad one is named)."""
    return {engine_id: {arm_id: {kind: Record(str(path), read_result(path)) for kind, path in kinds.items()}
                        for arm_id, kinds in arms.items()}
            for engine_id, arms in records.items()}


def check_records(records: Records) -> None:
    """Every record against its kind's schema (fourbit.records). Run after the checks that
    recognise an older fourbit's records, which say more than a missing field would."""
    for kind, (path, data) in _each(records):
        _checked(RECORD_KINDS[kind], data, path)


def read_arm(path: str | os.PathLike) -> dict:
    """An arm's manifest (arm.json), checked like every other record."""
    return _checked("arm", read_result(path), path)


def _checked(kind: str, data: dict, path: str | os.PathLike) -> dict:
    try:
        return record_schema.check(kind, data, path)
    except record_schema.RecordError as error:
        raise ReportInputError(
            f"{error}; remake it: snakemake --forcerun {WRITTEN_BY[kind]}, {path}") from None


def _each(records: Records) -> Iterator[tuple[str, Record]]:
    for arms in records.values():
        for kinds in arms.values():
            yield from kinds.items()


def bench_records(study: dict, records: Records) -> dict[str, list[dict]]:
    """Each engine that ran here: its arms' bench records, in its arms' order.

    Every measured record must come from the same bench job: rows timed in separate
    jobs saw different hosts (a shared host's speed drifts over minutes), so their
    absolute tok/s are not comparable and their baselines not poolable.
    """
    benches = {}
    first_job = None
    for engine_id, engine in study["engines"].items():
        if engine["unavailable"]:
            continue
        benches[engine_id] = []
        for arm_id in engine["arms"]:
            path, bench = records[engine_id][arm_id]["bench"]
            if bench.get("measured"):
                if "job" not in bench:
                    raise ReportInputError(
                        f"{path}: written by an older fourbit (one bench job per arm); rerun the "
                        "bench step, which times every arm in one job: snakemake --forcerun bench"
                    )
                first_job = first_job or (path, bench["job"])
                if bench["job"] != first_job[1]:
                    raise ReportInputError(
                        f"{path}: timed in another bench job ({bench['job']['started']}) than "
                        f"{first_job[0]} ({first_job[1]['started']}); rows from separate jobs are "
                        "not comparable; rerun the bench step: snakemake --forcerun bench"
                    )
            benches[engine_id].append(bench)
    return benches


def check_same_weights(model_id: str, records: Records, serve: Record | None = None,
                       tasks: Record | None = None) -> str | None:
    """Every record must name the weights it was computed from, and all must name the same;
    ``serve``, the serve step's one record, when the study served its arms; ``tasks``, the
    tasks step's, when it scored them on a task set.

    One model id can come to mean other weights (the builtin model retrained on a host
    whose kernels round differently, a local folder edited in place): records made before
    and after then sit side by side, and a Δppl or a ratio between them compares two
    models. The hash says which weights each record saw."""
    first: tuple[str, str] | None = None
    carriers: dict[str, list[str]] = {}
    written = [(WRITTEN_BY[RECORD_KINDS[kind]], record) for kind, record in _each(records)]
    written += [(WRITTEN_BY["serve"], serve)] if serve else []
    written += [(WRITTEN_BY["tasks"], tasks)] if tasks else []
    for rule, (path, record) in written:
        if "model_weights_sha256" not in record:
            raise ReportInputError(
                f"{path}: has no model_weights_sha256, so it was written by an older fourbit "
                "that did not record which weights it was computed from; rerun it: "
                f"snakemake --forcerun {rule}"
            )
        weights = record["model_weights_sha256"]
        carriers.setdefault(weights, []).append(path)
        first = first or (path, weights)
    if len(carriers) < 2:
        return first[1] if first else None
    other = next(w for w in carriers if w != first[1])
    rules = sorted({rule for rule, _ in written})
    raise ReportInputError(
        f"records under model id {model_id} were computed from different weights: "
        f"{first[0]} from model_weights_sha256 {first[1]} ({len(carriers[first[1]])} records), "
        f"{carriers[other][0]} from {other} ({len(carriers[other])} records)"
        + (f" and {len(carriers) - 2} more hash(es)" if len(carriers) > 2 else "")
        + "; the model under this id changed between runs (e.g. the builtin model retrained on "
        "another CPU). Rerun every record from the weights now in place: "
        f"snakemake --forcerun {' '.join(rules)}"
    )


def run_facts(
    records: Records, benches: dict[str, list[dict]], manifests: list[dict], *,
    baseline_checkpoint: str | os.PathLike, training_path: str | os.PathLike | None,
    corpus_manifest: str | os.PathLike | None,
) -> dict:
    """What the report says about the run beside its rows: the perplexity definition the
    records carry, the builtin model's training, the model's and corpus's hashes, the
    bench host, and how each arm was quantized; each only when recorded."""
    # Every row scored the same token ids (rows.build_rows checks it), so the first
    # engine's baseline record speaks for all: its definition, windows and tokens.
    first = next(iter(records.values()))["baseline"]["ppl_dense"].data
    facts = {"definition": first["definition"], "windows": len(first["window_tokens"]),
             "tokens": first["tokens"], "benches": benches}
    if training_path and Path(training_path).is_file():
        facts["training"] = read_result(training_path)
    source = Path(baseline_checkpoint) / "fourbit-source.json"
    if source.is_file():
        facts["model_sha256"] = read_result(source)["weights_sha256"]
    if corpus_manifest:
        splits = read_result(corpus_manifest).get("splits", {})
        facts["corpus_sha256"] = {name: split["sha256"] for name, split in splits.items()}
    measured = [b for engine in benches.values() for b in engine if b.get("measured")]
    if measured:
        facts["provenance"] = measured[0]["provenance"]
        facts["bandwidth"] = measured[0]["bandwidth"]
    facts["quantization"] = [m for m in manifests if "method_facts" in m]
    facts["fidelity_definitions"] = fidelity_definitions(records)
    return facts


def fidelity_definitions(records: Records) -> dict[str, list[str]]:
    """Each definition the fidelity records carry (which windows and positions, which
    prompts), with the engines that used it."""
    engines_of: dict[str, list[str]] = {}
    for engine_id, arms in records.items():
        for kinds in arms.values():
            record = kinds["fidelity"].data if "fidelity" in kinds else {}
            if record.get("computed"):
                definition = f"{record['definition']} ({record['method']}, {record['bound']})"
                if engine_id not in engines_of.setdefault(definition, []):
                    engines_of[definition].append(engine_id)
    return engines_of
