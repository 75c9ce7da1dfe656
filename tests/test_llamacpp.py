"""llama.cpp as an engine: parsing its tools' output (fast, from recorded output), and -- slow --
the real tools built by ensure_llamacpp on a tiny random Llama with a real SentencePiece tokenizer.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from fourbit import llamacpp
from fourbit.llamacpp import ToolError, build, installed, recipe, run_tool, sdist, toolchain
from fourbit.llamacpp.convert import convert_to_gguf
from fourbit.llamacpp.perplexity import (
    compare_windows,
    greedy_continuations,
    parse_compare_output,
    parse_greedy_output,
    parse_scorer_output,
    score_windows,
)
from fourbit.llamacpp.quantize import QTYPES, dequantize_gguf, gguf_bits_per_weight, quantize_gguf
from fourbit.llamacpp.throughput import llama_bench, parse_bench_json

# --- recorded output of the real tools (llama.cpp 0c1e570), trimmed ---------------------------

RECORDED_BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/tmp/pytest-of-root/pytest-39/gguf0/Q4_K_M.gguf",
    "model_type": "llama ?B Q4_K - Medium",
    "model_size": 892160,
    "model_n_params": 1443072,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 1,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": 0,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 512,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-11-29T09:30:10Z",
    "avg_ns": 51766072,
    "stddev_ns": 3750073,
    "avg_ts": 9925.502848,
    "stddev_ts": 722.330892,
    "samples_ns": [ 55481813, 51833820, 47982583 ],
    "samples_ts": [ 9228.25, 9877.72, 10670.5 ]
  },
  {
    "build_commit": "0c1e570",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/tmp/pytest-of-root/pytest-39/gguf0/Q4_K_M.gguf",
    "model_type": "llama ?B Q4_K - Medium",
    "model_size": 892160,
    "model_n_params": 1443072,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 1,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": 0,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "test_time": "2026-11-29T09:30:11Z",
    "avg_ns": 24557306,
    "stddev_ns": 1668129,
    "avg_ts": 5228.533455,
    "stddev_ts": 358.778260,
    "samples_ns": [ 24687427, 26156551, 22827942 ],
    "samples_ts": [ 5184.83, 4893.61, 5607.16 ]
  }
]
"""


# --- fast: parsing and plumbing ------------------------------------------------------------------


def test_scorer_output_is_parsed_in_window_order():
    stdout = "window 0 tokens 3 nll_sum 4.5\nwindow 1 tokens 1 nll_sum 0.25\ndone 2\n"
    assert parse_scorer_output(stdout, [3, 1]) == [
        {"nll_sum": 4.5, "tokens": 3},
        {"nll_sum": 0.25, "tokens": 1},
    ]


@pytest.mark.parametrize(
    "stdout, problem",
    [
        ("window 0 tokens 3 nll_sum 4.5\n", "did not finish"),
        (
            "window 0 tokens 2 nll_sum 4.5\nwindow 1 tokens 1 nll_sum 0.25\ndone 2\n",
            "expected window 0 with 3",
        ),
        (
            "window 1 tokens 1 nll_sum 0.25\nwindow 0 tokens 3 nll_sum 4.5\ndone 2\n",
            "expected window 0",
        ),
        (
            "window 0 tokens 3 nll_sum 4.5\nwarning: odd\nwindow 1 tokens 1 nll_sum 0.25\ndone 2\n",
            "unexpected line",
        ),
    ],
)
def test_scorer_output_that_does_not_match_the_request_is_refused(stdout, problem):
    with pytest.raises(ToolError, match=problem):
        parse_scorer_output(stdout, [3, 1])


def test_bench_json_gives_median_min_max_of_the_samples():
    result = parse_bench_json(RECORDED_BENCH_JSON)
    for test in ("pp512", "tg128"):
        summary = result[test]
        assert summary["min"] <= summary["median"] <= summary["max"]
        assert summary["median"] == sorted(summary["samples"])[len(summary["samples"]) // 2]
    assert len(result["raw"]) == 2


def test_bench_json_with_other_arithmetic_is_refused():
    tests = json.loads(RECORDED_BENCH_JSON)
    tests[1]["flash_attn"] = 1
    with pytest.raises(ToolError, match="flash_attn"):
        parse_bench_json(json.dumps(tests))


def test_bench_json_without_a_test_is_refused():
    tests = json.loads(RECORDED_BENCH_JSON)
    with pytest.raises(ToolError, match="0 tg128 tests"):
        parse_bench_json(json.dumps([t for t in tests if t["n_gen"] == 0]))
    with pytest.raises(ToolError, match="no valid JSON"):
        parse_bench_json("llama-bench: error: failed to load model\n")


def test_every_arithmetic_setting_is_on_every_command_line():
    common, bench = llamacpp.common_arithmetic_flags(), llamacpp.bench_arithmetic_flags()
    for flags in (common, bench):
        assert flags[flags.index("--flash-attn") + 1] == "off"
        assert (
            flags[flags.index("--cache-type-k") + 1]
            == flags[flags.index("--cache-type-v") + 1]
            == "f16"
        )
    assert "--repack" in common and bench[bench.index("--repack") + 1] == "1"


def test_tools_run_without_llama_arg_overrides(monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_FLASH_ATTN", "on")
    assert "LLAMA_ARG_FLASH_ATTN" not in llamacpp.tool_environment()
    assert "PATH" in llamacpp.tool_environment()


def test_a_failing_tool_is_reported_with_its_command_and_output():
    script = "echo partial result; echo the actual problem >&2; exit 3"
    with pytest.raises(ToolError, match="(?s)exit 3.*the actual problem.*partial result"):
        run_tool(["sh", "-c", script], "a test tool")


def test_cache_key_names_version_commit_and_this_cpu():
    key = installed.build_key()
    assert key.startswith(f"{recipe.LLAMA_CPP_PYTHON_VERSION}-{recipe.LLAMA_CPP_COMMIT[:7]}-isa")
    assert "-recipe" in key


def test_the_types_an_arm_may_name_are_the_schemas_and_each_has_a_layout_row():
    from fourbit.layouts import GGUF_TYPES
    from fourbit.schema import allowed

    assert QTYPES == allowed("llamacpp_type")
    assert set(QTYPES) == set(GGUF_TYPES)
    assert {"Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS",
            "IQ4_NL"} <= set(QTYPES)


IMATRIX_LIKE = """static bool compute_imatrix(llama_context * ctx, const common_params & params, const int32_t n_ctx) {
    std::vector<llama_token> tokens = common_tokenize(ctx, params.prompt, true, params.parse_special);
}
"""


def test_fourbit_imatrix_is_llama_imatrix_with_its_tokenizer_call_replaced():
    edited = recipe.imatrix_source(IMATRIX_LIKE)
    assert "common_tokenize(" not in edited
    assert "tokens = fourbit_token_ids(ctx, params.prompt);" in edited
    assert edited.index("fourbit_token_ids(const llama_context") < edited.index("static bool compute_imatrix(")
    with pytest.raises(RuntimeError, match="holds 0 copies of .*common_tokenize.*not the one"):
        recipe.imatrix_source(IMATRIX_LIKE.replace("common_tokenize", "tokenize"))
    with pytest.raises(RuntimeError, match="holds 2 copies of 'static bool compute_imatrix\\('"):
        recipe.imatrix_source(IMATRIX_LIKE + "static bool compute_imatrix(")


def test_the_cache_key_changes_with_fourbits_edits_of_llamacpp(monkeypatch):
    key = installed.build_key()
    monkeypatch.setattr(recipe, "IMATRIX_EDITS", recipe.IMATRIX_EDITS[:-1])
    assert installed.build_key() != key


def test_an_importance_matrix_needs_two_windows_of_one_length(tmp_path):
    from fourbit.llamacpp.imatrix import compute_imatrix

    gguf = tmp_path / "f16.gguf"
    gguf.write_bytes(b"GGUF")
    tools = installed.LlamaCpp.at(tmp_path)
    for windows in ([[1, 2, 3]], [[1, 2, 3], [1, 2]]):
        with pytest.raises(ValueError, match="need 2 or more windows of one length"):
            compute_imatrix(gguf, tmp_path / "imatrix.gguf", windows, tools=tools, threads=1)


def _fake_sdist(path, commit=recipe.LLAMA_CPP_COMMIT):
    files = {
        sdist._VENDORED_COMMIT_FILE: commit + "\n",
        sdist._VENDORED_TREE + "CMakeLists.txt": "project(x)\n",
        sdist._VENDORED_TREE + "gguf-py/gguf/__init__.py": "",
        sdist._VENDORED_TREE + "models/ggml-vocab-big.gguf": "unused",
        sdist._VENDORED_TREE + "docs/build.md": "unused",
        sdist._SDIST_TOP + "llama_cpp/__init__.py": "not llama.cpp",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


def test_only_the_vendored_tree_without_its_unused_parts_is_extracted(tmp_path):
    sdist.extract_tree(_fake_sdist(tmp_path / "s.tar.gz"), tmp_path / "tree")
    extracted = sorted(
        str(p.relative_to(tmp_path / "tree")) for p in (tmp_path / "tree").rglob("*") if p.is_file()
    )
    assert extracted == ["CMakeLists.txt", "gguf-py/gguf/__init__.py"]


def test_an_sdist_vendoring_another_commit_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="vendors llama.cpp 1234567, expected 0c1e57"):
        sdist.extract_tree(_fake_sdist(tmp_path / "s.tar.gz", commit="1234567"), tmp_path / "tree")


def test_an_incomplete_cached_build_is_named_not_used(tmp_path):
    assert installed.find_llamacpp(tmp_path) is None
    (tmp_path / installed.build_key() / "bin").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="lacks .*llama-quantize.*delete that folder"):
        installed.find_llamacpp(tmp_path)


def _fake_build(calls):
    def fake(source, out, jobs):
        calls.append(out)
        time.sleep(0.5)  # long enough for a second job to find the lock taken
        tools = installed.LlamaCpp.at(out)
        tools.gguf_py.mkdir(parents=True)
        tools.convert_script.touch()
        tools.quantize.parent.mkdir()
        for program in tools.programs:
            program.touch()

    return fake


def test_concurrent_jobs_build_once_and_share_the_result(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(build, "fetch_sdist", lambda folder: folder / "sdist.tar.gz")
    monkeypatch.setattr(build, "compile_tools", _fake_build(calls))
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: build.ensure_llamacpp(tmp_path, jobs=1), range(2)))
    assert len(calls) == 1 and results[0] == results[1]
    assert results[0].root == tmp_path / installed.build_key()
    assert calls[0] != results[0].root  # built under a temporary name, then renamed


def test_a_failed_build_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    def failing(source, out, jobs):
        (out / "bin").mkdir()
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(build, "fetch_sdist", lambda folder: folder / "sdist.tar.gz")
    monkeypatch.setattr(build, "compile_tools", failing)
    with pytest.raises(RuntimeError, match="compiler crashed"):
        build.ensure_llamacpp(tmp_path, jobs=1)
    assert installed.find_llamacpp(tmp_path) is None
    assert not list(tmp_path.glob(f".{installed.build_key()}.tmp-*"))


def test_leftovers_of_interrupted_builds_are_removed(tmp_path):
    key = installed.build_key()
    (tmp_path / f".{key}.tmp-12345" / "build").mkdir(parents=True)
    (tmp_path / ".other.tmp-1").mkdir()
    build._remove_interrupted_builds(tmp_path, key)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-1"]


def test_a_build_without_its_tools_stops_before_any_download(tmp_path, monkeypatch):
    monkeypatch.setattr(toolchain.shutil, "which", lambda tool: None if tool == "cmake" else "/bin/x")
    monkeypatch.setattr(build, "fetch_sdist", lambda folder: pytest.fail("fetched the sdist"))
    with pytest.raises(FileNotFoundError, match="missing: cmake .*apt-get install cmake build-essential"):
        build.ensure_llamacpp(cache_root=tmp_path)


# --- slow: the real tools --------------------------------------------------------------------


@pytest.fixture(scope="session")
def tools():
    """The cached build; built here once (~10 CPU-minutes) if there is none and a
    compiler is at hand."""
    found = installed.find_llamacpp()
    if found:
        return found
    missing = toolchain.missing_build_tools()
    if missing:
        pytest.skip(
            f"no llama.cpp build in {installed.default_cache_root()} and {missing} "
            f"not on PATH to build one; "
            f"install them or run `{sys.executable} -m fourbit.llamacpp.build`"
        )
    return build.ensure_llamacpp()


VOCAB, WINDOW = 512, 96


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    from fourbit.steps.prepare import prepare_corpus

    folder = tmp_path_factory.mktemp("corpus") / "corpus"
    prepare_corpus(
        {
            "source": "builtin",
            "max_bytes": 400_000,
            "calibration_fraction": 0.2,
            "evaluation_fraction": 0.2,
        },
        folder,
    )
    return folder


@pytest.fixture(scope="session")
def tiny_model(corpus, tmp_path_factory):
    """A random untied Llama with a real SentencePiece tokenizer the converter accepts.

    Its head is a copy of the embedding table (as separate tensors), so it
    predicts the current token again: a scorer off by one position would look
    far better than a correct one.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from fourbit.inputs.tokenizer import train_tokenizer

    folder = tmp_path_factory.mktemp("model") / "tiny-llama"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.save_pretrained(folder)
    train_tokenizer(corpus / "train.txt", folder, VOCAB)
    return folder


@pytest.fixture(scope="session")
def ggufs(tools, tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    files = {"F16": convert_to_gguf(tiny_model, out / "f16.gguf", "f16", tools=tools)}
    for qtype in ("Q4_K_M", "Q4_0", "Q8_0"):
        files[qtype] = quantize_gguf(
            files["F16"], out / f"{qtype}.gguf", qtype, tools=tools, threads=2
        )
    return files


@pytest.mark.slow
def test_dequantized_gguf_holds_gguf_pys_decoding_of_every_tensor(ggufs, tools):
    """The dense control: llama-quantize's F32 expansion equals gguf-py's own numpy
    decoding of each block (an independent implementation of the same tables)."""
    from fourbit.llamacpp.quantize import _import_gguf

    gguf = _import_gguf(tools.gguf_py)
    dense = dequantize_gguf(ggufs["Q4_K_M"], ggufs["Q4_K_M"].with_name("Q4_K_M-f32.gguf"),
                            tools=tools, threads=2)
    quantized = {t.name: t for t in gguf.GGUFReader(str(ggufs["Q4_K_M"])).tensors}
    expanded = {t.name: t for t in gguf.GGUFReader(str(dense)).tensors}
    assert expanded.keys() == quantized.keys()
    assert {t.tensor_type.name for t in quantized.values()} >= {"Q4_K", "Q6_K"}
    for name, tensor in quantized.items():
        assert expanded[name].tensor_type.name == "F32", name
        decoded = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(np.asarray(expanded[name].data).reshape(decoded.shape), decoded)


@pytest.mark.slow
def test_dequantize_needs_an_existing_gguf(tools, tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        dequantize_gguf(tmp_path / "absent.gguf", tmp_path / "out.gguf", tools=tools, threads=1)


@pytest.fixture(scope="session")
def windows(corpus, tiny_model):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model).encode(
        (corpus / "evaluation.txt").read_text()[:50_000], add_special_tokens=False
    )
    return [ids[i : i + WINDOW] for i in range(0, 4 * WINDOW, WINDOW)] + [ids[7:9]]


@pytest.mark.slow
def test_bits_per_weight_are_counted_from_the_files(ggufs, tools):
    f16 = gguf_bits_per_weight(ggufs["F16"], tools.gguf_py)
    assert f16["matmul_2d"]["bits_per_weight"] == 16
    # 2 layers x 7 matrices + the head; the token embedding is a lookup table, not a matmul.
    assert f16["matmul_2d"]["tensors"] == 15
    # Every matrix, the token embedding included, is what the file spends on its weights.
    assert f16["matrices"]["tensors"] == 16 and f16["matrices"]["bits_per_weight"] == 16
    assert f16["by_type"]["F32"]["tensors"] == 5  # 2 x 2 layer norms + the final norm

    q8 = gguf_bits_per_weight(ggufs["Q8_0"], tools.gguf_py)
    assert q8["matmul_2d"]["bits_per_weight"] == 8.5  # 32 int8 codes + one f16 scale per block

    q4km = gguf_bits_per_weight(ggufs["Q4_K_M"], tools.gguf_py)
    assert set(q4km["by_type"]) == {"Q4_K", "Q6_K", "F32"}
    assert q4km["tensor_types"]["output.weight"] == "Q6_K"
    assert 4.5 < q4km["matmul_2d"]["bits_per_weight"] < 6.5625  # between pure Q4_K and pure Q6_K
    embedding = q4km["by_type"][q4km["tensor_types"]["token_embd.weight"]]["bits_per_weight"]
    weights = {k: q4km[k]["weights"] for k in ("matrices", "matmul_2d")}
    assert q4km["matrices"]["bits_per_weight"] == pytest.approx(
        (q4km["matmul_2d"]["bits_per_weight"] * weights["matmul_2d"]
         + embedding * (weights["matrices"] - weights["matmul_2d"])) / weights["matrices"])
    assert (
        q4km["by_type"]["Q4_K"]["bits_per_weight"] == 4.5
        and q4km["by_type"]["Q6_K"]["bits_per_weight"] == 6.5625
    )
    for stats in (f16, q8, q4km):
        assert (
            sum(t["bytes"] for t in stats["by_type"].values())
            == stats["all"]["bytes"]
            < stats["file_bytes"]
        )


@pytest.fixture(scope="session")
def imatrix(ggufs, tools, corpus, tiny_model, tmp_path_factory):
    """(the importance matrix, its facts, the windows): the tiny model's on 6 windows of 64
    of its calibration split, drawn as the study's imatrix step draws them."""
    from fourbit.llamacpp.imatrix import compute_imatrix
    from fourbit.quantizers.calibration import calibration_ids, draw_windows

    ids = calibration_ids(tiny_model, corpus / "calibration.txt")
    windows = draw_windows(ids, {"samples": 6, "seq_len": 64, "seed": 0}, 0).tolist()
    out = tmp_path_factory.mktemp("imatrix") / "imatrix.gguf"
    return out, compute_imatrix(ggufs["F16"], out, windows, tools=tools, threads=2), windows


@pytest.mark.slow
def test_the_imatrix_is_computed_on_exactly_the_windows(imatrix, ggufs, tools):
    from fourbit.llamacpp.imatrix import compute_imatrix, read_imatrix

    out, facts, windows = imatrix
    stored = read_imatrix(out, tools.gguf_py)
    # the tiny model's SentencePiece vocabulary adds BOS: each chunk is BOS + one window
    assert facts["bos_prepended"] and facts["window_tokens_in_chunks"] == 6 * 64
    assert (stored["chunks"], stored["chunk_size"], stored["tokens_per_matrix"]) == (6, 65, [6 * 65])
    assert stored["matrices"] == 14  # 2 layers x 7; the head is left out, as llama-imatrix does
    assert stored["datasets"] == ["calibration-ids.txt"]
    assert facts["command"][facts["command"].index("-o") + 1] == str(out)
    # the same windows give the same bytes (a killed job's rerun writes what it would have)
    compute_imatrix(ggufs["F16"], out.with_name("again.gguf"), windows, tools=tools, threads=2)
    assert out.with_name("again.gguf").read_bytes() == out.read_bytes()
    with pytest.raises(ToolError, match="token id 512 is outside the vocabulary of 512"):
        compute_imatrix(ggufs["F16"], out.with_name("bad.gguf"), [w[:-1] + [VOCAB] for w in windows],
                        tools=tools, threads=2)
    assert not out.with_name("bad.gguf").exists() and not list(out.parent.glob(".bad.gguf.tmp-*"))


@pytest.mark.slow
@pytest.mark.parametrize("model, add_bos, bos, expected", [
    ("llama", None, 1, (True, 1)),  # SentencePiece adds BOS unless the file says otherwise
    ("gpt2", None, None, (False, None)),  # BPE adds none
    ("gpt2", True, 7, (True, 7)),
    ("llama", False, 1, (False, 1)),
])
def test_whether_a_chunk_starts_with_bos_follows_llamacpps_rule(tools, tmp_path, model, add_bos,
                                                                 bos, expected):
    from fourbit.llamacpp.imatrix import vocabulary_bos
    from fourbit.llamacpp.quantize import _import_gguf

    writer = _import_gguf(tools.gguf_py).GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    writer.add_tokenizer_model(model)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if bos is not None:
        writer.add_bos_token_id(bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert vocabulary_bos(tmp_path / "vocab.gguf", tools.gguf_py) == expected


@pytest.mark.slow
def test_the_imatrix_changes_what_llama_quantize_writes(imatrix, ggufs, tools):
    from fourbit.llamacpp.quantize import _import_gguf

    weighted = quantize_gguf(ggufs["F16"], ggufs["F16"].with_name("Q4_K_M-imatrix.gguf"), "Q4_K_M",
                             tools=tools, threads=2, imatrix=imatrix[0])
    assert weighted.read_bytes() != ggufs["Q4_K_M"].read_bytes()
    gguf = _import_gguf(tools.gguf_py)
    plain, with_imatrix = (gguf.GGUFReader(str(path)) for path in (ggufs["Q4_K_M"], weighted))
    before = {t.name: t for t in plain.tensors}
    changed = {t.name for t in with_imatrix.tensors
               if not np.array_equal(np.asarray(t.data), np.asarray(before[t.name].data))}
    # every decoder matrix is rounded otherwise; the head and the table, which the matrix
    # holds nothing for, and the F32 norms are not
    assert changed == {name for name, t in before.items()
                       if name.startswith("blk.") and t.tensor_type.name != "F32"}
    assert with_imatrix.fields["quantize.imatrix.chunks_count"].contents() == 6
    assert "quantize.imatrix.file" not in plain.fields


@pytest.mark.slow
def test_fourbit_imatrix_computes_what_llama_imatrix_does_from_the_same_tokens(
        tools, ggufs, tiny_model, corpus, tmp_path):
    """Its one edit is where the tokens come from: given the ids llama-imatrix makes of a
    text (BOS, then the text's, which llama.cpp's and the Hugging Face tokenizer agree on for
    plain words), in the chunks it cuts, it writes the same sums."""
    import re

    from transformers import AutoTokenizer

    from fourbit.inputs.tokenizer import BOS_ID
    from fourbit.llamacpp.imatrix import IDS_FILE, read_imatrix

    words = re.findall(r"[a-z]+", (corpus / "calibration.txt").read_text()[:20_000])
    text = " ".join(words)
    ctx = 48
    stream = [BOS_ID] + AutoTokenizer.from_pretrained(tiny_model).encode(text, add_special_tokens=False)
    chunks = [[stream[0]] + stream[k * ctx + 1:(k + 1) * ctx] for k in range(len(stream) // ctx)]
    (tmp_path / "text.txt").write_text(text)
    (tmp_path / IDS_FILE).write_text("".join(" ".join(map(str, c)) + "\n" for c in chunks))
    options = ["-c", ctx, "-t", 2, "--no-ppl", "-m", ggufs["F16"].resolve()]
    run_tool([tools.imatrix, "-f", "text.txt", "-o", "text.gguf", *options], "llama-imatrix", cwd=tmp_path)
    run_tool([tools.imatrix_ids, "-f", IDS_FILE, "-o", "ids.gguf", *options], "fourbit-imatrix", cwd=tmp_path)
    by_text, by_ids = (read_imatrix(tmp_path / name, tools.gguf_py) for name in ("text.gguf", "ids.gguf"))
    assert by_ids["chunks"] == by_text["chunks"] == len(chunks) > 10
    assert by_ids["tokens_per_matrix"] == by_text["tokens_per_matrix"]
    for name, summed in by_ids["in_sum2"].items():
        np.testing.assert_array_equal(summed, by_text["in_sum2"][name], err_msg=name)


# What each llama-quantize type stores its decoder matrices in, on a model whose rows its
# blocks divide (the tiny models here, and the builtin ones: widths multiples of 256).
MAIN_TYPE = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K",
             "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0", "IQ4_XS": "IQ4_XS", "IQ4_NL": "IQ4_NL"}


@pytest.mark.slow
@pytest.mark.parametrize("qtype", QTYPES)
def test_every_type_quantizes_expands_and_scores_a_256_wide_model(qtype, imatrix, ggufs, tools,
                                                                   windows, tmp_path):
    """With the importance matrix where the type reads one (all but Q8_0)."""
    quantized = quantize_gguf(ggufs["F16"], tmp_path / f"{qtype}.gguf", qtype, tools=tools, threads=2,
                              imatrix=None if qtype == "Q8_0" else imatrix[0])
    types = gguf_bits_per_weight(quantized, tools.gguf_py)["tensor_types"]
    assert types["blk.1.ffn_gate.weight"] == MAIN_TYPE[qtype]
    dense = dequantize_gguf(quantized, tmp_path / f"{qtype}-f32.gguf", tools=tools, threads=2)
    scored = [score_windows(path, windows[:2], tools=tools, threads=2) for path in (quantized, dense)]
    nll = [sum(w["nll_sum"] for w in s) / sum(w["tokens"] for w in s) for s in scored]
    assert abs(nll[0] - nll[1]) < 0.02  # the control: int8 activations' tolerance


@pytest.mark.slow
def test_head_and_embedding_types_can_be_chosen(ggufs, tools):
    out = quantize_gguf(
        ggufs["F16"], ggufs["F16"].with_name("Q4_0-q8-ends.gguf"), "Q4_0", tools=tools, threads=2,
        output_tensor_type="q8_0", token_embedding_type="f16",
    )
    types = gguf_bits_per_weight(out, tools.gguf_py)["tensor_types"]
    assert types["output.weight"] == "Q8_0" and types["token_embd.weight"] == "F16"
    assert types["blk.0.ffn_down.weight"] == "Q4_0"
    with pytest.raises(ValueError, match="qtype='Q3_K_S' is not one of"):
        quantize_gguf(ggufs["F16"], out, "Q3_K_S", tools=tools, threads=2)


@pytest.mark.slow
def test_f16_scores_agree_with_transformers_float32_on_the_same_ids(
    ggufs, tools, tiny_model, windows
):
    from transformers import AutoModelForCausalLM

    TOLERANCE = 2e-3  # nats per token: f16 weights against float32 ones
    llama = score_windows(ggufs["F16"], windows, tools=tools, threads=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.inference_mode():
        for window, scored in zip(windows, llama):
            ids = torch.tensor([window])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
            reference = -logprobs.gather(-1, ids[0, 1:, None]).sum().item()
            off_by_one = -logprobs.gather(-1, ids[0, :-1, None]).sum().item()
            assert scored["tokens"] == len(window) - 1
            assert abs(scored["nll_sum"] - reference) / scored["tokens"] < TOLERANCE, (
                scored,
                reference,
            )
            assert (reference - off_by_one) / scored["tokens"] > 50 * TOLERANCE


@pytest.mark.slow
def test_quantized_scores_differ_a_little_and_ids_outside_the_vocabulary_are_refused(
    ggufs, tools, windows
):
    f16 = score_windows(ggufs["F16"], windows, tools=tools, threads=2)
    q8 = score_windows(ggufs["Q8_0"], windows, tools=tools, threads=2)
    q4 = score_windows(ggufs["Q4_0"], windows, tools=tools, threads=2)
    gap = [abs(q["nll_sum"] - f["nll_sum"]) / f["tokens"] for q, f in zip(q8 + q4, f16 + f16)]
    assert 0 < max(gap[: len(f16)]) < max(gap[len(f16) :])  # Q8_0 closer to F16 than Q4_0
    with pytest.raises(ToolError, match=f"token id {VOCAB} is outside the vocabulary"):
        score_windows(ggufs["F16"], [[1, 2, VOCAB]], tools=tools, threads=1)


@pytest.mark.slow
def test_kl_of_quantized_models_from_f16_on_the_same_positions(ggufs, tools, windows):
    itself = compare_windows(ggufs["F16"], ggufs["F16"], windows[:3], tools=tools, threads=2)
    assert [len(w) for w in itself["window_kl"]] == [len(w) - 1 for w in windows[:3]]
    assert all(kl == 0.0 for w in itself["window_kl"] for kl in w)  # the same logits, exactly
    assert all(same for w in itself["window_top1"] for same in w)
    mean = {}
    for qtype in ("Q8_0", "Q4_0"):
        compared = compare_windows(ggufs["F16"], ggufs[qtype], windows[:3], tools=tools, threads=2)
        kl = [x for w in compared["window_kl"] for x in w]
        assert min(kl) >= -1e-12
        mean[qtype] = sum(kl) / len(kl)
    assert 0 < mean["Q8_0"] < mean["Q4_0"]
    with pytest.raises(ToolError, match=f"token id {VOCAB} is outside the vocabulary"):
        compare_windows(ggufs["F16"], ggufs["Q4_0"], [[1, 2, VOCAB]], tools=tools, threads=1)


@pytest.mark.slow
def test_fidelity_of_a_gguf_arm_compares_the_windows_positions(ggufs, tools, windows, tmp_path):
    from fourbit.metrics.kl import FULL
    from fourbit.steps.fidelity import compare_arm

    windows_file = tmp_path / "windows.json"
    windows_file.write_text(json.dumps({"windows": windows[:4], "token_ids_sha256": "test"}))
    out = compare_arm(ggufs["Q4_K_M"], ggufs["F16"], windows_file, tmp_path / "fidelity.json",
                      {"name": "llamacpp", "threads": 2},
                      {"windows": 3, "prompts": 4, "new_tokens": 8}, threads=2,
                      model_weights_sha256="ab" * 32)
    assert out["computed"] and out["method"] == FULL and out["bound"] == "exact"
    assert out["model_weights_sha256"] == "ab" * 32
    assert out["positions"] == 3 * (WINDOW - 1) and out["window_positions"] == [WINDOW - 1] * 3
    assert 0 < out["kl_mean"] <= out["kl_p99"] and 0.5 < out["top1_agreement"] < 1
    assert out["greedy"]["prompts"] == 4 and 0 <= out["greedy"]["identical"] <= 4
    assert "llama.cpp" in out["runtime"] and "f16.gguf" in out["baseline_runtime"]
    assert json.loads((tmp_path / "fidelity.json").read_text())["kl_mean"] == out["kl_mean"]


@pytest.mark.slow
def test_greedy_continuations_take_the_most_likely_token(ggufs, tools, windows):
    prompts = [w[:16] for w in windows[:3]]
    continued = greedy_continuations(ggufs["Q4_K_M"], prompts, 6, tools=tools, threads=2)
    assert [len(c) for c in continued] == [6, 6, 6]
    assert continued == greedy_continuations(ggufs["Q4_K_M"], prompts, 6, tools=tools, threads=1)
    # The last token is the argmax at the last position, so any other token there scores worse.
    for prompt, ids in zip(prompts, continued):
        others = [t for t in (0, 5, 77, 301) if t != ids[-1]]
        scored = score_windows(ggufs["Q4_K_M"], [prompt + ids] + [prompt + ids[:-1] + [t] for t in others],
                               tools=tools, threads=2)
        assert all(scored[0]["nll_sum"] < other["nll_sum"] for other in scored[1:])


def test_greedy_output_is_checked():
    assert parse_greedy_output("greedy 0 ids 4 5\ngreedy 1 ids 6 7\ndone 2\n", 2, 2) == [[4, 5], [6, 7]]
    with pytest.raises(ToolError, match="did not finish"):
        parse_greedy_output("greedy 0 ids 4 5\n", 1, 2)
    with pytest.raises(ToolError, match="2 ids expected"):
        parse_greedy_output("greedy 0 ids 4\ndone 1\n", 1, 2)


def test_the_arm_is_scored_against_the_base_given_as_base(monkeypatch):
    """KL(P_base || P_arm) is not symmetric: fourbit-score runs the arm as -m and the baseline
    as --base, whichever order a caller names them in."""
    import types

    from fourbit.llamacpp import perplexity

    commands = []

    def run(command, what, on_stdout_line=None, **kwargs):
        commands.append([str(part) for part in command])
        return types.SimpleNamespace(stdout="compare 0 positions 1 kl 0.5 top1 1\ndone 1\n")

    monkeypatch.setattr(perplexity, "run_tool", run)
    tools = types.SimpleNamespace(scorer="fourbit-score")
    assert compare_windows("base.gguf", "arm.gguf", [[1, 2]], tools=tools, threads=2) == {
        "window_kl": [[0.5]], "window_top1": [[True]]}
    [command] = commands
    assert command[command.index("-m") + 1] == "arm.gguf"
    assert command[command.index("--base") + 1] == "base.gguf"


def test_compare_output_is_checked():
    stdout = "compare 0 positions 2 kl 0.5 0.25 top1 1 0\ncompare 1 positions 1 kl 0 top1 1\ndone 2\n"
    assert parse_compare_output(stdout, [2, 1]) == {"window_kl": [[0.5, 0.25], [0.0]],
                                                    "window_top1": [[True, False], [True]]}
    with pytest.raises(ToolError, match="did not finish"):
        parse_compare_output(stdout.replace("done 2\n", ""), [2, 1])
    with pytest.raises(ToolError, match="window 0, 3 positions expected"):
        parse_compare_output(stdout, [3, 1])
    with pytest.raises(ToolError, match="unexpected line"):
        parse_compare_output(stdout.replace("top1 1 0", "top1 1"), [2, 1])
    with pytest.raises(ToolError, match="reported 1 windows, expected 2"):
        parse_compare_output("compare 0 positions 2 kl 0.5 0.25 top1 1 0\ndone 2\n", [2, 1])
    with pytest.raises(ToolError, match="not a finite number in window 1"):
        parse_compare_output(stdout.replace("kl 0 top1", "kl nan top1"), [2, 1])


@pytest.mark.slow
def test_llama_bench_on_pinned_cores(ggufs, tools):
    result = llama_bench(ggufs["Q4_K_M"], tools=tools, threads=1, cores=[0], repetitions=3)
    for test in ("pp512", "tg128"):
        assert len(result[test]["samples"]) == 3
        assert 0 < result[test]["min"] <= result[test]["median"] <= result[test]["max"]
    assert result["command"][:3] == [shutil.which("taskset"), "--cpu-list", "0"]
    assert result["raw"][0]["build_commit"] == tools.commit[:7]
    with pytest.raises(ValueError, match="oversubscribe"):
        llama_bench(ggufs["Q4_K_M"], tools=tools, threads=2, cores=[0])


@pytest.mark.slow
def test_gguf_files_are_read_with_the_trees_gguf_py(ggufs, tools):
    from fourbit.llamacpp.quantize import _import_gguf

    gguf = _import_gguf(tools.gguf_py)
    assert os.path.dirname(gguf.__file__).startswith(str(tools.gguf_py))
    reader = gguf.GGUFReader(str(ggufs["F16"]))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert (
        reader.fields["tokenizer.ggml.model"].contents() == "llama"
    )  # SentencePiece, from tokenizer.model
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == VOCAB
