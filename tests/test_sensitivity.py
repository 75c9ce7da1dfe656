"""mixed_precision (fourbit.quantizers.sensitivity): sets of matrices moved to wider grids (8
bits, or 5 and 6) by measured sensitivity, within the bit budget, on a tiny real checkpoint."""

import pytest
import torch

from fourbit.checkpoints.hf import TensorReader, load_tensors, read_config, write_checkpoint
from fourbit.checkpoints.quantized import read_quantized
from fourbit.engines import reference
from fourbit.quantizers.methods import QuantizeJob, calibration_tokens
from fourbit.quant.int8 import Int8Weight, quantize_int8
from fourbit.quantizers.sensitivity import Candidate, Wider, allocate
from fourbit.quantizers.shapes import shared_pass_quant
from fourbit.steps.quantize import dequantize_checkpoint, measure_sensitivity, quantize_checkpoint
from test_quantize import SETTINGS, arm, assert_reference_scores_like_its_control, calibrated  # noqa: F401  (a fixture)


def shared_pass(model, text, folder, quant, pass_id="sensitivity-0000000000"):
    """The sensitivity rule's outputs for the mixed_precision ``quant``, in ``folder``."""
    checkpoint, record = folder / "four_bit", folder / "sensitivity.json"
    measure_sensitivity(model, checkpoint, record, {"id": pass_id, "quant": shared_pass_quant(quant)},
                        calibration_text=text)
    return checkpoint, record


def eight_bit_only(name, kl, extra_bits):
    return Candidate((name,), kl, (Wider(8, 0.0, extra_bits),))


def test_allocation_leaves_the_least_kl_that_fits_the_budget():
    a, b = eight_bit_only("a", 10.0, 100), eight_bit_only("b", 1.0, 5)  # 0.1 and 0.2 per bit
    c, free = eight_bit_only("c", 3.0, 50), eight_bit_only("d", 0.0, 1)  # 0.06; a set 4 bits do not hurt
    assert allocate([a, b, c, free], 110) == [8, 8, 4, 4]  # c no longer fits; d changes nothing
    assert allocate([a, b, c, free], 60) == [4, 8, 8, 4]  # a does not fit, the next ones do
    assert allocate([a, b, c], 4) == [4, 4, 4]
    # by KL per bit alone b would go first and leave a out; a alone removes more
    assert allocate([a, b, c], 100) == [8, 4, 4]


def test_allocation_chooses_among_the_grids_of_each_set():
    """6 bits leave a little for half the cost of 8: two sets at 6 beat one at 8, and a
    larger budget moves the set with more left at 6 on to 8."""
    a = Candidate(("a",), 10.0, (Wider(6, 1.0, 50), Wider(8, 0.0, 100)))
    b = Candidate(("b",), 5.0, (Wider(6, 0.5, 50), Wider(8, 0.0, 100)))
    assert allocate([a, b], 49) == [4, 4]
    assert allocate([a, b], 99) == [6, 4]
    assert allocate([a, b], 100) == [6, 6]  # 1.5 left, against 5 with a at 8
    assert allocate([a, b], 150) == [8, 6]  # 0.5 left, against 1.0 with b at 8
    assert allocate([a, b], 200) == [8, 8]


@pytest.mark.parametrize("quant, grids", [
    ({"method": "rtn", "group_size": 64, "sym": True}, [8]),  # plain rounding: only the held-out windows
    ({"method": "gptq", "group_size": 64, "sym": False}, [8]),
    ({"method": "rtn", "group_size": 64, "sym": False, "quantize_embedding": True}, [8]),  # the table too
    ({"method": "rtn", "group_size": 64, "sym": False, "quantize_embedding": True}, [5, 6, 8]),
])
def test_mixed_precision_moves_the_most_sensitive_sets_within_the_budget(calibrated, tmp_path, quant, grids):  # noqa: F811
    """Each set's KL at 4 bits and on each grid below 8 is the one an independent path
    measures (the reference engine's exact fidelity KL of a checkpoint with only that set
    rounded), the sets moved fit the budget and no set left out would, they hold the
    rounding of the unquantized weights on their grid and the rest the arm's 4-bit
    weights, the file spends what the manifest says, and the dense control and the
    reference engine read the same W_hat."""
    model, text = calibrated
    calibration = {"seq_len": 64, "heldout": 3, **({"samples": 6} if quant["method"] == "gptq" else {})}
    base = arm(**quant, **({"calibration": calibration} if "samples" in calibration else {}))
    mixed = arm(**quant, calibration=calibration,
                mixed_precision={"extra_bits": 0.6, "windows": 2, "grids": grids})
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
    reader = TensorReader(model)

    def rounded(name, bits):
        if bits == 4:
            return four_bit[name].dequantize(torch.float32)
        return quantize_int8(reader.get(f"{name}.weight").float(), 64, bits=bits).dequantize()

    # layer 0's q/k/v, the head, and the table if there is one, at 4 bits and each grid below 8
    for s in [sets[i] for i in sorted({0, len(sets) - 1 - table, len(sets) - 1})]:
        assert [w["bits"] for w in s["wider"]] == grids and s["wider"][-1]["kl"] == 0  # 8: not measured
        for bits, measured in [(4, s["kl"]), *((w["bits"], w["kl"]) for w in s["wider"][:-1])]:
            tensors = dict(source)
            for name in s["members"]:
                tensors[f"{name}.weight"] = rounded(name, bits)
            folder = tmp_path / f"only-{s['members'][0]}-{bits}"
            folder.mkdir()
            write_checkpoint(folder, tensors, read_config(model), copy_from=model)
            compared = reference.compare_with_baseline(folder, model, windows, SETTINGS, 1,
                                                       prompts=[windows[0][:4]], new_tokens=1)
            positions = sum(len(w) for w in compared["window_kl"])
            kl = sum(x for w in compared["window_kl"] for x in w) / positions
            # two float32 paths differ by ~4e-8 nats: a 6-bit set's KL is ~3e-5
            assert kl == pytest.approx(measured, rel=1e-3, abs=1e-7), (s["members"], bits)

    # the budget holds, counted from the file; no set left at 4 bits would still fit on any
    # grid, and the sets moved remove at least the KL of any one move that fits
    moved = [s for s in sets if s["bits"] != 4]
    assert moved and len(moved) < len(sets)
    extra = manifest["storage"]["quantized_bits_per_weight"] - four["storage"]["quantized_bits_per_weight"]
    assert extra == pytest.approx(facts["extra_bits_spent"], rel=1e-9) and extra <= 0.6
    for s in sets:
        if s["bits"] == 4:
            cheapest = min(w["extra_bits_per_weight"] for w in s["wider"])
            assert facts["extra_bits_spent"] + cheapest > 0.6, s["members"]
    fitting = [s["kl"] - w["kl"] for s in sets for w in s["wider"] if w["extra_bits_per_weight"] <= 0.6]
    assert removed_kl(facts) >= max(fitting)

    grid = facts["moved"].get("model.embed_tokens")
    assert manifest["method_facts"]["embedding"] == (
        f"rtn, {grid} bits (mixed precision)" if grid else "rtn" if table else "dense")
    _, _, stored = read_quantized(tmp_path / "q")
    for name, weight in stored.items():
        if name in facts["moved"]:
            bits = facts["moved"][name]
            assert isinstance(weight, Int8Weight) and weight.equal(
                quantize_int8(reader.get(f"{name}.weight"), 64, bits=bits))
        else:
            assert weight.equal(four_bit[name]), name
    dequantize_checkpoint(tmp_path / "q", tmp_path / "d")
    assert_reference_scores_like_its_control(tmp_path / "q", tmp_path / "d")


def removed_kl(facts):
    """The KL a mixed arm's moves removed, by its sets' measurements."""
    return sum(s["kl"] - w["kl"] for s in facts["sets"] for w in s["wider"] if w["bits"] == s["bits"])


def test_arms_that_differ_only_in_their_budget_spend_it_on_one_shared_pass(calibrated, tmp_path):  # noqa: F811
    """Two budgets from one pass: the same measured sets, the pass's 4-bit weights kept
    where nothing moved, each within its budget, the larger removing at least as much KL;
    a budget that moves every set gives a checkpoint that still reads; a pass of another
    quant, or none, is refused before anything is written."""
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
            if module not in facts[name]["moved"]:
                assert weight.equal(four_bit[module]), module
        assert 0 < facts[name]["extra_bits_spent"] <= each["quant"]["mixed_precision"]["extra_bits"]
    assert [(s["members"], s["kl"]) for s in facts["small"]["sets"]] == [
        (s["members"], s["kl"]) for s in facts["large"]["sets"]]
    assert len(facts["small"]["moved"]) < len(facts["large"]["moved"])
    assert removed_kl(facts["small"]) < removed_kl(facts["large"])

    # a budget that pays for every set at 8 bits moves them all: no matrix is left in the
    # format's own layout, and the checkpoint still reads back and passes its control
    everything = arm(**quant, mixed_precision={"extra_bits": 4, "windows": 2})
    quantize_checkpoint(model, tmp_path / "all", tmp_path / "all.json", everything, shared_pass=outputs)
    _, _, stored = read_quantized(tmp_path / "all")
    assert sorted(stored) == sorted(four_bit) and all(isinstance(w, Int8Weight) for w in stored.values())
    dequantize_checkpoint(tmp_path / "all", tmp_path / "all-dense")
    assert_reference_scores_like_its_control(tmp_path / "all", tmp_path / "all-dense")

    other = arm(**{**quant, "group_size": 128}, mixed_precision={"extra_bits": 0.3, "windows": 2})
    with pytest.raises(ValueError, match="not of this arm's"):
        quantize_checkpoint(model, tmp_path / "other", tmp_path / "other.json", other, shared_pass=outputs)
    with pytest.raises(ValueError, match="starts from its sensitivity job's pass"):
        quantize_checkpoint(model, tmp_path / "none", tmp_path / "none.json", small)
    assert not (tmp_path / "other").exists() and not (tmp_path / "none").exists()
