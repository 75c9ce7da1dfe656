import json
import os
import platform

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fourbit.inputs.builtin_model import (
    DEFAULT_SPEC,
    TINY_SPEC,
    resolve_spec,
    train_builtin_model,
    training_identity,
)
from fourbit.inputs.pinned_kernels import (
    PINNED_KERNELS,
    _require_cpu_flags,
    cpu_vendor,
    training_environment,
)
from fourbit.steps.prepare import prepare_corpus

# Smaller than TINY_SPEC so the unit tests stay quick; TINY_SPEC is for workflow tests.
MICRO_SPEC = {**TINY_SPEC, "seq_len": 64, "batch_size": 4, "steps": 4, "eval_windows": 4}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "corpus"
    spec = {
        "source": "builtin",
        "max_bytes": 1_000_000,
        "calibration_fraction": 0.2,
        "evaluation_fraction": 0.2,
    }
    prepare_corpus(spec, out)
    return out


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "model"
    return out, train_builtin_model(corpus, out, MICRO_SPEC)


def test_training_twice_gives_bit_identical_weights(corpus, trained, tmp_path):
    first_dir, first = trained
    second = train_builtin_model(corpus, tmp_path / "again", MICRO_SPEC)
    files = sorted(p.name for p in first_dir.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "again").iterdir())
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.model"} < set(
        files
    )
    for name in set(files) - {"training.json"}:  # which holds the wall time
        assert (tmp_path / "again" / name).read_bytes() == (first_dir / name).read_bytes(), name
    assert second["model_sha256"] == first["model_sha256"]
    assert second["held_out_perplexity"] == first["held_out_perplexity"]


def test_training_leaves_the_callers_torch_settings_alone(corpus, trained):
    assert not torch.are_deterministic_algorithms_enabled()


def test_saved_folder_loads_as_a_hugging_face_causal_lm(trained):
    out, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tokenizer("def f(x):\n    return", return_tensors="pt")
    assert inputs["input_ids"][0, 0].item() == tokenizer.bos_token_id == model.config.bos_token_id
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[-1] == MICRO_SPEC["vocab_size"] and torch.isfinite(logits).all()


def test_saved_folder_passes_the_checks_the_download_job_makes(trained):
    """fourbit.steps.prepare.fetch_model checks the folder it has just built."""
    from fourbit.checkpoints.hf import read_config
    from fourbit.inputs.model_folder import check_folder

    out, _ = trained
    check_folder(out, read_config(out), load_tokenizer=True)


def test_training_report_is_saved_and_returned(trained):
    out, report = trained
    assert json.loads((out / "training.json").read_text()) == report
    assert report["spec"] == resolve_spec(MICRO_SPEC)
    assert report["train_tokens_seen"] == 4 * 4 * 63
    assert report["uniform_perplexity"] == MICRO_SPEC["vocab_size"]
    assert 1 < report["held_out_perplexity"] < report["uniform_perplexity"]
    assert report["held_out_windows"] == 4


@pytest.mark.parametrize(
    "key, value", [("hidden_size", 200), ("intermediate_size", 700), ("vocab_size", 1000)]
)
def test_dimensions_must_be_multiples_of_256(key, value):
    with pytest.raises(ValueError, match=f"{key}={value} must be a multiple of 256"):
        resolve_spec({key: value})


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"num_heads": 3}, "hidden_size=256 / num_heads=3 must give a whole, even head_dim"),
        ({"num_kv_heads": 3}, "num_heads=4 must be a multiple of num_kv_heads=3"),
        ({"steps": 0}, "steps=0 must be more than zero"),
        ({"steps": 2.5}, "steps=2.5 must be a whole number"),
        ({"lr": "fast"}, "lr='fast' must be a number"),
        ({"layers": 2}, r"unknown key\(s\) \['layers'\]"),
    ],
)
def test_bad_specs_are_refused_with_the_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_spec(spec)


def test_default_and_tiny_specs_are_valid():
    assert resolve_spec({}) == DEFAULT_SPEC
    assert resolve_spec(TINY_SPEC) == TINY_SPEC


def test_a_missing_corpus_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.txt does not exist; prepare the corpus"):
        train_builtin_model(tmp_path, tmp_path / "model", MICRO_SPEC)


# --- the kernels' pin: one set of weights whatever the host's CPU offers -------------------


def _cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo").read().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# What ATEN_CPU_CAPABILITY can force on this host: forcing avx512 where the CPU lacks
# it would stop torch on an illegal instruction, so it is tried only where it runs.
CAPABILITIES = ["avx2", "default"] + (
    ["avx512"] if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= _cpu_flags() else []
)
X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(scope="module")
def tiny_trainings(corpus, tmp_path_factory):
    """The tiny preset trained with the outer environment's ATEN_CPU_CAPABILITY forced to each
    capability this host can run, with the pin and without; and once pinned on one core."""
    root = tmp_path_factory.mktemp("capabilities")
    runs = [(pinned, capability, None) for pinned in (True, False) for capability in CAPABILITIES]
    if len(os.sched_getaffinity(0)) > 1:
        runs.append((True, "avx2", {min(os.sched_getaffinity(0))}))
    reports = {}
    for pinned, capability, cores in runs:
        saved_cores = os.sched_getaffinity(0)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("ATEN_CPU_CAPABILITY", capability)
            env.setenv("MKL_CBWR", "AUTO")  # the host's own oneMKL branch, unless pinned
            if cores:
                os.sched_setaffinity(0, cores)  # the training process inherits it
            try:
                out = root / f"{capability}-{'pinned' if pinned else 'unpinned'}-{len(cores or ())}"
                reports[pinned, capability, bool(cores)] = train_builtin_model(
                    corpus, out, TINY_SPEC, pin_kernels=pinned
                )
            finally:
                os.sched_setaffinity(0, saved_cores)
    return reports


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="the pin is for x86-64 hosts")
def test_pinned_training_gives_one_weights_hash_whatever_the_capability(tiny_trainings):
    pinned = {cap: tiny_trainings[True, cap, False] for cap in CAPABILITIES}
    assert len({report["model_sha256"] for report in pinned.values()}) == 1, {
        cap: report["model_sha256"] for cap, report in pinned.items()
    }
    for report in pinned.values():
        assert report["kernels"]["pinned"] == PINNED_KERNELS
        assert report["kernels"]["aten_capability"] == "AVX2"


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="the pin is for x86-64 hosts")
def test_without_the_pin_the_capabilities_train_different_weights(tiny_trainings):
    """The control: were the weights the same anyway, the test above would prove nothing."""
    unpinned = {cap: tiny_trainings[False, cap, False] for cap in CAPABILITIES}
    for cap, report in unpinned.items():
        assert report["kernels"]["pinned"] is None
        assert report["kernels"]["aten_capability"] == cap.upper()  # the outer value reached torch
    assert unpinned["avx2"]["model_sha256"] != unpinned["default"]["model_sha256"]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to take one away")
def test_the_thread_count_and_weights_do_not_follow_the_cores(tiny_trainings):
    one_core, all_cores = tiny_trainings[True, "avx2", True], tiny_trainings[True, "avx2", False]
    assert one_core["kernels"]["threads"] == all_cores["kernels"]["threads"] == TINY_SPEC["threads"]
    assert one_core["model_sha256"] == all_cores["model_sha256"]


def test_the_pin_overrides_the_callers_environment():
    outer = {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AUTO", "OMP_NUM_THREADS": "32"}
    env = training_environment(outer, 2)
    if X86:
        assert {key: env[key] for key in PINNED_KERNELS} == PINNED_KERNELS
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    unpinned = training_environment(outer, 2, pin_kernels=False)
    assert unpinned["ATEN_CPU_CAPABILITY"] == "avx512" and unpinned["MKL_CBWR"] == "AUTO"
    assert outer["OMP_NUM_THREADS"] == "32"  # the caller's mapping is not changed


def test_a_cpu_without_avx2_is_refused_by_name():
    with pytest.raises(RuntimeError, match="this CPU lacks avx2: the builtin model trains on AVX2"):
        _require_cpu_flags(("avx2", "fma"), "processor\t: 0\nflags\t\t: fpu sse2 avx fma\n")
    _require_cpu_flags(("avx2", "fma"), "flags\t\t: fpu sse2 avx avx2 fma\n")


def test_training_identity_follows_what_sets_the_weights():
    identity = training_identity("default", {})
    assert identity["spec"] == DEFAULT_SPEC and identity["kernels"] == PINNED_KERNELS
    assert identity["cpu_vendor"] == cpu_vendor()
    assert sorted(identity["versions"]) == ["sentencepiece", "torch", "transformers"]
    assert training_identity("default", {"steps": 151}) != identity
    assert training_identity("tiny", {}) != identity
    assert json.dumps(identity, sort_keys=True)  # plain data, for the id's hash


def test_a_failure_in_the_training_process_is_raised_with_its_reason(corpus, tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)training the builtin model failed.*fewer than one "
                                           r"window of seq_len=1000000"):
        train_builtin_model(corpus, tmp_path / "model", {**MICRO_SPEC, "seq_len": 1_000_000})
    assert not (tmp_path / "model").exists()
