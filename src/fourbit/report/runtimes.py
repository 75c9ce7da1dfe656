"""The report's lines on what ran: each row's runtime as scored and, where the bench ran
it otherwise, as timed (vLLM timed compiled after scoring eager); and what compiling
cost the bench's engine starts."""

from __future__ import annotations


def runtime_line(row: dict) -> str:
    """What scored the row and, where the bench ran it otherwise, what was timed and how
    long compiling took at its untimed start."""
    line = f"- `{row['arm_id']}` on {row['engine']}: {row['runtime']}"
    timed = row.get("timed_runtime")
    if timed is None or timed == row["runtime"]:
        return line + (" (scored and timed)" if timed else "")
    compiled = (f"; compiling took {row['compile_s']:.1f} s of its untimed start"
                if row.get("compile_s") else "")
    return f"{line} (scored); timed: {timed}{compiled}"


def compile_note(benches: dict[str, list[dict]]) -> list[str]:
    """How the engines that compile were timed, and what compiling cost their starts: a
    paragraph of its own, or nothing when no engine was held open for the job."""
    starts = {}  # one per checkpoint opened: each arm, and each engine's baseline once
    for engine_id, records in benches.items():
        for b in records:
            if b.get("measured"):
                for side in ("arm", "baseline"):
                    starts[(engine_id, b[side].get("checkpoint"))] = b[side].get("start")
    compiled = [s for s in starts.values() if s and s["mode"] == "compiled"]
    eager = [s for s in starts.values() if s and s["mode"] == "eager"]
    lines = []
    if compiled:
        seconds = [s["compile_s"] for s in compiled]
        # The engines of a group start side by side, so their compile times overlap: the
        # longest start, not the sum, is what the job waited.
        lines.append(
            f"{len(compiled)} vLLM engine(s) were timed compiled, as vLLM runs by default "
            "(bench.vllm_compiled; what scored is under Runtimes). Compiling took "
            f"{min(seconds):.1f}-{max(seconds):.1f} s of each engine's start (the engines "
            "start side by side; the longest start took "
            f"{max(s['engine_init_s'] for s in compiled):.1f} s), which no timed pass includes."
        )
    if eager:
        lines.append(f"{len(eager)} vLLM engine(s) were timed eager (bench.vllm_compiled: false).")
    return ["", " ".join(lines)] if lines else []


def runtime_candidates(provenance: dict, benches: dict[str, list[dict]]) -> list[str]:
    """The host's vLLM runtime candidates (the bench's provenance: fourbit.bench.hostprobe's
    vllm_runtimes), each marked timed in this study, runnable here but not in it, or refused
    here with the reason; nothing for a record from before the candidates were recorded."""
    table = provenance.get("vllm_runtimes")
    if not table:
        return []
    timed = {b[side].get("variant") for records in benches.values() for b in records
             if b.get("measured") for side in ("arm", "baseline")}

    def named(r: dict) -> str:
        return f"`{r['name']}`" + (" (AMX)" if r["amx"] else "")

    ran = [named(r) for r in table if r["name"] in timed]
    idle = [named(r) for r in table if r["available"] and r["name"] not in timed]
    refused = [f"`{r['name']}` ({r['reason']})" for r in table if not r["available"]]
    return [f"- vLLM 4-bit runtimes this host was probed for (fourbit.bench.hostprobe): timed in "
            f"this study: {', '.join(ran) or 'none'}; runnable here, not in this study: "
            f"{', '.join(idle) or 'none'}; refused here: {'; '.join(refused) or 'none'}"]
