"""The pass discipline with fake engines: rounds, rotation, gating, ratios, stats, refusals."""

from __future__ import annotations

import pytest

from fourbit.bench.passes import (
    TG128_OUTPUT_TOKENS,
    pass_rates,
    repeat_for,
    run_rounds,
    summarize,
    tg_from_runs,
)


class Recorder:
    """Fake arm, baseline and gate that log every call in order."""

    def __init__(self, arm_values, baseline_values):
        self.log = []
        self.arm_values, self.baseline_values = iter(arm_values), iter(baseline_values)

    def arm(self):
        self.log.append("arm")
        return next(self.arm_values)

    def baseline(self):
        self.log.append("baseline")
        return next(self.baseline_values)

    def gate(self, name, number):
        self.log.append(f"gate {number}")
        return {"busy": {0: 0.01}, "pass": number}

    def run(self, passes=3, warmup=1):
        """One pair, ``p``: its result."""
        return run_rounds({"p": (self.arm, self.baseline)}, passes=passes, warmup=warmup,
                          before_pass=self.gate)["p"]


def rates(*pairs):
    return [{"pp512_tok_s": pp, "tg128_tok_s": tg} for pp, tg in pairs]


WARMUP = rates((1, 1))
ARM = WARMUP + rates((200, 20), (220, 22), (180, 18))
BASELINE = WARMUP + rates((100, 10), (100, 10), (100, 12))


def test_warmup_then_passes_alternate_order_with_a_gate_before_every_pass():
    fake = Recorder(ARM, BASELINE)
    result = fake.run()
    assert fake.log == [
        "arm", "baseline",  # warm-up: untimed and ungated
        "gate 1", "arm", "baseline",  # the two sides back to back: paired in time
        "gate 2", "baseline", "arm",
        "gate 3", "arm", "baseline",
    ]
    assert [run["order"] for run in result["runs"]] == [
        ["arm", "baseline"], ["baseline", "arm"], ["arm", "baseline"],
    ]
    assert result["runs"][1]["checks"] == {"busy": {0: 0.01}, "pass": 2}


def test_per_pass_ratios_and_their_statistics():
    fake = Recorder(ARM, BASELINE)
    result = fake.run()
    assert [run["ratio"] for run in result["runs"]] == rates((2.0, 2.0), (2.2, 2.2), (1.8, 1.5))
    assert result["passes"] == 3 and result["warmup"] == 1
    assert result["arm"]["pp512_tok_s"] == {
        "values": [200, 220, 180], "min": 180, "median": 200, "max": 220, "spread": 0.2,
    }
    assert result["baseline"]["tg128_tok_s"]["values"] == [10, 10, 12]
    tg_ratio = result["ratio"]["tg128_tok_s"]
    assert tg_ratio["min"] == pytest.approx(1.5)
    assert tg_ratio["median"] == pytest.approx(2.0)
    assert tg_ratio["spread"] == pytest.approx((2.2 - 1.5) / 2.0)


def test_pairs_run_in_rounds_rotated_so_each_spans_the_whole_step():
    log = []

    def side(name):
        def run():
            log.append(name)
            return {"tg128_tok_s": 1.0}
        return run

    shared = side("B")  # one baseline, as an engine's arms share theirs
    pairs = {name: (side(name), shared) for name in ("x", "y", "z")}
    ticks = iter(range(100))
    results = run_rounds(pairs, passes=3, warmup=1, before_pass=lambda name, n: {"gate": n},
                         clock=lambda: next(ticks))
    timed = log[6:]  # after each pair's warm-up of both sides
    assert timed == ["x", "B", "y", "B", "z", "B",  # round 1: pass 1 of each, arm first
                     "B", "y", "B", "z", "B", "x",  # round 2: rotated by one, baseline first
                     "z", "B", "x", "B", "y", "B"]  # round 3: rotated by two
    assert [r["slot"] for r in results["x"]["runs"]] == [1, 3, 2]
    started = [r["started_s"] for r in results["x"]["runs"]]
    assert started == sorted(started) and started[-1] - started[0] >= 6  # spans the rounds
    assert {name: len(result["runs"]) for name, result in results.items()} == {
        "x": 3, "y": 3, "z": 3}


def test_no_pairs_is_refused():
    with pytest.raises(ValueError, match="no pairs to time"):
        run_rounds({}, passes=3, warmup=1, before_pass=lambda name, n: {})


def test_summarize_even_count_uses_the_middle_pair():
    assert summarize([1.0, 3.0, 2.0, 4.0])["median"] == 2.5


@pytest.mark.parametrize("passes", [1, 2])
def test_fewer_than_three_passes_are_refused(passes):
    fake = Recorder(ARM, BASELINE)
    with pytest.raises(ValueError, match=f"passes={passes}: a single pass is never a result"):
        fake.run(passes=passes)
    assert fake.log == []  # refused before anything ran


def test_no_warmup_is_refused():
    fake = Recorder(ARM, BASELINE)
    with pytest.raises(ValueError, match="warmup=0: the first run pays for compilation"):
        fake.run(warmup=0)


def test_arm_and_baseline_must_report_the_same_metrics():
    baseline = WARMUP + [{"pp512_tok_s": 100}] * 3
    fake = Recorder(ARM, baseline)
    with pytest.raises(ValueError, match=r"pass 1 of p: arm returned \['pp512_tok_s', 'tg128_tok_s'\] but baseline"):
        fake.run()


def test_a_zero_rate_is_refused_naming_pass_and_metric():
    arm = WARMUP + rates((200, 20), (0, 22), (180, 18))
    fake = Recorder(arm, BASELINE)
    with pytest.raises(ValueError, match="pass 2: p arm reported pp512_tok_s=0"):
        fake.run()


def test_tg128_counts_the_128_decode_steps_between_a_1_and_a_129_token_generation():
    # 0.1 s for prefill + first token, then 128 steps of 10 ms.
    assert tg_from_runs(0.1, 0.1 + 128 * 0.01, TG128_OUTPUT_TOKENS) == pytest.approx(100.0)
    assert tg_from_runs(1.0, 2.0, 2) == pytest.approx(1.0)


def test_tg_refuses_impossible_timings():
    with pytest.raises(ValueError, match="n=1: need at least 2 output tokens"):
        tg_from_runs(0.1, 0.2, 1)
    with pytest.raises(ValueError, match=r"t_n_tokens_s \(0.05 s\) must exceed t_one_token_s \(0.1 s\)"):
        tg_from_runs(0.1, 0.05, 129)


def test_repeat_for_runs_until_the_samples_add_up_to_the_minimum():
    durations = iter([0.1, 0.1, 0.04, 0.5, 0.5])  # 0.24 s after three runs: one more
    samples = repeat_for(lambda: next(durations), lambda seconds: seconds, min_seconds=0.25)
    assert samples == [0.1, 0.1, 0.04, 0.5]


def test_repeat_for_runs_once_when_one_run_is_long_enough():
    durations = iter([3.0, 3.0])
    assert repeat_for(lambda: next(durations), lambda seconds: seconds, min_seconds=0.25) == [3.0]


def test_pass_rates_are_tokens_over_the_mean_times_of_repeated_runs():
    # Prefills of 512 tokens: 40 and 60 ms -> mean 50 ms. Decode pairs: 10 ms for the
    # 1-token run and 1.29 s / 1.31 s for 129 tokens -> 128 steps in 1.29 s on average.
    rates = pass_rates(512, 128, [0.04, 0.06], [(0.01, 1.29), (0.01, 1.31)])
    assert rates == {"pp512_tok_s": pytest.approx(512 / 0.05),
                     "tg128_tok_s": pytest.approx(128 / 1.29)}
