"""Which runtime variants the bench times beside the runtime an arm scored with.

A vLLM arm can run several ways on one host (fourbit.bench.hostprobe.VLLM_RUNTIMES: the
engine's dtype and the kernel that runs single rows); the study scores it one way, the
way its engine block says. A user deploying it would pick the fastest way this CPU has,
so the bench also times each other variant of the arm's engine that this host runs
(bench.runtimes), paired pass by pass with the arm as scored, in the same job and rounds.
A variant is the arm's checkpoint under other engine settings: its compiled graph
differs, so it gets a compile cache of its own, and its numerics may differ (bfloat16 or
int8 activations), which its record names. It is timed, not scored: no control runs in it
here (tests/test_vllm_plugin.py holds each runtime to its control on tiny models).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fourbit.bench.hostprobe import VLLM_RUNTIMES, VllmRuntime, vllm_runtimes

# Joins a pair's name and a variant's: "<engine id>/<arm id>@<variant name>".
SEPARATOR = "@"


def engine_variants(engine_name: str) -> list[VllmRuntime]:
    """The variants of an engine: every VLLM_RUNTIMES entry it runs (several only for the
    plugin engine, whose dtype and kernel knob a study may set)."""
    return [runtime for runtime in VLLM_RUNTIMES if runtime.engine == engine_name]


def has_variants(engine_name: str) -> bool:
    return len(engine_variants(engine_name)) > 1


def check_names(names: list[str], key: str) -> None:
    """``names`` (the config's ``key``) are variants of an engine that has several, or a
    ValueError listing them (vLLM's own kernels are engines of their own, each scored)."""
    known = [runtime.name for runtime in VLLM_RUNTIMES if has_variants(runtime.engine)]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"{key}: unknown variant(s) {unknown}; name them from "
                         f"fourbit.bench.hostprobe: {known}")


def variant_settings(engine: dict, runtime: VllmRuntime) -> dict:
    """The plugin engine's settings (the workflow's mapping, its name included) under
    ``runtime``: its dtype, and its kernel knob overriding the checkpoint's."""
    return {**engine, "dtype": runtime.dtype, "quant": {**engine["quant"], "kernel": runtime.kernel}}


@dataclass(frozen=True)
class Variant:
    """One variant to time for one arm, or refused here with the reason."""

    pair: str  # the arm's bench pair name
    name: str  # the VllmRuntime's name
    settings: dict | None  # the engine's settings under it; None when refused
    cache: Path | None  # its compile cache
    refusal: str | None = None
    # what the arm rounds beyond its dense expansion under it: {"decode", "prefill"}
    numerics: dict | None = None

    @property
    def key(self) -> str:
        return f"{self.pair}{SEPARATOR}{self.name}"


def plan_variants(runs: Any, engine: dict, checkpoint: Path, wanted: str | list[str],
                  flags: set[str], pair: str, cache_root: Path, *,
                  prompt_tokens: int) -> list[Variant]:
    """The variants of ``engine`` (its settings mapping; ``runs``, its Engine) to time for
    ``checkpoint``, the arm of bench pair ``pair``: every one this CPU (``flags``) runs but
    the one the arm scored with when ``wanted`` is "auto", else the ones named; a named one
    this CPU cannot run is refused with the host probe's reason. A dense checkpoint runs
    one way: none. Each timed variant's compile cache is a folder of ``cache_root``, and
    it carries what it rounds for a decode row and a prompt of ``prompt_tokens``."""
    scored = runs.runtime_variant(checkpoint, engine)
    if scored is None:
        return []
    probed = probed_by_name(flags)
    candidates = [r for r in engine_variants(engine["name"]) if r.name != scored]
    if wanted != "auto":
        candidates = [r for r in candidates if r.name in wanted]
    variants = []
    for runtime in candidates:
        if not probed[runtime.name]["available"] and wanted == "auto":
            continue  # not asked for by name: nothing to say
        settings, refusal = settings_under(runs, engine, checkpoint, runtime, probed)
        if refusal:
            variants.append(Variant(pair, runtime.name, None, None, refusal))
            continue
        numerics = {rows: runs.numerics(checkpoint, settings, count)
                    for rows, count in (("decode", 1), ("prefill", prompt_tokens))}
        variants.append(Variant(pair, runtime.name, settings, cache_root / cache_name(runtime.name),
                                numerics=numerics))
    return variants


def probed_by_name(flags: set[str]) -> dict[str, dict]:
    """fourbit.bench.hostprobe.vllm_runtimes of a CPU with ``flags``, by runtime name."""
    return {row["name"]: row for row in vllm_runtimes(flags)}


def cache_name(name: str) -> str:
    """The folder of a variant's compile cache: its graph is not the scored one's."""
    return name.replace(" ", "-")


def by_name(name: str) -> VllmRuntime:
    return next(runtime for runtime in VLLM_RUNTIMES if runtime.name == name)


def settings_under(runs: Any, engine: dict, checkpoint: Path, runtime: VllmRuntime,
                   probed: dict[str, dict]) -> tuple[dict | None, str | None]:
    """``engine``'s settings to run ``checkpoint`` as ``runtime`` (``runs``: its Engine;
    ``probed``: probed_by_name of this CPU), or None and why not: this CPU lacks its flags,
    or the engine would run the checkpoint another way under them."""
    if not probed[runtime.name]["available"]:
        return None, probed[runtime.name]["reason"]
    settings = variant_settings(engine, runtime)
    named = runs.runtime_variant(checkpoint, settings)
    if named != runtime.name:
        return None, f"the engine runs this checkpoint as {named!r} under it"
    return settings, None


def record(chosen: bool, planned: list[Variant], records_by_pair: dict[str, dict]) -> dict:
    """An arm's bench record's "variants": whether its variants were chosen, each timed one
    (what ran, its start, its stats, its ratio to the arm as scored pass by pass, its
    numerics), and the refused ones with the reason: refused here before the job, or an
    engine that failed to start ({"failed": reason} in ``records_by_pair``, the job's
    records by pair name)."""
    ran, refused = [], [{"name": v.name, "reason": v.refusal} for v in planned if v.refusal]
    for variant in planned:
        if variant.settings is None:
            continue
        pair = records_by_pair[variant.key]
        if "failed" in pair:
            refused.append({"name": variant.name, "reason": pair["failed"]})
            continue
        ran.append({"name": variant.name, "settings": variant.settings,
                    "runtime": pair["arm"]["runtime"], "start": pair["arm"]["start"],
                    "memory": pair["arm"]["memory"], "stats": pair["arm"]["stats"],
                    "numerics": variant.numerics, "passes": pair["passes"],
                    "ratio_to_scored": pair["ratio"], "group": pair["group"],
                    "contention": pair["contention"]})
    return {"chosen": chosen, "timed": ran, "refused": refused}
