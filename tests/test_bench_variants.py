"""Which runtime variants the bench times beside an arm's scored runtime, on the three kinds
of host (their recorded flag sets), and how a variant's engine settings are made."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_hostprobe import EPYC_AVX512, LAPTOP_AVX2, SAPPHIRE_RAPIDS

from fourbit.bench import variants

ENGINE = {"name": "vllm", "dtype": "float32", "enforce_eager": True, "kv_cache_gib": 1,
          "max_num_seqs": 1, "quant": {"dequant_threshold": 64}}
ARM, BASELINE = Path("arm"), Path("baseline")


class Plugin:
    """What the plan asks of the vllm engine: how it names the way it runs a checkpoint
    (fourbit.engines.vllm.lifecycle.runtime_variant) and what that rounds."""

    def runtime_variant(self, checkpoint, settings):
        if checkpoint == BASELINE:
            return None
        return f"{settings['name']} {settings['dtype']} {settings['quant'].get('kernel', 'w4a16')}"

    def numerics(self, checkpoint, settings, rows):
        return "int8_activations" if "w4a8" in settings["quant"].get("kernel", "") else "exact"


def plan(wanted, flags, engine=ENGINE, checkpoint=ARM, runs=None, cache_root=Path("caches")):
    return variants.plan_variants(runs or Plugin(), engine, checkpoint, wanted, flags, "vllm-1/a",
                                  cache_root, prompt_tokens=512)


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
def test_auto_times_every_other_variant_of_the_engine_this_host_runs(flags, timed):
    planned = plan("auto", flags)
    assert names(planned) == timed
    # what this host lacks is left to the report's candidate list, not refused one by one
    assert all(v.refusal is None and v.settings for v in planned)
    assert [v.numerics["decode"] for v in planned] == [
        "int8_activations" if "w4a8" in name else "exact" for name in timed]


def test_a_variant_named_by_the_study_that_this_host_cannot_run_is_refused_with_the_reason():
    wanted = ["vllm bfloat16 w4a8_group", "vllm float32 w4a8"]
    timed, refused = plan(wanted, LAPTOP_AVX2)  # in VLLM_RUNTIMES' order
    assert refused.name == "vllm bfloat16 w4a8_group" and refused.settings is None
    assert "avx512_bf16" in refused.refusal and "lacks" in refused.refusal
    assert timed.name == "vllm float32 w4a8" and timed.refusal is None
    assert [v.refusal for v in plan(wanted, EPYC_AVX512)] == [None, None]


def test_a_dense_checkpoint_and_an_engine_of_one_runtime_have_no_variants():
    assert plan("auto", EPYC_AVX512, checkpoint=BASELINE) == []

    class Native(Plugin):
        def runtime_variant(self, checkpoint, settings):
            return "vllm_native bfloat16 cpu_gemm_wna16"

    native = {**ENGINE, "name": "vllm_native", "dtype": "bfloat16"}
    assert plan("auto", SAPPHIRE_RAPIDS, engine=native, runs=Native()) == []
    assert variants.has_variants("vllm") and not variants.has_variants("vllm_native_w4a8")
    assert not variants.has_variants("llamacpp")


def test_a_variant_is_the_engine_with_its_dtype_and_kernel_and_a_compile_cache_of_its_own(tmp_path):
    [variant] = plan(["vllm bfloat16 w4a8_group"], EPYC_AVX512, cache_root=tmp_path)
    assert variant.settings == {**ENGINE, "dtype": "bfloat16",
                                "quant": {"dequant_threshold": 64, "kernel": "w4a8_group"}}
    assert ENGINE["quant"] == {"dequant_threshold": 64}  # the engine's own settings untouched
    assert variant.cache == Path(tmp_path) / "vllm-bfloat16-w4a8_group"
    assert variant.key == "vllm-1/a@vllm bfloat16 w4a8_group"


def test_a_variant_the_engine_would_run_another_way_is_refused_not_timed_as_itself():
    class IgnoresKernels(Plugin):
        def runtime_variant(self, checkpoint, settings):
            return "vllm float32 w4a16"  # e.g. a kernel knob the checkpoint overrides

    planned = plan(["vllm float32 w4a8"], LAPTOP_AVX2, runs=IgnoresKernels())
    assert [(v.settings, v.refusal) for v in planned] == [
        (None, "the engine runs this checkpoint as 'vllm float32 w4a16' under it")]


def test_unknown_variant_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"bench.runtimes.variants: unknown variant\(s\) \['vllm fp16 w4a8'\].*vllm float32 w4a16"):
        variants.check_names(["vllm float32 w4a8", "vllm fp16 w4a8"], "bench.runtimes.variants")
    # vLLM's own kernels are engines of their own (each scored), not variants of one
    with pytest.raises(ValueError, match=r"serve.runtime: unknown variant\(s\) \['vllm_native bfloat16 cpu_gemm_wna16'\]"):
        variants.check_names(["vllm_native bfloat16 cpu_gemm_wna16"], "serve.runtime")
    variants.check_names(["vllm bfloat16 w4a8_group"], "serve.runtime")


def test_the_record_keeps_each_timed_variant_and_each_refusal(tmp_path):
    timed_variant = variants.Variant("e/a", "vllm float32 w4a8", {"dtype": "float32"}, tmp_path,
                                     numerics={"decode": "int8_activations", "prefill": "exact"})
    refused = variants.Variant("e/a", "vllm bfloat16 w4a8", None, None, "needs avx512_bf16")
    side = {"runtime": "r", "start": None, "memory": {}, "stats": {"tg128_tok_s": {"median": 2.0}}}
    timed = {timed_variant.key: {"arm": side, "passes": 3, "ratio": {"tg128_tok_s": {"median": 1.5}},
                                 "group": {"number": 1}, "contention": {"max_busy": 0.1}}}
    failed = variants.Variant("e/a", "vllm float32 w4a8_group", {"dtype": "float32"}, tmp_path)
    timed[failed.key] = {"failed": "its engine failed to start: RuntimeError: no"}
    record = variants.record(True, [timed_variant, refused, failed], timed)
    assert record["chosen"] is True
    [entry] = record["timed"]
    assert entry["name"] == "vllm float32 w4a8" and entry["ratio_to_scored"]["tg128_tok_s"]["median"] == 1.5
    assert entry["numerics"] == {"decode": "int8_activations", "prefill": "exact"}
    assert record["refused"] == [
        {"name": "vllm bfloat16 w4a8", "reason": "needs avx512_bf16"},
        {"name": "vllm float32 w4a8_group", "reason": "its engine failed to start: RuntimeError: no"}]
