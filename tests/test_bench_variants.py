"""Which runtime variants the bench times beside an arm's scored runtime, on the three kinds
of host (their recorded flag sets), and how a variant's engine settings are made."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_hostprobe import EPYC_AVX512, LAPTOP_AVX2, SAPPHIRE_RAPIDS

from fourbit.bench import variants

ENGINE = {"name": "vllm", "dtype": "float32", "enforce_eager": True, "kv_cache_gib": 1,
          "max_num_seqs": 1, "quant": {"dequant_threshold": 64}}
SCORED = "vllm float32 w4a16"


def names(planned):
    return [v.name for v in planned]


@pytest.mark.parametrize(("flags", "timed"), [
    # fourbit's kernel runs on AVX2 + FMA; the bfloat16 engine needs avx512_bf16
    (LAPTOP_AVX2, ["vllm float32 w4a8", "vllm float32 w4a8_group"]),
    (EPYC_AVX512, ["vllm float32 w4a8", "vllm float32 w4a8_group", "vllm bfloat16 w4a16",
                   "vllm bfloat16 w4a8", "vllm bfloat16 w4a8_group"]),
    (SAPPHIRE_RAPIDS, ["vllm float32 w4a8", "vllm float32 w4a8_group", "vllm bfloat16 w4a16",
                       "vllm bfloat16 w4a8", "vllm bfloat16 w4a8_group"]),
], ids=["avx2", "avx512", "amx"])
def test_auto_times_every_other_variant_of_the_engine_this_host_runs(flags, timed, tmp_path):
    planned = variants.plan_variants(ENGINE, SCORED, "auto", flags, "vllm-1/a", tmp_path)
    assert names(planned) == timed
    # what this host lacks is left to the report's candidate list, not refused one by one
    assert all(v.refusal is None and v.settings for v in planned)
    # vLLM's own kernels are other engines (vllm_native, vllm_native_w4a8), not variants of it
    assert not any("native" in name for name in names(planned))


def test_a_variant_named_by_the_study_that_this_host_cannot_run_is_refused_with_the_reason(tmp_path):
    wanted = ["vllm bfloat16 w4a8_group", "vllm float32 w4a8"]
    planned = variants.plan_variants(ENGINE, SCORED, wanted, LAPTOP_AVX2, "vllm-1/a", tmp_path)
    timed, refused = planned  # in VLLM_RUNTIMES' order
    assert refused.name == "vllm bfloat16 w4a8_group" and refused.settings is None
    assert "avx512_bf16" in refused.refusal and "lacks" in refused.refusal
    assert timed.name == "vllm float32 w4a8" and timed.refusal is None
    assert variants.plan_variants(ENGINE, SCORED, wanted, EPYC_AVX512, "vllm-1/a", tmp_path)[0].refusal is None


def test_a_dense_checkpoint_and_an_engine_of_one_runtime_have_no_variants(tmp_path):
    assert variants.plan_variants(ENGINE, None, "auto", EPYC_AVX512, "vllm-1/baseline", tmp_path) == []
    native = {**ENGINE, "name": "vllm_native", "dtype": "bfloat16"}
    del native["quant"]
    assert variants.plan_variants(native, "vllm_native bfloat16 cpu_gemm_wna16", "auto",
                                  SAPPHIRE_RAPIDS, "vllm_native-1/a", tmp_path) == []
    assert variants.has_variants("vllm") and not variants.has_variants("vllm_native_w4a8")
    assert not variants.has_variants("llamacpp")


def test_a_variant_is_the_engine_with_its_dtype_and_kernel_and_a_compile_cache_of_its_own(tmp_path):
    [variant] = variants.plan_variants(ENGINE, SCORED, ["vllm bfloat16 w4a8_group"], EPYC_AVX512,
                                       "vllm-1/a", tmp_path)
    assert variant.settings == {**ENGINE, "dtype": "bfloat16",
                                "quant": {"dequant_threshold": 64, "kernel": "w4a8_group"}}
    assert ENGINE["quant"] == {"dequant_threshold": 64}  # the engine's own settings untouched
    assert variant.cache == Path(tmp_path) / "vllm-bfloat16-w4a8_group"
    assert variant.key == "vllm-1/a@vllm bfloat16 w4a8_group"


def test_unknown_variant_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown variant\(s\) \['vllm fp16 w4a8'\].*vllm float32 w4a16"):
        variants.check_names(["vllm float32 w4a8", "vllm fp16 w4a8"])
    variants.check_names(["vllm bfloat16 w4a8_group"])


def test_the_record_keeps_each_timed_variant_and_each_refusal(tmp_path):
    timed_variant = variants.Variant("e/a", "vllm float32 w4a8", {"dtype": "float32"}, tmp_path,
                                     numerics={"decode": "int8_activations", "prefill": "exact"})
    refused = variants.Variant("e/a", "vllm bfloat16 w4a8", None, None, "needs avx512_bf16")
    side = {"runtime": "r", "start": None, "memory": {}, "stats": {"tg128_tok_s": {"median": 2.0}}}
    timed = {timed_variant.key: {"arm": side, "passes": 3, "ratio": {"tg128_tok_s": {"median": 1.5}},
                                 "group": {"number": 1}, "contention": {"max_busy": 0.1}}}
    record = variants.record(True, [timed_variant, refused], timed)
    assert record["chosen"] is True
    [entry] = record["timed"]
    assert entry["name"] == "vllm float32 w4a8" and entry["ratio_to_scored"]["tg128_tok_s"]["median"] == 1.5
    assert entry["numerics"] == {"decode": "int8_activations", "prefill": "exact"}
    assert record["refused"] == [{"name": "vllm bfloat16 w4a8", "reason": "needs avx512_bf16"}]
