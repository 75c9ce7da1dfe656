"""Runtime choice from recorded ISA flag sets of three real kinds of host."""

from __future__ import annotations

import pytest

from fourbit.bench.hostprobe import choose_runtimes

# An AVX2-only laptop (Intel Core i7-8550U, Kaby Lake R).
LAPTOP_AVX2 = set(
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx "
    "fxsr sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs "
    "bts rep_good nopl xtopology nonstop_tsc cpuid aperfmperf pni pclmulqdq dtes64 monitor ds_cpl "
    "vmx est tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid sse4_1 sse4_2 x2apic movbe popcnt "
    "tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch cpuid_fault epb "
    "invpcid_single pti ssbd ibrs ibpb stibp tpr_shadow vnmi flexpriority ept vpid ept_ad fsgsbase "
    "tsc_adjust bmi1 avx2 smep bmi2 erms invpcid mpx rdseed adx smap clflushopt intel_pt xsaveopt "
    "xsavec xgetbv1 xsaves dtherm ida arat pln pts hwp hwp_notify hwp_act_window hwp_epp "
    "md_clear flush_l1d".split()
)

# This project's AMD EPYC host, as read from its /proc/cpuinfo.
EPYC_AVX512 = set(
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
    "sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology "
    "nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 "
    "x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy "
    "cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext vmmcall fsgsbase tsc_adjust bmi1 "
    "avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb "
    "avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx512_bf16 clzero "
    "xsaveerptr arat avx512vbmi umip avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg "
    "avx512_vpopcntdq rdpid fsrm".split()
)

# A Sapphire Rapids Xeon (Xeon Platinum 8480+).
SAPPHIRE_RAPIDS = set(
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx "
    "fxsr sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs bts "
    "rep_good nopl xtopology nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq dtes64 "
    "monitor ds_cpl vmx smx est tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid dca sse4_1 sse4_2 x2apic "
    "movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch "
    "cpuid_fault epb cat_l3 cat_l2 cdp_l3 invpcid_single intel_ppin cdp_l2 ssbd mba ibrs ibpb "
    "stibp ibrs_enhanced tpr_shadow flexpriority ept vpid ept_ad fsgsbase tsc_adjust bmi1 avx2 "
    "smep bmi2 erms invpcid cqm rdt_a avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb "
    "intel_pt avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves cqm_llc "
    "cqm_occup_llc cqm_mbm_total cqm_mbm_local split_lock_detect avx_vnni avx512_bf16 wbnoinvd "
    "dtherm ida arat pln pts hfi vnmi avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes "
    "vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 rdpid bus_lock_detect "
    "cldemote movdiri movdir64b enqcmd fsrm md_clear serialize tsxldtrk pconfig arch_lbr ibt "
    "amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities".split()
)


def available(flags, env=None):
    return {name: verdict["available"] for name, verdict in choose_runtimes(flags, env or {}).items()}


def test_avx2_laptop_runs_tinygemm_only():
    assert available(LAPTOP_AVX2) == {
        "tinygemm": True, "vllm_native_w4a16": False, "vllm_native_w4a8_amx": False,
    }
    reasons = choose_runtimes(LAPTOP_AVX2, {})
    assert "lack cpu_gemm_wna16" in reasons["vllm_native_w4a16"]["reason"]
    assert "missing amx_tile, amx_int8, avx512f, avx512_bf16" in reasons["vllm_native_w4a8_amx"]["reason"]


def test_avx512_epyc_adds_vllm_w4a16_but_not_amx():
    assert available(EPYC_AVX512) == {
        "tinygemm": True, "vllm_native_w4a16": True, "vllm_native_w4a8_amx": False,
    }
    assert choose_runtimes(EPYC_AVX512, {})["vllm_native_w4a8_amx"]["reason"].startswith(
        "missing amx_tile, amx_int8:"
    )


def test_sapphire_rapids_runs_all_three_while_w4a8_is_on():
    assert available(SAPPHIRE_RAPIDS) == {
        "tinygemm": True, "vllm_native_w4a16": True, "vllm_native_w4a8_amx": True,
    }
    assert "VLLM_CPU_INT4_W4A8=0" in choose_runtimes(SAPPHIRE_RAPIDS, {})["vllm_native_w4a16"]["reason"]


@pytest.mark.parametrize(
    ("setting", "expected", "reason"),
    [("1", True, "int4_scaled_mm_cpu"), ("0", False, "turns vLLM's W4A8 path off"), ("yes", False, "not an integer")],
)
def test_w4a8_follows_vllm_reading_of_its_switch(setting, expected, reason):
    verdict = choose_runtimes(SAPPHIRE_RAPIDS, {"VLLM_CPU_INT4_W4A8": setting})["vllm_native_w4a8_amx"]
    assert verdict["available"] is expected
    assert reason in verdict["reason"]


def test_no_avx2_means_no_tinygemm():
    verdict = choose_runtimes({"sse4_2", "avx"}, {})["tinygemm"]
    assert verdict == {"available": False, "reason": "no avx2: torch's int4 CPU kernel would run its scalar path"}




def runtimes(flags):
    from fourbit.bench.hostprobe import vllm_runtimes

    return {r["name"]: r for r in vllm_runtimes(flags)}


def ran(flags):
    return sorted(name for name, r in runtimes(flags).items() if r["available"])


FOURBIT_FP32 = ["vllm float32 w4a16", "vllm float32 w4a8", "vllm float32 w4a8_group"]
FOURBIT_BF16 = ["vllm bfloat16 w4a16", "vllm bfloat16 w4a8", "vllm bfloat16 w4a8_group"]


def test_an_amx_host_runs_every_vllm_runtime_the_bfloat16_ones_on_amx():
    table = runtimes(SAPPHIRE_RAPIDS)
    assert ran(SAPPHIRE_RAPIDS) == sorted(table)
    assert sorted(name for name, r in table.items() if r["amx"]) == sorted(
        [*FOURBIT_BF16, "vllm_native bfloat16 cpu_gemm_wna16",
         "vllm_native_w4a8 bfloat16 int4_scaled_mm_cpu"])


def test_an_avx512_host_without_amx_refuses_vllms_w4a8_amx_op_saying_which_flags_it_lacks():
    table = runtimes(EPYC_AVX512)
    assert ran(EPYC_AVX512) == sorted([*FOURBIT_FP32, *FOURBIT_BF16,
                                       "vllm_native bfloat16 cpu_gemm_wna16"])
    refused = table["vllm_native_w4a8 bfloat16 int4_scaled_mm_cpu"]["reason"]
    assert refused.startswith("needs amx_tile, amx_int8, which this CPU lacks: vLLM's own W4A8 AMX op")
    assert not any(r["amx"] for r in table.values())


def test_an_avx2_host_runs_fourbits_float32_kernels_only():
    table = runtimes(LAPTOP_AVX2)
    assert ran(LAPTOP_AVX2) == sorted(FOURBIT_FP32)
    assert table["vllm bfloat16 w4a16"]["reason"].startswith("needs avx512_bf16, which this CPU lacks")
    assert table["vllm_native bfloat16 cpu_gemm_wna16"]["reason"].startswith("needs avx512f,")
