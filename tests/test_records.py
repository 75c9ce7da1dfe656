"""fourbit.records: each kind of result record checked against its one schema."""

import pytest

from fourbit import records

PPL = {"definition": "d", "runtime": "r", "numerics": "exact", "ppl": 2.7, "mean_nll": 1.0, "tokens": 4,
       "window_nll_sum": [2.0, 2.0], "window_tokens": [2, 2], "token_ids_sha256": "cd" * 32,
       "model_weights_sha256": "ab" * 32}


def test_a_complete_record_is_written(tmp_path):
    records.write("ppl", tmp_path / "x.ppl.json", PPL)
    assert (tmp_path / "x.ppl.json").is_file()


@pytest.mark.parametrize("field", ["runtime", "window_tokens", "model_weights_sha256"])
def test_a_record_missing_what_readers_need_is_not_written(tmp_path, field):
    incomplete = {k: v for k, v in PPL.items() if k != field}
    with pytest.raises(records.RecordError, match=rf"x.ppl.json: not a valid ppl record .*'{field}'"):
        records.write("ppl", tmp_path / "x.ppl.json", incomplete)
    assert list(tmp_path.iterdir()) == []  # nothing half-written either


def test_each_outcome_of_fidelity_and_bench_has_its_own_fields():
    weights = {"model_weights_sha256": "ab" * 32}
    records.check("fidelity", {"computed": False, "reason": "no logits", **weights}, "f")
    with pytest.raises(records.RecordError, match="'kl_mean' is a required property"):
        records.check("fidelity", {"computed": True, "definition": "d", "method": "m", "bound": "exact",
                                   "kl_p99": 0.1, "top1_agreement": 0.9,
                                   "greedy": {"identical": 1, "prompts": 2}, **weights}, "f")
    with pytest.raises(records.RecordError, match="'reason' is a required property"):
        records.check("bench", {"measured": False, **weights}, "b")


def test_a_kl_that_is_not_exact_is_refused():
    """Every engine's KL is exact, and the report reads it as such: a record of vLLM's old
    top-k lower bound is named for remaking, not ranked as if exact."""
    computed = {"computed": True, "definition": "d", "kl_mean": 0.01, "kl_p99": 0.1,
                "top1_agreement": 0.9, "greedy": {"identical": 1, "prompts": 2},
                "model_weights_sha256": "ab" * 32}
    records.check("fidelity", {**computed, "method": "full logits", "bound": "exact"}, "f")
    with pytest.raises(records.RecordError, match=r"f: not a valid fidelity record \(bound: "
                                                  r"'exact' was expected\)"):
        records.check("fidelity", {**computed, "method": "full logits", "bound": "lower bound"}, "f")
    with pytest.raises(records.RecordError, match=r"f: not a valid fidelity record \(method: "
                                                  r"'full logits' was expected\)"):
        records.check("fidelity", {**computed, "method": "llama-perplexity KL mode",
                                   "bound": "exact"}, "f")


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown record kind 'pp'; the kinds are ppl, fidelity"):
        records.check("pp", {}, "x")
