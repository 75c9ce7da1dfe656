"""workflow/rules/bench.smk: rule bench (bench_study). Every arm's prefill and decode
speed against its engine's baseline, and the chosen arms' runtime variants.

One job times the whole study: every arm of every engine, each paired with its
engine's unquantized baseline, interleaved in rounds (fourbit.bench.passes says
why). Each arm still gets a record of its own, its ``bench.json``:

    arm / baseline   per side: the checkpoint, what runs it in the timed passes (vLLM
                     compiled unless bench.vllm_compiled is false), its untimed start
                     (mode, seconds compiling), min/median/max and spread of every
                     metric, the weight bytes a decode step reads, the decode roofline
    ratio            arm / baseline, pass by pass (both timed in the same pass,
                     order rotated), and its min/median/max/spread
    runs             every pass: its order, its slot in its round, when it started,
                     its checks (contention gate and page-cache residency), its values
    variants         the arm's runtime variants (fourbit.bench.variants), each timed
                     against the arm as scored in the same rounds, or refused here
    job, group       when the job started, what it timed, in how many memory groups;
                     the group this pair ran in
    contention       threshold, allow_busy, whether the override was used, the
                     busiest core seen
    bandwidth        the triad bandwidth measured in this job, on its pinned cores
    provenance       host, ISA, cores, threads, load, versions, speed-relevant env

How an engine takes part is its EngineSpec's ``bench`` (fourbit.engines.ENGINES):
Bench.PER_PASS, a TimesPasses (fourbit.engines.base) whose ``throughput`` times one
pass in an engine started for it (llama-bench loads its model itself, as its users run
it); NotBenchmarked(reason), when its speed means nothing for a shipped build (the
record says so, ``measured`` false); or Bench.SESSION, a TimesInSession whose
``throughput_session`` keeps an engine open across passes: the job then holds every
checkpoint's engine open at once (vLLM: one worker process each) and a pass costs only
its runs. Engines that would not fit in memory together are timed in groups that do,
one after the other (fourbit.bench.memory_groups). The page-cache check before every
pass matters for engines that read their files while timing (llama-bench maps the
GGUF); for an engine kept open it only records the cache state. The bandwidth is
measured once per job, before its passes, on the same pinned cores: on a shared host
it moves with the neighbours' load, so only a figure from the same job as the decode
timings makes their fraction of it meaningful. docs/measurement.md tells the rest."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from fourbit import records
from fourbit.bench import variants
from fourbit.bench.bandwidth import decode_roofline, measure_bandwidth
from fourbit.bench.contention import check_quiet, gates_summary, wait_until_quiet
from fourbit.bench.hostmemory import available_memory_bytes
from fourbit.bench.memory_groups import held_open_bytes, plan_groups
from fourbit.bench.passes import run_rounds
from fourbit.bench.pinning import choose_cores, pinned
from fourbit.bench.provenance import provenance
from fourbit.bench.residency import cache_state, warm_and_check
from fourbit.bench.starts import open_group
from fourbit.bench.weight_bytes import decode_weight_bytes
from fourbit.schema import block
from fourbit.engines import Bench, EngineSpec, NotBenchmarked, engine_spec, get_engine
from fourbit.engines.base import TimesInSession, TimesPasses, capable
from fourbit.cpuinfo import isa_flags
from fourbit.hashing import require_sha256
from fourbit.steps.faithful import best_faithful

log = logging.getLogger("fourbit")
SETTLE_S = 120  # at most, for the cores to go quiet once a group's engines have started


def resolve_settings(given: dict, threads: int) -> dict:
    """``given`` checked against the schema's bench block, its defaults filled, cores
    chosen: direct callers get the workflow's defaults and refusals (e.g. < 3 passes)."""
    settings = block("bench", given)
    settings["cores"] = choose_cores(settings["cores"], threads)
    return settings


@dataclass(frozen=True)
class BenchPair:
    """One arm of one engine, to be timed against that engine's baseline; ``out`` its record.

    ``name`` ("<engine id>/<arm id>") and ``caches`` (compile caches, one per checkpoint:
    {"arm": .., "baseline": ..}, the baseline's shared by its engine's arms) come from
    the workflow, which knows the ids and where results go."""

    name: str
    arm: Path
    baseline: Path
    engine: dict  # {"name": .., **the engine's settings}
    out: Path
    caches: dict[str, Path]
    # Why this engine cannot time this model, found before any job (fourbit.config's
    # bench_refusals); None: it is timed.
    refusal: str | None = None
    # Its arm's runtime variants (bench.runtimes) are timed: "named" yes, "none" no,
    # "best_faithful" if its engine's best faithful arm by ``records`` (ppl_quantized,
    # ppl_dense, fidelity: paths); their compile caches go under caches["variants"].
    variant_choice: str = "none"
    records: dict[str, Path] = field(default_factory=dict)
    baseline_engine: dict | None = None  # a variant's pair: the arm as scored is its baseline


def bench_study(pairs: list[BenchPair], bench_settings: dict, threads: int, *,
                model_weights_sha256: str, control_tolerance: dict | None = None) -> list[dict]:
    """Time every pair in one job, interleaved in rounds (bench.passes.run_rounds); write
    and return each pair's record, in ``pairs``' order. Every record, timed or not, carries
    ``model_weights_sha256``: the source model's weights every checkpoint of the study was
    made from (fourbit.hashing.model_weights_sha256). The chosen arms' runtime variants
    (bench.runtimes) are timed in the same rounds against the arm as scored and kept in its
    record; best_faithful chooses by ``control_tolerance`` (evaluation.control_tolerance).

    Every checkpoint is opened once for the job: an arm by its pair, a baseline once for
    all its engine's arms. Nothing is written until every pass has run, so a refusal or a
    failure leaves no record that looks finished.
    """
    require_sha256(model_weights_sha256)
    pairs = [replace(p, arm=Path(p.arm), baseline=Path(p.baseline), out=Path(p.out),
                     caches={side: Path(path) for side, path in p.caches.items()}) for p in pairs]
    names = [pair.name for pair in pairs]
    if len(set(names)) < len(names):
        raise ValueError(f"bench pairs {names} repeat a name; each arm of an engine is timed "
                         "once")
    specs = {pair.name: engine_spec(pair.engine["name"]) for pair in pairs}
    # Why a pair is not timed: its engine is not a deployment engine, or cannot time this model.
    untimed = {pair.name: pair.refusal or _not_deployed(specs[pair.name]) for pair in pairs}
    timed = [pair for pair in pairs if untimed[pair.name] is None]
    by_name = {pair.name: pair for pair in pairs}
    record_of = {pair.name: _not_benchmarked(pair, untimed[pair.name])
                 for pair in pairs if pair not in timed}
    if timed:
        settings = resolve_settings(bench_settings, threads)
        chosen, planned = _plan_variants(timed, settings, control_tolerance)
        variant_pairs = [_variant_pair(by_name[v.pair], v) for v in planned if v.settings]
        specs |= {v.key: specs[v.pair] for v in planned if v.settings}
        records_by_pair = _time_pairs(timed + variant_pairs, specs, settings)
        record_of |= {pair.name: records_by_pair[pair.name] for pair in timed}
        for pair in timed:
            record_of[pair.name]["variants"] = variants.record(
                pair.name in chosen, [v for v in planned if v.pair == pair.name], records_by_pair)
    for pair in pairs:
        record_of[pair.name]["model_weights_sha256"] = model_weights_sha256
        records.write("bench", pair.out, record_of[pair.name])
    for pair in timed:
        _log_summary(pair, record_of[pair.name])
    return [record_of[pair.name] for pair in pairs]


def _plan_variants(timed: list[BenchPair], settings: dict,
                   tolerances: dict | None) -> tuple[set[str], list[variants.Variant]]:
    """The pairs whose arms' variants are timed (BenchPair.variant_choice), and their
    variants, each to time (with its numerics for a decode row and a prompt) or refused
    here by the host probe of this CPU (the job's: on a cluster, not the DAG's host)."""
    chosen = {pair.name for pair in timed if pair.variant_choice == "named"}
    for engine_name in dict.fromkeys(pair.engine["name"] for pair in timed):
        candidates = {pair.name: pair.records for pair in timed if pair.engine["name"] == engine_name
                      and pair.variant_choice == "best_faithful"}
        if not candidates:
            continue
        if tolerances is None:
            raise ValueError("bench.runtimes.arms best_faithful chooses by the study's "
                             "evaluation.control_tolerance: pass control_tolerance")
        best = best_faithful(candidates, tolerances)
        if best is None:
            log.info("%s: no arm's fidelity was judged; no runtime variants timed", engine_name)
        chosen |= {best} - {None}
    flags = isa_flags()
    return chosen, [variant for pair in timed if pair.name in chosen
                    for variant in variants.plan_variants(
                        get_engine(pair.engine["name"]), pair.engine, pair.arm,
                        settings["runtimes"]["variants"], flags, pair.name,
                        Path(pair.caches["variants"]), prompt_tokens=settings["prompt_tokens"])]


def _variant_pair(pair: BenchPair, variant: variants.Variant) -> BenchPair:
    """The arm under ``variant`` against the arm as scored, as a pair of its own."""
    return replace(pair, name=variant.key, engine=variant.settings, baseline=pair.arm,
                   baseline_engine=pair.engine, caches={"arm": variant.cache, "baseline": pair.caches["arm"]})


def _not_deployed(spec: EngineSpec) -> str | None:
    return spec.bench.reason if isinstance(spec.bench, NotBenchmarked) else None


def _not_benchmarked(pair: BenchPair, reason: str) -> dict:
    log.info("%s: not benchmarked (%s)", pair.name, reason)
    return {"measured": False, "reason": reason, "engine": pair.engine}


def _time_pairs(pairs: list[BenchPair], specs: dict[str, EngineSpec],
                settings: dict) -> dict[str, dict]:
    """Each pair's record, or {"failed": why} for a variant whose engine did not start.
    Long because each memory group's engines are opened, settled, timed and closed in one
    with-block."""
    cores = settings["cores"]
    sides = _sides(pairs, specs, settings["vllm_compiled"])
    held = {key: held_open_bytes(side.checkpoint, side.settings["dtype"])
            for key, side in sides.items()
            if side.bench is Bench.SESSION}
    available = available_memory_bytes()
    groups = _groups(pairs, held, available)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    by_name = {pair.name: pair for pair in pairs}

    def before_pass(name: str, number: int) -> dict:
        # Both sides run in the pass, so both are warmed and checked (a side held open read
        # its files at its start: its cache state is only recorded).
        pair = by_name[name]
        gate = check_quiet(cores, settings["busy_threshold"], settings["allow_busy"],
                           when=f"before pass {number} of {name}")
        residency = {}
        for side, checkpoint in (("arm", pair.arm), ("baseline", pair.baseline)):
            held_open = sides[_side_key(pair, side)].bench is Bench.SESSION
            residency[side] = (cache_state if held_open else warm_and_check)([checkpoint])
        return {"contention": gate, "residency": residency}

    results, peaks, group_of, starts, failed = {}, {}, {}, {}, {}
    variant_engines = {_side_key(p, "arm") for p in pairs if p.baseline_engine}
    with pinned(cores):
        bandwidth = measure_bandwidth(threads=len(cores))  # before any engine starts
        for number, group in enumerate(groups, start=1):
            keys = list(dict.fromkeys(_side_key(p, side) for p in group
                                      for side in ("arm", "baseline")))
            if len(groups) > 1:
                log.info("bench group %d of %d (%s): %.1f GiB held open of %.1f GiB available",
                         number, len(groups), ", ".join(p.name for p in group),
                         sum(held.get(key, 0) for key in keys) / 2**30, available / 2**30)
            with contextlib.ExitStack() as open_engines:
                runs = open_group(open_engines, {key: functools.partial(
                    _pass_runner, sides[key], len(cores), prompt_tokens=settings["prompt_tokens"],
                    decode_tokens=settings["decode_tokens"]) for key in keys},
                    optional=variant_engines, failed=failed)
                group = [p for p in group if _side_key(p, "arm") not in failed]
                if group:
                    if not settings["allow_busy"]:  # what their starts left behind, first
                        wait_until_quiet(cores, settings["busy_threshold"], timeout_s=SETTLE_S,
                                         when=f"after group {number}'s engines started")
                    results |= run_rounds(
                        {p.name: (runs[_side_key(p, "arm")], runs[_side_key(p, "baseline")])
                         for p in group},
                        passes=settings["passes"], warmup=settings["warmup"],
                        before_pass=before_pass)
                _note_engines(runs, peaks, starts)
            for pair in group:
                group_of[pair.name] = {"number": number, "of": len(groups),
                                       "pairs": [p.name for p in group]}
    memory = {key: {"estimated_peak_bytes": held.get(key), "peak_rss_bytes": peaks.get(key)}
              for key in sides}
    job = {"started": started, "pairs": len(pairs) - len(variant_engines),
           "variant_pairs": len(variant_engines), "engines": len(sides),
           "checkpoints": len({side.checkpoint for side in sides.values()}),
           "groups": len(groups), "available_memory_bytes": available}
    return {pair.name: {"failed": failed[_side_key(pair, "arm")]} if _side_key(pair, "arm") in failed
            else _record(pair, sides, results[pair.name], settings, bandwidth, job,
                         group_of[pair.name], memory, starts)
            for pair in pairs}


def _note_engines(runs: dict, peaks: dict, starts: dict) -> None:
    """Each held engine's peak memory and start costs, from its pass runner: a baseline
    reopened in a later group keeps its largest peak and its first opening's start."""
    for key, run in runs.items():
        peak = getattr(run, "peak_rss_bytes", None)
        if peak is not None:
            peaks[key] = max(peak, peaks.get(key, 0))
        if starts.get(key) is None:
            starts[key] = getattr(run, "start", None)


@dataclass(frozen=True)
class _Side:
    """A checkpoint opened for the job: one per arm, one per engine's baseline."""

    checkpoint: Path
    # the engine's as timed (EngineSpec.deployed_settings), with this checkpoint's compile cache
    settings: dict
    engine: TimesPasses  # the engine (a TimesInSession where ``bench`` is Bench.SESSION)
    bench: Bench  # how it times a pass
    weights: dict  # what a decode step reads (decode_weight_bytes)


def _side_engine(pair: BenchPair, side: str) -> dict:
    return pair.baseline_engine if side == "baseline" and pair.baseline_engine else pair.engine


def _side_key(pair: BenchPair, side: str) -> str:
    checkpoint = pair.arm if side == "arm" else pair.baseline
    return json.dumps([_side_engine(pair, side), str(checkpoint)], sort_keys=True)


def _sides(pairs: list[BenchPair], specs: dict[str, EngineSpec],
           vllm_compiled: bool) -> dict[str, _Side]:
    sides = {}
    for pair in pairs:
        # Compile caches per checkpoint: a cache shared between two can load the other's graph.
        for side, checkpoint in (("arm", pair.arm), ("baseline", pair.baseline)):
            key = _side_key(pair, side)
            timed = specs[pair.name].deployed_settings(_side_engine(pair, side), vllm_compiled)
            if key not in sides:
                sides[key] = _Side(checkpoint, {**timed, "cache_root": str(pair.caches[side])},
                                   capable(get_engine(pair.engine["name"]), TimesPasses),
                                   specs[pair.name].bench,
                                   decode_weight_bytes(checkpoint, reads=specs[pair.name].reads,
                                                       dense_dtype=_side_engine(pair, side).get("dtype")))
    return sides


def _groups(pairs: list[BenchPair], held: dict[str, int],
            available: int) -> list[list[BenchPair]]:
    """The pairs in the groups memory_groups.plan_groups makes of them, their engines
    named by _side_key (a baseline shared by several arms is one engine)."""
    by_name = {pair.name: pair for pair in pairs}
    engines = {pair.name: {_side_key(pair, side) for side in ("arm", "baseline")}
               for pair in pairs}
    return [[by_name[name] for name in group] for group in plan_groups(engines, held, available)]


def _record(pair: BenchPair, sides: dict[str, _Side], result: dict, settings: dict,
            bandwidth: dict, job: dict, group: dict, memory: dict, starts: dict) -> dict:
    record = {
        "measured": True,
        "engine": pair.engine,
        "settings": settings,
        "job": job,
        "group": group,
        "passes": result["passes"],
        "warmup": result["warmup"],
        "runs": result["runs"],
        "ratio": result["ratio"],
        "bandwidth": bandwidth,
        "contention": gates_summary([run["checks"]["contention"] for run in result["runs"]],
                                    settings["busy_threshold"], settings["allow_busy"]),
        "provenance": provenance(len(settings["cores"]), settings["cores"]),
    }
    decode_metric = f"tg{settings['decode_tokens']}_tok_s"
    for side in ("arm", "baseline"):
        key = _side_key(pair, side)
        opened = sides[key]
        record[side] = {
            "memory": memory[key],
            "checkpoint": str(opened.checkpoint),
            # What ran in the timed passes, which may differ from what scored
            # (EngineSpec.deployed_settings).
            "runtime": opened.engine.runtime(opened.checkpoint, opened.settings),
            # Its name among the host's candidates (provenance's vllm_runtimes), if it has one.
            "variant": opened.engine.runtime_variant(opened.checkpoint, opened.settings),
            # An engine held open for the job: its untimed start (mode, seconds compiling).
            "start": starts.get(key),
            "stats": result[side],
            "weight_bytes_per_token": opened.weights,
            "roofline": decode_roofline(
                opened.weights["bytes"], result[side][decode_metric]["median"], bandwidth["gbs"]
            ),
        }
    return record


@contextlib.contextmanager
def _pass_runner(side: _Side, threads: int, **sizes):
    """A function timing one pass of ``side``: in an engine kept open for the job where
    the engine offers one (Bench.SESSION), else one engine start per pass (Bench.PER_PASS)."""
    engine, checkpoint, settings = side.engine, side.checkpoint, side.settings
    if side.bench is Bench.PER_PASS:
        yield lambda: engine.throughput(checkpoint, settings, threads, **sizes)
        return
    with capable(engine, TimesInSession).throughput_session(checkpoint, settings, threads,
                                                            **sizes) as one_pass:
        yield one_pass


def _log_summary(pair: BenchPair, record: dict) -> None:
    for metric, ratio in record["ratio"].items():
        arm, baseline = record["arm"]["stats"][metric], record["baseline"]["stats"][metric]
        log.info(
            "%s %s: arm %.2f, baseline %.2f (medians of %d passes); ratio %.3f [%.3f, %.3f]",
            pair.name, metric, arm["median"], baseline["median"], record["passes"],
            ratio["median"], ratio["min"], ratio["max"],
        )
    if record["contention"]["override_used"]:
        log.warning(
            "cores were busier than %.0f%% (up to %.0f%%) and allow_busy timed anyway",
            100 * record["contention"]["threshold"], 100 * record["contention"]["max_busy"],
        )
