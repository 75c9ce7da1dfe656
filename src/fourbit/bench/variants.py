"""Which runtime variants the bench times beside the runtime an arm scored with.

A vLLM arm can run several ways on one host (fourbit.bench.hostprobe.VLLM_RUNTIMES: the
engine's dtype and the kernel that runs single rows); the study scores it one way, the
way its engine block says. A user deploying it would pick the fastest way this CPU has,
so the bench also times each other variant of the arm's engine that this host runs
(bench.runtimes), paired pass by pass with the arm as scored, in the same job and rounds.
A variant is the arm's checkpoint under other engine settings: its compiled graph
differs, so it gets a compile cache of its own, and its numerics may differ (bfloat16 or
int8 activations), which its record names; its quality is the scored runtime's within
that numerics' control tolerance, not measured again here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fourbit.bench.hostprobe import VLLM_RUNTIMES, VllmRuntime, vllm_runtimes

# Joins a pair's name and a variant's: "<engine id>/<arm id>@<variant name>".
SEPARATOR = "@"


def engine_variants(engine_name: str) -> list[VllmRuntime]:
    """The variants of an engine: every VLLM_RUNTIMES entry it runs (several only for the
    plugin engine, whose dtype and kernel knob a study may set)."""
    return [runtime for runtime in VLLM_RUNTIMES if runtime.engine == engine_name]


def has_variants(engine_name: str) -> bool:
    return len(engine_variants(engine_name)) > 1


def check_names(names: list[str]) -> None:
    """bench.runtimes.variants names known variants, or a ValueError listing them."""
    known = [runtime.name for runtime in VLLM_RUNTIMES]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"bench.runtimes.variants: unknown variant(s) {unknown}; each is "
                         f"'auto' or a list of names from fourbit.bench.hostprobe: {known}")


def variant_settings(engine: dict, runtime: VllmRuntime) -> dict:
    """The engine's settings (the workflow's mapping, its name included) under ``runtime``:
    its dtype, and for the plugin its kernel knob, overriding the checkpoint's."""
    settings = {**engine, "dtype": runtime.dtype}
    if "quant" in engine:
        settings["quant"] = {**engine["quant"], "kernel": runtime.kernel}
    return settings


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


def plan_variants(engine: dict, scored_variant: str | None, wanted: str | list[str],
                  flags: set[str], pair: str, cache_root: Path) -> list[Variant]:
    """The variants of ``engine`` (its settings mapping) to time for the arm of bench pair
    ``pair``, whose scored runtime is ``scored_variant`` (None: a dense checkpoint, which
    runs one way): every other one this CPU (``flags``) runs when ``wanted`` is "auto",
    else the ones named; a named one this CPU cannot run is listed refused, with the host
    probe's reason. Each timed variant's compile cache is a folder of ``cache_root``."""
    if scored_variant is None:
        return []
    probed = {row["name"]: row for row in vllm_runtimes(flags)}
    candidates = [r for r in engine_variants(engine["name"]) if r.name != scored_variant]
    if wanted != "auto":
        candidates = [r for r in candidates if r.name in wanted]
    variants = []
    for runtime in candidates:
        row = probed[runtime.name]
        if not row["available"]:
            if wanted != "auto":  # asked for by name: say why it did not run
                variants.append(Variant(pair, runtime.name, None, None, row["reason"]))
            continue
        variants.append(Variant(pair, runtime.name, variant_settings(engine, runtime),
                                cache_root / runtime.name.replace(" ", "-")))
    return variants


def record(chosen: bool, planned: list[Variant], timed: dict[str, dict]) -> dict:
    """An arm's bench record's "variants": whether its variants were chosen, each timed one
    (what ran, its start, its stats, its ratio to the arm as scored pass by pass, its
    numerics), and the refused ones with the reason. ``timed``: the job's records by pair
    name."""
    ran = []
    for variant in planned:
        if variant.settings is None:
            continue
        pair = timed[variant.key]
        ran.append({"name": variant.name, "settings": variant.settings,
                    "runtime": pair["arm"]["runtime"], "start": pair["arm"]["start"],
                    "memory": pair["arm"]["memory"], "stats": pair["arm"]["stats"],
                    "numerics": variant.numerics, "passes": pair["passes"],
                    "ratio_to_scored": pair["ratio"], "group": pair["group"],
                    "contention": pair["contention"]})
    return {"chosen": chosen, "timed": ran,
            "refused": [{"name": v.name, "reason": v.refusal} for v in planned if v.refusal]}
