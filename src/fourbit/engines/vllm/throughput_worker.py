"""One vLLM engine held open for a whole bench job, in a process of its own.

Started by fourbit.engines.vllm.throughput.throughput_session; not meant to be run by hand.
A bench job interleaves every arm and its baseline, pass after pass. Restarting
an engine for every pass would spend most of the job on engine starts; two engines
cannot be open side by side in one process, because vLLM's in-process engines
share global state (the distributed groups, the frozen environment). So each
checkpoint runs in its own worker, which idles while the others are timed.

Protocol (one JSON object per line):

    argv[1]   {"checkpoint", "settings" (a VllmSettings' fields), "threads",
               "prompt_tokens", "decode_tokens"}
    out       {"ready": {"mode", "engine_init_s", "compile_s", "first_run_s"},
               "peak_rss_bytes": ..} once the engine is open and warmed up; "ready" holds
               what its untimed start cost (throughput.bench_engine's ``start``)
    in        "pass"  ->  out {"rates": {"pp512_tok_s": .., "tg128_tok_s": ..},
                               "cpu_rates": the same over the worker's CPU time,
                               "peak_rss_bytes": ..}

peak_rss_bytes is the process's largest resident set so far (VmHWM), which the job
records beside its estimate (fourbit.bench.memory_groups.held_open_bytes).
    in        end of input: close the engine and exit 0
    out       {"error": "<traceback>"} on any failure, then exit 1

The protocol stream is the process's original stdout, moved to a descriptor of its
own before vLLM or torch is imported; their output goes to stderr. The job stops the
worker between passes (SIGSTOP, see throughput_session); so that a job killed
meanwhile leaves no stopped worker holding its memory, the worker asks the kernel to
kill it when the job's process ends (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import traceback

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def main() -> int:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever writes to stdout from here on lands in stderr

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")

    try:
        request = json.loads(sys.argv[1])
        from fourbit.engines.vllm.throughput import bench_engine
        from fourbit.engines.vllm.settings import VllmSettings

        start: dict = {}
        with bench_engine(
            request["checkpoint"], VllmSettings(**request["settings"]), request["threads"],
            prompt_tokens=request["prompt_tokens"], decode_tokens=request["decode_tokens"],
            start=start,
        ) as one_pass:
            send({"ready": start, "peak_rss_bytes": peak_rss_bytes()})
            for line in sys.stdin:
                if line.strip() != "pass":
                    raise ValueError(f"unknown command {line.strip()!r}; the worker knows 'pass'")
                wall, cpu = one_pass()
                send({"rates": wall, "cpu_rates": cpu, "peak_rss_bytes": peak_rss_bytes()})
    except BaseException:  # noqa: BLE001 (every failure must reach the job as its error line)
        send({"error": traceback.format_exc()})
        return 1
    return 0


def peak_rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


if __name__ == "__main__":
    sys.exit(main())
