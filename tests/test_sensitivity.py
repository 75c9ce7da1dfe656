"""mixed_precision (fourbit.quantizers.sensitivity): sets of matrices moved to 8 bits by measured
sensitivity, within the bit budget, on a tiny real checkpoint."""

import pytest
import torch

from fourbit.checkpoints.hf import TensorReader, load_tensors, read_config, write_checkpoint
from fourbit.checkpoints.quantized import read_quantized
from fourbit.engines import reference
from fourbit.quantizers.methods import QuantizeJob, calibration_tokens
from fourbit.quant.int8 import Int8Weight, quantize_int8
from fourbit.quantizers.sensitivity import Candidate, allocate
from fourbit.quantizers.shapes import shared_pass_quant
from fourbit.steps.quantize import dequantize_checkpoint, measure_sensitivity, quantize_checkpoint
from test_quantize import SETTINGS, arm, assert_reference_scores_like_its_control, calibrated  # noqa: F401  (a fixture)


def shared_pass(model, text, folder, quant, pass_id="sensitivity-0000000000"):
    """The sensitivity rule's outputs for the mixed_precision ``quant``, in ``folder``."""
    checkpoint, record = folder / "four_bit", folder / "sensitivity.json"
    measure_sensitivity(model, checkpoint, record, {"id": pass_id, "quant": shared_pass_quant(quant)},
                        calibration_text=text)
    return checkpoint, record


def test_allocation_takes_most_kl_per_bit_first_and_skips_what_no_longer_fits():
    a, b = Candidate(("a",), 10.0, 100), Candidate(("b",), 1.0, 5)  # 0.1 and 0.2 per bit
    c, free = Candidate(("c",), 3.0, 50), Candidate(("d",), 0.0, 1)  # 0.06; a set 4 bits do not hurt
    assert allocate([a, b, c, free], 110) == [b, a]  # c no longer fits; d changes nothing
    assert allocate([a, b, c, free], 60) == [b, c]  # a does not fit, the next one is tried
    assert allocate([a, b, c], 4) == []
    # by KL per bit alone b would go first and leave a out; a alone removes more
    assert allocate([a, b, c], 100) == [a]


@pytest.mark.parametrize("quant", [
    {"method": "rtn", "group_size": 64, "sym": True},  # plain rounding: only the held-out windows
    {"method": "gptq", "group_size": 64, "sym": False},
    {"method": "rtn", "group_size": 64, "sym": False, "quantize_embedding": True},  # the table too
])
def test_mixed_precision_moves_the_most_sensitive_sets_within_the_budget(calibrated, tmp_path, quant):  # noqa: F811
    """Each set's KL is the one an independent path measures (the reference engine's exact
    fidelity KL of a checkpoint with only that set at 4 bits), the moved sets are the best
    per bit that fit, they hold the 8-bit rounding of the unquantized weights and the rest
    the arm's 4-bit weights, the file spends what the manifest says, and the dense control
    and the reference engine read the same W_hat."""
    model, text = calibrated
    calibration = {"seq_len": 64, "heldout": 3, **({"samples": 6} if quant["method"] == "gptq" else {})}
    base = arm(**quant, **({"calibration": calibration} if "samples" in calibration else {}))
    mixed = arm(**quant, calibration=calibration, mixed_precision={"extra_bits": 0.6, "windows": 2})
    four = quantize_checkpoint(model, tmp_path / "q4", tmp_path / "arm4.json", base, calibration_text=text)
    pass_outputs = shared_pass(model, text, tmp_path / "pass", mixed["quant"])
    manifest = quantize_checkpoint(model, tmp_path / "q", tmp_path / "arm.json", mixed, shared_pass=pass_outputs)
    facts = manifest["method_facts"]["mixed_precision"]
    assert facts["shared_pass"]["id"] == "sensitivity-0000000000" and facts["windows"] == 2
    # the method's own facts come through the pass (gptq's act-order, say)
    assert manifest["method_facts"]["algorithm"] == four["method_facts"]["algorithm"]
    sets = facts["sets"]
    # every 4-bit matrix of the plain arm is in exactly one set: 2 layers x 4 sets + the head
    # (+ the embedding table, a set of its own)
    assert sorted(n for s in sets for n in s["members"]) == sorted(four["quantized_modules"])
    table = "quantize_embedding" in quant
    assert len(sets) == 9 + table
    assert (["model.embed_tokens"] in [s["members"] for s in sets]) == table

    # the KL of two sets, measured independently on the same held-out windows
    job = QuantizeJob(model, {}, mixed["quant"], text, 1)
    windows = calibration_tokens(job, 3)[-3:][:2].tolist()
    _, _, four_bit = read_quantized(tmp_path / "q4")
    source = load_tensors(model)
    # layer 0's q/k/v, the head, and the table if there is one
    for s in [sets[i] for i in sorted({0, len(sets) - 1 - table, len(sets) - 1})]:
        tensors = dict(source)
        for name in s["members"]:
            tensors[f"{name}.weight"] = four_bit[name].dequantize(torch.float32)
        folder = tmp_path / f"only-{s['members'][0]}"
        folder.mkdir()
        write_checkpoint(folder, tensors, read_config(model), copy_from=model)
        compared = reference.compare_with_baseline(folder, model, windows, SETTINGS, 1,
                                                   prompts=[windows[0][:4]], new_tokens=1)
        positions = sum(len(w) for w in compared["window_kl"])
        kl = sum(x for w in compared["window_kl"] for x in w) / positions
        assert kl == pytest.approx(s["kl"], rel=1e-3, abs=1e-9), s["members"]

    # the budget holds, counted from the file; no set left out would still fit, and the sets
    # moved remove at least the KL of any one set that fits
    moved = [s for s in sets if s["eight_bit"]]
    assert moved and len(moved) < len(sets)
    extra = manifest["storage"]["quantized_bits_per_weight"] - four["storage"]["quantized_bits_per_weight"]
    assert extra == pytest.approx(facts["extra_bits_spent"], rel=1e-9) and extra <= 0.6
    for s in sets:
        if not s["eight_bit"]:
            assert facts["extra_bits_spent"] + s["extra_bits_per_weight"] > 0.6, s["members"]
    fitting = [s["kl"] for s in sets if s["extra_bits_per_weight"] <= 0.6]
    assert sum(s["kl"] for s in moved) >= max(fitting)

    moved_table = "model.embed_tokens" in facts["eight_bit"]
    assert manifest["method_facts"]["embedding"] == (
        "rtn, 8 bits (mixed precision)" if moved_table else "rtn" if table else "dense")
    _, _, stored = read_quantized(tmp_path / "q")
    reader = TensorReader(model)
    for name, weight in stored.items():
        if name in facts["eight_bit"]:
            assert isinstance(weight, Int8Weight) and weight.equal(quantize_int8(reader.get(f"{name}.weight"), 64))
        else:
            assert weight.equal(four_bit[name]), name
    dequantize_checkpoint(tmp_path / "q", tmp_path / "d")
    assert_reference_scores_like_its_control(tmp_path / "q", tmp_path / "d")


def test_arms_that_differ_only_in_their_budget_spend_it_on_one_shared_pass(calibrated, tmp_path):  # noqa: F811
    """Two budgets from one pass: the same measured sets, the pass's 4-bit weights kept
    where nothing moved, each within its budget, the larger removing at least as much KL;
    a pass of another quant, or none, is refused before anything is written."""
    model, text = calibrated
    calibration = {"seq_len": 64, "heldout": 3}
    quant = {"method": "rtn", "group_size": 64, "sym": True, "calibration": calibration}
    small, large = (arm(**quant, mixed_precision={"extra_bits": bits, "windows": 2}) for bits in (0.3, 0.9))
    outputs = shared_pass(model, text, tmp_path / "pass", small["quant"])
    _, _, four_bit = read_quantized(outputs[0])
    facts = {}
    for name, each in (("small", small), ("large", large)):
        manifest = quantize_checkpoint(model, tmp_path / name, tmp_path / f"{name}.json", each, shared_pass=outputs)
        facts[name] = manifest["method_facts"]["mixed_precision"]
        _, _, stored = read_quantized(tmp_path / name)
        for module, weight in stored.items():
            if module not in facts[name]["eight_bit"]:
                assert weight.equal(four_bit[module]), module
        assert 0 < facts[name]["extra_bits_spent"] <= each["quant"]["mixed_precision"]["extra_bits"]
    assert [(s["members"], s["kl"]) for s in facts["small"]["sets"]] == [
        (s["members"], s["kl"]) for s in facts["large"]["sets"]]
    assert len(facts["small"]["eight_bit"]) < len(facts["large"]["eight_bit"])
    removed = {name: sum(s["kl"] for s in f["sets"] if s["eight_bit"]) for name, f in facts.items()}
    assert removed["small"] < removed["large"]

    other = arm(**{**quant, "group_size": 128}, mixed_precision={"extra_bits": 0.3, "windows": 2})
    with pytest.raises(ValueError, match="not of this arm's"):
        quantize_checkpoint(model, tmp_path / "other", tmp_path / "other.json", other, shared_pass=outputs)
    with pytest.raises(ValueError, match="starts from its sensitivity job's pass"):
        quantize_checkpoint(model, tmp_path / "none", tmp_path / "none.json", small)
    assert not (tmp_path / "other").exists() and not (tmp_path / "none").exists()
