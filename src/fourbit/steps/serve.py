"""workflow/rules/serve.smk: rule serve (serve_study). What each served build gives 1, 2, 4,
8, 16 concurrent users on its engine's real OpenAI-compatible server.

One job serves the whole study, as the bench times it: every served arm's server is
started once (each on a free loopback port, in its own process group: fourbit.serving.
process), all held open, and the levels are timed in passes interleaved across the arms,
the order rotated by one each pass (fourbit.bench.passes says why), so every arm's
passes span the whole job and see the same host. Before each level: the contention gate
on the job's cores (the servers idle, so busy time is someone else's, or a server still
starting), and the model files' page-cache state (read through first for llama-server,
which maps its GGUF and reads it while it computes). A level is vLLM's serving benchmark
(fourbit.serving.load): ``requests_per_level`` greedy requests of ``prompt_tokens`` token
ids from the evaluation windows, ``output_tokens`` each with EOS ignored, at most
``concurrency`` in flight, after ``warmup_requests`` untimed ones.

What is served (serve.arms): the arms named, on every engine that runs them, or per engine
the arm the report's fidelity verdict recommends (best_faithful: fourbit.report.verdicts.
closest_to_baseline, from the arms' ppl and fidelity records), and each engine's baseline
(serve.baseline). How a vLLM arm runs (serve.runtime): as scored, or as the first runtime
variant of a preference list this CPU runs (fourbit.bench.variants; the job probes the CPU,
so on a cluster the node decides), e.g. the bfloat16 engine a user deploys on a CPU with
avx512_bf16, where the study scores in float32 to keep its control exact.

Refused, not failed: an arm its engine cannot run here (found before the job, e.g. a
missing ISA) or a GGUF llama-server will not load; its entry says why and the other arms
are served. Over capacity, not timed: a level whose requests the server's KV cache cannot
hold at once (vLLM's own count of its cache, from its log). Failed: a server that exits
or never answers at its start, or dies during a level: the job stops with its command
line and log tail, every server is stopped, and no serve.json is written.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from fourbit import records
from fourbit.bench import variants
from fourbit.bench.contention import check_quiet
from fourbit.bench.hostmemory import available_memory_bytes
from fourbit.bench.passes import summarize
from fourbit.bench.pinning import choose_cores, pinned
from fourbit.bench.provenance import provenance
from fourbit.bench.residency import cache_state, warm_and_check
from fourbit.cpuinfo import isa_flags
from fourbit.engines import engine_spec, get_engine
from fourbit.hashing import require_sha256
from fourbit.steps.faithful import best_faithful
from fourbit.steps.llamacpp import load_tools
from fourbit.schema import block
from fourbit.serving.load import LoadError, load_generator, run_level
from fourbit.serving.process import (
    RunningServer,
    ServerError,
    exit_on_sigterm,
    running_server,
)
from fourbit.serving.registry import launch
from fourbit.serving.workload import SOURCE, prompts_from_windows

log = logging.getLogger("fourbit")

BASELINE = "baseline"


@dataclass(frozen=True)
class ServedArm:
    """One checkpoint of one engine the serve job may serve; the workflow fills it in."""

    engine_id: str
    engine: dict  # {"name": .., **the engine's settings}
    arm: str  # the arm's id, or "baseline"
    arm_name: str  # the arm's name in the config, or "baseline"
    model: Path  # a Hugging Face folder (vLLM) or a GGUF file (llama.cpp)
    cache: Path | None = None  # vLLM's compile caches for this checkpoint in this step
    # Why its engine cannot run it here (found before any job); None: it is served.
    refusal: str | None = None
    # best_faithful: the arm's records the choice reads ({"ppl_quantized", "ppl_dense",
    # "fidelity"}: paths), empty for a baseline.
    records: dict[str, Path] = field(default_factory=dict)
    # serve.runtime's outcome, set by the job: {"preferred", "variant" (None: as scored),
    # "passed_over": [{"name", "reason"}]}; None when it is as_scored or has no variants.
    runtime_choice: dict | None = None

    @property
    def key(self) -> str:
        return f"{self.engine_id}/{self.arm}"


def serve_study(arms: list[ServedArm], serve_settings: dict, bench_settings: dict, *,
                windows: Path, out: Path, server_logs: Path, threads: int,
                model_weights_sha256: str, control_tolerance: dict,
                llamacpp_tools: Path | None = None) -> dict:
    """Serve the chosen ``arms`` (see the module docstring), write serve.json to ``out``,
    return it. ``bench_settings`` give the contention gate and the cores; ``server_logs`` is
    the folder each server's own log goes to; ``control_tolerance`` is the study's
    evaluation.control_tolerance, for best_faithful's choice; ``llamacpp_tools`` the llama.cpp
    build's record (rule build_llamacpp), where llama-server is."""
    require_sha256(model_weights_sha256)
    settings = block("serve", serve_settings)
    gate = block("bench", bench_settings)
    # Served as deployed: vLLM compiled unless the study's bench.vllm_compiled is false.
    if settings["runtime"] != "as_scored":
        variants.check_names(settings["runtime"], "serve.runtime")
    arms = [ServedArm(**{**vars(a), "model": Path(a.model), "cache": a.cache and Path(a.cache),
                         "engine": engine_spec(a.engine["name"]).deployed_settings(
                             a.engine, gate["vllm_compiled"])}) for a in arms]
    probed = variants.probed_by_name(isa_flags())
    chosen = [as_deployed(arm, settings["runtime"], probed)
              for arm in choose_arms(arms, settings, control_tolerance)]
    _check_context(chosen, settings["prompt_tokens"] + settings["output_tokens"])
    prompts = prompts_from_windows(windows, prompt_tokens=settings["prompt_tokens"],
                                   requests=settings["requests_per_level"])
    cores = choose_cores(gate["cores"], threads)
    llamacpp_server = load_tools(llamacpp_tools).server if llamacpp_tools else None
    started = datetime.now(UTC).isoformat(timespec="seconds")
    with exit_on_sigterm(), pinned(cores), contextlib.ExitStack() as servers:
        entries, running = _start_servers(chosen, settings, cores, servers, Path(server_logs),
                                          llamacpp_server)
        contention = _time_levels(entries, running, settings, gate, cores, prompts)
    record = {
        "measured": True,
        "model_weights_sha256": model_weights_sha256,
        "job": {"started": started, "served": len(running), "refused": len(entries) - len(running),
                "available_memory_bytes": available_memory_bytes()},
        "provenance": provenance(len(cores), cores),
        "contention": contention,
        "workload": {"source": SOURCE, "prompt_tokens": settings["prompt_tokens"],
                     "output_tokens": settings["output_tokens"],
                     "requests_per_level": settings["requests_per_level"],
                     "warmup_requests": settings["warmup_requests"], "passes": settings["passes"],
                     "seed": 0, "sampling": "greedy (temperature 0), EOS ignored"},
        "concurrency": sorted(settings["concurrency"]),
        "tpot_bound_ms": settings["tpot_bound_ms"],
        "load_generator": load_generator(),
        "selection": settings["arms"] if settings["arms"] == "best_faithful" else list(settings["arms"]),
        "served": [_finished(entry) for entry in entries.values()],
    }
    records.write("serve", out, record)
    return record


def choose_arms(arms: list[ServedArm], settings: dict, tolerances: dict) -> list[ServedArm]:
    """The arms serve.arms and serve.baseline select, in ``arms``' order."""
    wanted = settings["arms"]
    if wanted == "best_faithful":
        keep = set()
        for engine_id in dict.fromkeys(a.engine_id for a in arms):
            candidates = [a for a in arms if a.engine_id == engine_id and a.arm != BASELINE]
            best = _best_faithful(candidates, tolerances)
            if best is not None:
                keep.add(best.key)
            else:
                log.info("%s: no arm's fidelity was judged; none of its arms is served", engine_id)
    else:
        keep = {a.key for a in arms if a.arm_name in wanted}
        unserved = sorted(set(wanted) - {a.arm_name for a in arms})
        if unserved:
            log.info("serve.arms %s: no engine with a server runs them here", unserved)
    return [a for a in arms
            if a.key in keep or (a.arm == BASELINE and settings["baseline"])]


def as_deployed(arm: ServedArm, preferred: str | list[str], probed: dict[str, dict]) -> ServedArm:
    """``arm`` under the first of the ``preferred`` runtime variants (serve.runtime) this CPU
    runs (``probed``: fourbit.bench.variants.probed_by_name), with a compile cache of
    its own; as scored when none does, when that one is how it scored, or when ``preferred``
    is as_scored. A dense checkpoint (a baseline) runs one way: as scored."""
    if preferred == "as_scored" or arm.refusal or not variants.has_variants(arm.engine["name"]):
        return arm
    runs = get_engine(arm.engine["name"])
    scored = runs.runtime_variant(arm.model, arm.engine)
    if scored is None:
        return arm
    passed_over = []
    for name in preferred:
        settings, reason = variants.settings_under(runs, arm.engine, arm.model,
                                                   variants.by_name(name), probed)
        if settings is not None:
            chosen = {"preferred": list(preferred), "variant": None if name == scored else name,
                      "passed_over": passed_over}
            if name == scored:
                return replace(arm, runtime_choice=chosen)
            return replace(arm, engine=settings, runtime_choice=chosen,
                           cache=arm.cache and arm.cache / variants.cache_name(name))
        passed_over.append({"name": name, "reason": reason})
    return replace(arm, runtime_choice={"preferred": list(preferred), "variant": None,
                                        "passed_over": passed_over})


def _best_faithful(candidates: list[ServedArm], tolerances: dict) -> ServedArm | None:
    """The report's choice among one engine's arms, from their records."""
    by_id = {arm.arm: arm for arm in candidates if not arm.refusal}
    best = best_faithful({arm_id: arm.records for arm_id, arm in by_id.items()}, tolerances)
    return None if best is None else by_id[best]


def _check_context(arms: list[ServedArm], tokens: int) -> None:
    """A request of prompt + output tokens must fit the model's positions: beyond them a
    server either refuses it or computes positions the model never learnt."""
    for arm in arms:
        config = arm.model / "config.json"
        if arm.model.is_dir() and config.is_file():
            positions = json.loads(config.read_text()).get("max_position_embeddings")
            if positions is not None and tokens > positions:
                raise ValueError(
                    f"serve.prompt_tokens + serve.output_tokens = {tokens}, more than the "
                    f"{positions} positions of the model ({config}); lower them to at most "
                    f"{positions} together")


def _start_servers(arms: list[ServedArm], settings: dict, cores: list[int],
                   servers: contextlib.ExitStack, log_dir: Path,
                   llamacpp_server: Path | None) -> tuple[dict, dict]:
    """Start every arm's server one after the other, each answering before the next
    starts; the refused get their entry. Returns (entries by key, running servers by key)."""
    slots = max(settings["concurrency"])
    tokens = settings["prompt_tokens"] + settings["output_tokens"]
    entries, running = {}, {}
    for arm in arms:
        entry = {"engine_id": arm.engine_id, "engine": arm.engine["name"], "arm": arm.arm,
                 "arm_name": arm.arm_name, "model": str(arm.model)}
        if arm.runtime_choice is not None:
            entry["runtime_choice"] = arm.runtime_choice
        entries[arm.key] = entry
        if arm.refusal:
            entry |= {"status": "refused", "reason": arm.refusal}
            log.info("%s: refused (%s)", arm.key, arm.refusal)
            continue
        log_path = log_dir / f"{arm.engine_id}.{arm.arm}.log"
        start = launch(arm.key, arm.engine, arm.model, served_name=arm.arm_name, slots=slots,
                       tokens_per_request=tokens, cores=cores, cache_root=arm.cache,
                       llamacpp_server=llamacpp_server)
        server_kind, port, command = start.kind, start.port, start.command
        entry |= {"command": command.argv, "server_log": str(log_path)}
        try:
            server = servers.enter_context(running_server(
                arm.key, command.argv, command.env, port, log_path,
                health_path=server_kind.health_path,
                startup_timeout_s=settings["startup_timeout_s"]))
        except ServerError:
            reason = server_kind.refusal(log_path)
            if reason is None:
                raise
            entry |= {"status": "refused", "reason": reason}
            log.info("%s: refused (%s)", arm.key, reason)
            continue
        log.info("%s: answering after %.1f s", arm.key, server.startup_s)
        entry |= {"status": "measured", "startup_s": server.startup_s,
                  "runtime": f"{get_engine(arm.engine['name']).runtime(arm.model, arm.engine)}, "
                             f"served by {server_kind.label}",
                  "levels": []}
        for level in sorted(settings["concurrency"]):
            full = server_kind.over_capacity(log_path, level, tokens)
            entry["levels"].append({"concurrency": level, "status": "over_capacity", "reason": full}
                                   if full else {"concurrency": level, "status": "measured",
                                                 "passes": []})
        running[arm.key] = (arm, server_kind, server)
    return entries, running


def _time_levels(entries: dict, running: dict, settings: dict, gate: dict, cores: list[int],
                 prompts: list[list[int]]) -> list[dict]:
    """Every measured level of every running server, ``passes`` times, interleaved; each
    level's figures appended to its entry. Returns the contention gate's findings."""
    keys = list(running)
    contention = []
    for number in range(1, settings["passes"] + 1):
        shift = (number - 1) % max(len(keys), 1)
        for key in keys[shift:] + keys[:shift]:
            arm, server_kind, server = running[key]
            for level in entries[key]["levels"]:
                if level["status"] != "measured":
                    continue
                when = f"before pass {number} of {key} at concurrency {level['concurrency']}"
                busy = check_quiet(cores, gate["busy_threshold"], gate["allow_busy"], when=when,
                                   starting=[k for k, (_, _, s) in running.items()
                                             if s.process.poll() is None and not s.startup_s])
                residency = (warm_and_check if server_kind.model_files_read_while_serving()
                             else cache_state)([arm.model])
                contention.append({"pass": number, "served": key,
                                   "concurrency": level["concurrency"], **busy})
                figures = _one_level(server, arm, level["concurrency"], settings, prompts,
                                     dict(server_kind.extra_body))
                level["passes"].append({"pass": number, **figures,
                                        "checks": {"residency": residency,
                                                   "override_used": busy["override_used"]}})
                log.info("%s pass %d, concurrency %d: %.1f output tok/s, TPOT p99 %.1f ms",
                         key, number, level["concurrency"], figures["output_tok_s"],
                         figures["tpot_ms"]["p99"])
    return contention


def _one_level(server: RunningServer, arm: ServedArm, concurrency: int, settings: dict,
               prompts: list[list[int]], extra_body: dict) -> dict:
    server.check_alive()
    try:
        figures = run_level(server.base_url, arm.arm_name, prompts,
                            output_tokens=settings["output_tokens"], concurrency=concurrency,
                            warmup=settings["warmup_requests"], extra_body=extra_body)
    except (LoadError, ValueError, OSError) as e:
        server.check_alive()  # a dead server is the cause to name
        raise server.failure(f"concurrency {concurrency}: {e}") from e
    server.check_alive()
    return figures


SUMMARIZED = {"output_tok_s": ("output_tok_s",), "requests_per_s": ("requests_per_s",),
              "ttft_ms_p50": ("ttft_ms", "p50"), "ttft_ms_p99": ("ttft_ms", "p99"),
              "tpot_ms_p50": ("tpot_ms", "p50"), "tpot_ms_p99": ("tpot_ms", "p99")}


def _finished(entry: dict) -> dict:
    """The entry with each measured level's median/min/max over its passes."""
    for level in entry.get("levels", []):
        if level["status"] == "measured":
            level["summary"] = {name: summarize([_get(p, path) for p in level["passes"]])
                                for name, path in SUMMARIZED.items()}
    return entry


def _get(figures: dict, path: tuple[str, ...]) -> float:
    for part in path:
        figures = figures[part]
    return figures
