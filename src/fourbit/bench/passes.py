"""The pass discipline: paired, order-rotated, gated passes in rounds, reported with their spread.

Whatever the engine, an arm is only compared with its baseline timed in the
same conditions: each pass runs both, alternating which goes first (A B, B A,
A B, ...) so that drift (thermal, a neighbour's job ramping up) does not always
favour the same one. Every pass is preceded by ``before_pass`` (the contention
gate and residency check), and its record is kept; then the two sides run back
to back, because a shared host's speed moves over seconds and only runs close in
time see the same host (a gate's half-second wait before each side instead widens the
spread of the pass-by-pass ratio: benchmarks/bench_aa.py; docs/measurement.md).

The pairs of a study run in rounds: round r gives every pair its pass r, in an
order rotated by one each round. The host's speed also drifts over minutes (identical
bench jobs a minute apart give other medians); an arm whose passes all ran in one
minute carries that minute's speed in its tok/s, and a repeat of the bench step lands
elsewhere. Interleaved, every arm's passes span the whole step and every arm sees the
same host, so absolute tok/s are comparable across arms and engines, and repeatable.
At least three passes: one pass is an anecdote, and with fewer than three the spread
says nothing about the noise.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, TypeVar

MIN_PASSES = 3
TG128_OUTPUT_TOKENS = 129  # 1 from the prompt's prefill + 128 decode steps; see tg_from_runs
# A timed quantity within a pass is repeated until it has run this long. A small
# model's 512-token prefill can take ~30 ms, and one such run moves by up to a third
# with whatever the host did in those milliseconds; llama-bench repeats each test
# a set number of times (-r) for the same reason. A tg128 run, or a big model's
# prefill, exceeds it once and is not repeated.
MIN_TIMED_SECONDS = 0.25

Run = Callable[[], dict]
Sample = TypeVar("Sample")


def run_rounds(
    pairs: dict[str, tuple[Run, Run]], *, passes: int, warmup: int,
    before_pass: Callable[[str, int], dict], clock: Callable[[], float] = time.monotonic,
) -> dict[str, dict]:
    """Time each pair's arm against its baseline, ``passes`` rounds of every pair.

    ``pairs``: name -> (arm, baseline); a baseline may be shared by several pairs.
    Each callable returns metrics where higher is better (e.g. {"pp512_tok_s": ..,
    "tg128_tok_s": ..}); the ratio is arm / baseline, so above 1 means the arm is
    faster. ``warmup`` untimed runs of both sides of every pair come first.
    ``before_pass(name, number)`` runs before pair ``name``'s pass ``number`` (1-based).
    Returns per pair: its passes (each with its round slot and its start in seconds
    after the first timed pass), and min/median/max of each side and of the ratio.
    """
    if passes < MIN_PASSES:
        raise ValueError(
            f"passes={passes}: a single pass is never a result; ask for at least {MIN_PASSES} "
            "so the spread across passes shows how noisy the host is"
        )
    if warmup < 1:
        raise ValueError(
            f"warmup={warmup}: the first run pays for compilation and cold caches; "
            "ask for at least 1 untimed round"
        )
    if not pairs:
        raise ValueError("no pairs to time; give at least one (arm, baseline)")
    for arm, baseline in pairs.values():
        for _ in range(warmup):
            arm()
            baseline()

    names = list(pairs)
    records: dict[str, list[dict]] = {name: [] for name in names}
    start = clock()
    for number in range(1, passes + 1):
        shift = (number - 1) % len(names)
        for slot, name in enumerate(names[shift:] + names[:shift], start=1):
            records[name].append(
                _one_pass(name, pairs[name], number, before_pass, slot, clock() - start))
    return {
        name: {
            "passes": passes,
            "warmup": warmup,
            "runs": runs,
            **{side: _summaries(runs, side) for side in ("arm", "baseline", "ratio")},
        }
        for name, runs in records.items()
    }


def _one_pass(name: str, pair: tuple[Run, Run], number: int,
              before_pass: Callable[[str, int], dict], slot: int, started_s: float) -> dict:
    """Pass ``number`` of one pair: the gate, then both sides back to back."""
    sides = dict(zip(("arm", "baseline"), pair))
    order = ["arm", "baseline"] if number % 2 else ["baseline", "arm"]
    record = {"pass": number, "slot": slot, "started_s": started_s, "order": order,
              "checks": before_pass(name, number)}
    for side in order:
        record[side] = _metrics(sides[side](), f"{name} {side}", number)
    if record["arm"].keys() != record["baseline"].keys():
        raise ValueError(
            f"pass {number} of {name}: arm returned {sorted(record['arm'])} but baseline "
            f"returned {sorted(record['baseline'])}; both must report the same metrics"
        )
    record["ratio"] = {key: record["arm"][key] / record["baseline"][key] for key in record["arm"]}
    return record


def _metrics(values: dict, name: str, number: int) -> dict:
    if not values:
        raise ValueError(
            f"pass {number}: {name} returned no metrics; return e.g. {{'tg128_tok_s': 12.3}}"
        )
    for key, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(
                f"pass {number}: {name} reported {key}={value!r}; metrics must be positive finite rates"
            )
    return dict(values)


def _summaries(records: list[dict], side: str) -> dict:
    for record in records[1:]:
        if record[side].keys() != records[0][side].keys():
            raise ValueError(
                f"pass {record['pass']} reported {sorted(record[side])}, pass 1 reported "
                f"{sorted(records[0][side])}; every pass must report the same metrics"
            )
    return {key: summarize([r[side][key] for r in records]) for key in records[0][side]}


def summarize(values: list[float]) -> dict:
    """min, median, max, and spread = (max - min) / median, with the values themselves."""
    median = statistics.median(values)
    low, high = min(values), max(values)
    return {
        "values": list(values), "min": low, "median": median, "max": high,
        "spread": (high - low) / median,
    }


def repeat_for(run: Callable[[], Sample], seconds: Callable[[Sample], float],
               min_seconds: float = MIN_TIMED_SECONDS) -> list[Sample]:
    """``run()``'s samples, at least one, taken until ``seconds`` of them add up to
    ``min_seconds``; the caller turns their sum into one rate for the pass."""
    samples = [run()]
    while sum(map(seconds, samples)) < min_seconds:
        samples.append(run())
    return samples


def pass_rates(prompt_tokens: int, decode_tokens: int, prefill_s: list[float],
               decode_pairs_s: list[tuple[float, float]]) -> dict[str, float]:
    """One pass's pp and tg rates from its repeated timed runs.

    ``prefill_s``: seconds of each ``prompt_tokens`` prefill; ``decode_pairs_s``: seconds
    of each (1-token, decode_tokens + 1-token) generation pair (see tg_from_runs). The
    rates are over the mean times: tokens of all runs over their total time.
    """
    one_token = statistics.mean(one for one, _ in decode_pairs_s)
    n_tokens = statistics.mean(n for _, n in decode_pairs_s)
    return {
        f"pp{prompt_tokens}_tok_s": prompt_tokens / statistics.mean(prefill_s),
        f"tg{decode_tokens}_tok_s": tg_from_runs(one_token, n_tokens, decode_tokens + 1),
    }


def tg_from_runs(t_one_token_s: float, t_n_tokens_s: float, n: int) -> float:
    """Decode tokens/s from two timed generations, as llama-bench's tg counts it.

    llama-bench's tg128 times 128 forward passes of one token each. An engine's
    generate() from a 1-token prompt spends one prefill forward on the prompt
    (which yields output token 1) and one decode step per further output token.
    So with

        t_one_token_s = time(prompt of 1 token -> 1 output token)
        t_n_tokens_s  = time(prompt of 1 token -> n output tokens)

    the difference is exactly n - 1 single-token decode steps, the prefill and the
    fixed per-request cost cancelling out, and the rate is (n - 1) / (t_n - t_1).
    For tg128 pass n = TG128_OUTPUT_TOKENS (129), which gives 128 decode steps.
    Both runs must really produce their n tokens: turn off stopping at EOS
    (e.g. vLLM's ignore_eos=True), or an early stop inflates the rate.
    """
    if n < 2:
        raise ValueError(f"n={n}: need at least 2 output tokens for one decode step (129 for tg128)")
    if not 0 < t_one_token_s < t_n_tokens_s:
        raise ValueError(
            f"t_n_tokens_s ({t_n_tokens_s} s) must exceed t_one_token_s ({t_one_token_s} s) > 0: "
            "the runs were too noisy to subtract or the n-token run stopped early (ignore EOS)"
        )
    return (n - 1) / (t_n_tokens_s - t_one_token_s)
