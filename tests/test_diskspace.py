"""The disk a study needs, estimated before any job, and the refusal when it lacks."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import yaml

from conftest import mounted_tmpfs
from fourbit.config import Study
from fourbit.filesystems import bytes_under
from fourbit.diskspace import (
    ALLOWANCE,
    MARGIN,
    DiskSpaceError,
    Output,
    StudyDisk,
    parameters,
    refuse_short_disk,
)
from tiny_study import ROOT, TINY

# The rules' outputs (workflow/rules/*.smk), {model}, {arm}, {sensitivity}, {imatrix} and
# {engine} open, under results/.
PATTERNS = {
    "source": "{results}/{{model}}/source", "untied": "{results}/{{model}}/untied",
    "quantized": "{results}/{{model}}/arms/{{arm}}/quantized",
    "four_bit": "{results}/{{model}}/sensitivity/{{sensitivity}}/four_bit",
    "dense": "{results}/{{model}}/arms/{{arm}}/dense",
    "gguf_base": "{results}/{{model}}/gguf/f16.gguf",
    "imatrix": "{results}/{{model}}/imatrix/{{imatrix}}/imatrix.gguf",
    "gguf": "{results}/{{model}}/arms/{{arm}}/gguf/model.gguf",
    "gguf_dense": "{results}/{{model}}/arms/{{arm}}/gguf/dense.gguf",
    "logits": "{results}/{{model}}/eval/c/{{engine}}/{{arm}}/dense.logits.npy",
}


def study_disk(config_path: Path, results: Path) -> StudyDisk:
    config = yaml.safe_load(config_path.read_text())
    return StudyDisk(Study.from_config({**copy.deepcopy(config), "results": str(results)}))


def outputs(disk: StudyDisk, results: Path) -> list[Output]:
    return disk.outputs({kind: p.format(results=results) for kind, p in PATTERNS.items()})


def test_the_tiny_models_parameters_by_matrix():
    # 1 layer, hidden 256 (4 heads, 2 of them for k/v), intermediate 512, vocabulary 512
    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "torch_dtype": "bfloat16"}
    p = parameters(config)
    attention, mlp = 256 * 256 * 2 + 128 * 256 * 2, 3 * 512 * 256
    assert (p.linears, p.head, p.embedding) == (attention + mlp, 512 * 256, 512 * 256)
    assert p.dtype_bits == 16 and p.tied  # transformers' default: tied
    assert parameters(config, dtype_bits=32).dtype_bits == 32


def test_each_output_of_the_tiny_study(tmp_path):
    disk = study_disk(TINY, tmp_path / "results")
    found = {(o.kind, arm_name(o.path)): o.bytes for o in outputs(disk, tmp_path / "results")}
    linears, table = 589_824, 131_072  # the decoder's linears; the head, and the table, each
    everything = linears + 2 * table
    assert found == {
        ("source", None): (linears + table) * 4,  # float32, the head tied to the table
        ("untied", None): everything * 4,
        # 4 bits + a float16 scale and a zero per group of 128, the head too; the table dense
        ("quantized", "int4_g128"): linears * 4.25 / 8 + table * 4.25 / 8 + table * 4,
        # group 64, the table on the 4-bit grid as well
        ("quantized", "int4_g64"): everything * 4.5 / 8,
        # rtn g64 (4.5 bits), the head too, the table dense; the budget over the decoder's linears
        **{("quantized", f"rtn_mixed_{name}"): math.ceil(
            ((linears + table) * 4.5 + linears * extra + table * 32) / 8)
           for name, extra in (("small", 0.5), ("large", 1.1))},
        # the 4-bit pass both mixed arms start from: one, without a budget
        ("four_bit", None): math.ceil(((linears + table) * 4.5 + table * 32) / 8),
        **{("dense", arm): everything * 4 for arm in ("int4_g128", "int4_g64", "rtn_mixed_small",
                                                       "rtn_mixed_large")},
        ("gguf_base", None): everything * 2,
        ("gguf", "q4_k_m"): math.ceil((linears * 4.9 + 2 * table * 8.5) / 8),
        ("gguf", "q4_k_s_imatrix"): math.ceil((linears * 4.6 + 2 * table * 8.5) / 8),
        ("gguf", "iq4_nl_imatrix"): math.ceil((linears * 4.5 + 2 * table * 8.5) / 8),
        **{("gguf_dense", arm): everything * 4 for arm in ("q4_k_m", "q4_k_s_imatrix", "iq4_nl_imatrix")},
        # one for the two arms of one calibration block: per decoder linear a float32 sum of
        # squares per input column (K: 4 x 256, 2 x 256, 512) and a count, 160 bytes of names
        ("imatrix", None): 4 * (2048 + 7) + 160 * (7 + 1),
    }


def test_each_engine_keeping_fidelity_sides_keeps_its_baselines_logits(tmp_path):
    """vLLM's baseline job writes its logits of the compared windows (fidelity.windows, at
    most evaluation.max_windows, of 128 tokens) over the tiny model's 512 ids, float32;
    the reference engine keeps none."""
    config = yaml.safe_load(TINY.read_text())
    config["engines"]["vllm"] = {"dtype": "float32"}
    config["fidelity"] = {"windows": 3}
    path = tmp_path / "vllm.yaml"
    path.write_text(yaml.safe_dump(config))
    disk = study_disk(path, tmp_path / "results")
    kept = [o for o in outputs(disk, tmp_path / "results") if o.kind == "logits"]
    assert [(o.path.parts[-3].split("-")[0], o.path.parts[-2], o.bytes) for o in kept] == [
        ("vllm", "baseline", 3 * 127 * 512 * 4)]
    config["fidelity"] = {"windows": 20}  # only 8 windows are scored
    path.write_text(yaml.safe_dump(config))
    assert study_disk(path, tmp_path / "results").bytes("logits") == 8 * 127 * 512 * 4


def arm_name(path: Path) -> str | None:
    """The name of the arm whose folder ``path`` lies in (its id's readable part)."""
    parts = path.parts
    return parts[parts.index("arms") + 1].split("-")[0] if "arms" in parts else None


def test_a_study_that_does_not_fit_is_refused_naming_both_figures(tmp_path):
    results = tmp_path / "results"
    huge = [Output("dense", results / "m" / "arms" / f"a{i}" / "dense", 10**15) for i in range(2)]
    huge.append(Output("untied", results / "m" / "untied", 10**12))
    with pytest.raises(DiskSpaceError) as refused:
        refuse_short_disk(huge, results)
    message = str(refused.value)
    assert message.startswith(f"{results}/ is on a filesystem (")
    assert "this study needs about 2201.1 TB more there (the untied model 1.0 TB; " \
           "2 float32 dense expansions 2000.0 TB; +10%, +256.0 MB for the corpus" in message
    assert message.endswith("a study stopped for space needs less when run again)")


def test_outputs_that_exist_are_not_counted(tmp_path):
    results = tmp_path / "results"
    done = Output("dense", results / "m" / "arms" / "a" / "dense", 10**15)
    done.path.mkdir(parents=True)
    assert refuse_short_disk([done], results) == ""


def test_a_results_subfolder_on_a_small_filesystem_is_named(tmp_path):
    results = tmp_path / "results"
    with mounted_tmpfs(results / "m" / "arms" / "a", 1 << 20) as arm:
        short = [Output("dense", arm / "dense", 3_000_000), Output("untied", results / "m" / "untied", 10)]
        with pytest.raises(DiskSpaceError, match=(
                rf"^{results}/m/arms/a/ is on a filesystem \({arm}, tmpfs\) with 1.0 MB free; "
                r"this study needs about 3.3 MB more there \(1 float32 dense expansion 3.0 MB; "
                r"\+10%\)\.")):
            refuse_short_disk(short, results)
        fits = [Output("dense", arm / "dense", 100_000)]
        assert refuse_short_disk(fits, results) == (
            f"disk: the outputs still to write need about 110.0 kB on {results}/m/arms/a/ "
            "(1.0 MB free): 1 float32 dense expansion 100.0 kB; +10%")


def test_the_default_study_fits_on_this_machine(tmp_path):
    disk = study_disk(ROOT / "config.yaml", tmp_path / "results")
    needed = refuse_short_disk(outputs(disk, tmp_path / "results"), tmp_path / "results")
    total = sum(o.bytes for o in outputs(disk, tmp_path / "results"))
    assert total < 1e9 and "6 quantized checkpoints" in needed and "6 float32 dense expansions" in needed
    assert f"+{ALLOWANCE / 1e6:.1f} MB for the corpus" in needed


@pytest.mark.slow
@pytest.mark.workflow
def test_the_estimate_holds_for_what_the_tiny_study_wrote(finished_study):
    """Every checkpoint of the finished tiny study weighs between 80% of its estimate and
    the estimate with its margin; and a finished study needs nothing more."""
    results = finished_study / "results"
    made = outputs(study_disk(TINY, results), results)
    assert {o.kind for o in made} == {"source", "untied", "quantized", "dense", "gguf_base",
                                      "imatrix", "gguf", "gguf_dense", "four_bit"}
    for output in made:
        assert 0.8 * output.bytes <= bytes_under(output.path) <= (1 + MARGIN) * output.bytes, output
    assert refuse_short_disk(made, results) == ""
