"""The fourbit vLLM plugin: quantized checkpoints in every format vs their dense expansion.

A tiny random model (hidden 256, intermediate 512, 2 layers, vocab 512, untied head)
gets random 4-bit QuantizedWeights for every decoder linear (and the lm_head); they
are written in each format with formats.pack, and a dense control stores W_hat in
float32. In vLLM float32 the plugin's prompt logprobs must match the control's.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine_settings import engine_settings

from fourbit import formats
from fourbit.kernels import tinygemm
from fourbit.quant.qweight import QuantizedWeight

GROUP = 64
FORMATS = ("cpu_int4", "gptq", "compressed_tensors")
TOL = 1e-4
DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=512,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False)


def _random_qweight(n: int, k: int, sym: bool, gen: torch.Generator) -> QuantizedWeight:
    from conftest import random_qweight

    return random_qweight(n, k, GROUP, sym=sym, gen=gen, zeros=(4, 12), scales=(0.01, 0.03))


def _save_model(folder, arch: str, seed: int, vocab: int):
    import transformers

    torch.manual_seed(seed)
    dims = dict(DIMS, vocab_size=vocab)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims))
    elif arch == "qwen2":  # q/k/v carry biases
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**dims))
    else:
        raise ValueError(arch)
    model = model.float().eval()
    with torch.no_grad():  # biases are zero-initialized; make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return model


# What a mixed_precision arm can write: a merged layer (q/k/v, vLLM's qkv_proj) and a
# plain one on the 8-bit grid, in different decoder layers.
# what a mixed_precision arm moved, and to which grid: q/k/v (merged in vLLM) to 6 bits, a
# down projection to 5
MIXED_WIDE = {**{f"model.layers.0.self_attn.{m}_proj": 6 for m in "qkv"}, "model.layers.1.mlp.down_proj": 5}


def build_pair(root, fmt_name: str, *, arch: str = "llama", quantize_head: bool | int = True,
               vocab: int = 512, seed: int = 0, embedding: bool | int = False,
               mixed: bool | str = False):
    """(quantized folder, dense-control folder) from one random model; ``quantize_head``
    and ``embedding`` as an arm's quantize_head and quantize_embedding (8: in the 8-bit
    layout, rounded from the model's own matrix; an embedding at 6: the packed 6-bit one);
    ``mixed``: MIXED_WIDE in their packed 6- and 5-bit layouts too, or "all": every
    decoder linear at 6 bits (with an 8-bit head, no matrix left in the format's own)."""
    from safetensors.torch import save_file

    from fourbit.quant.int8 import quantize_int8

    head = {True: "head", False: "nohead", 8: "head8"}[quantize_head]
    table = {False: "", True: "-emb", 8: "-emb8", 6: "-emb6"}[embedding]
    tag = f"{arch}{vocab}-{fmt_name}-{head}{table}{f'-mixed-{mixed}' if mixed else ''}"
    if (root / tag).exists():
        return root / tag, root / f"dense-{tag}"
    src = root / f"source-{arch}{vocab}"
    if not src.exists():
        _save_model(src, arch, seed, vocab)
    from safetensors.torch import load_file

    state = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    fmt = formats.get_format(fmt_name)
    sym = not fmt.supports(False)
    gen = torch.Generator().manual_seed(seed + 1)
    qws = {
        name[: -len(".weight")]: _random_qweight(*t.shape, sym=sym, gen=gen)
        for name, t in sorted(state.items())
        if name.endswith("_proj.weight") or (quantize_head is True and name == "lm_head.weight")
        or (embedding is True and name == "model.embed_tokens.weight")
    }
    eight_bit = {name: quantize_int8(state[f"{name}.weight"], GROUP, bits=bits)
                 for name, bits in [("lm_head", 8)] * (quantize_head == 8)
                 + [("model.embed_tokens", embedding)] * (embedding in (6, 8))
                 + list(MIXED_WIDE.items()) * (mixed is True)
                 + [(name[: -len(".weight")], 6) for name in state
                    if name.endswith("_proj.weight")] * (mixed == "all")}
    qws = {name: qw for name, qw in qws.items() if name not in eight_bit}

    def write(folder, tensors, cfg):
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors",
                  metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))
        shutil.copy(src / "generation_config.json", folder / "generation_config.json")
        return folder

    quant = {k: v for k, v in state.items() if k[: -len(".weight")] not in qws | eight_bit}
    dense = dict(state)
    for module, qw in qws.items():
        layout = formats.table_layout(fmt) if module == "model.embed_tokens" else fmt
        quant.update({f"{module}.{s}": t for s, t in layout.pack(qw).items()})
        dense[f"{module}.weight"] = qw.dequantize(torch.float32)
    for module, qw in eight_bit.items():
        quant.update({f"{module}.{s}": t for s, t in formats.WIDE_LAYOUTS[qw.bits].pack(qw).items()})
        dense[f"{module}.weight"] = qw.dequantize(torch.float32)
    qc = fmt.quantization_config(GROUP, sym, lm_head=quantize_head is True,
                                 embedding=embedding is True and fmt.marks_embedding)
    if embedding is True and not fmt.marks_embedding:  # the 4-bit table beside the format
        qc[formats.INT4_EMBEDDING] = "model.embed_tokens"
    if eight_bit:
        qc[formats.INT8_MODULES] = sorted(eight_bit)
    narrower = {name: qw.bits for name, qw in eight_bit.items() if qw.bits < 8}
    if narrower:
        qc[formats.INT_BITS] = narrower
    if embedding in (6, 8):  # true at 8 bits, the bits of a narrower grid
        qc[formats.INT8_EMBEDDING] = True if embedding == 8 else embedding
    qcfg = dict(config, quantization_config=qc)
    return write(root / tag, quant, qcfg), write(root / f"dense-{tag}", dense, config)


WINDOWS = [  # ids < 488, the smallest vocabulary below
    torch.randint(0, 488, (40,), generator=torch.Generator().manual_seed(3)).tolist(),
    torch.randint(0, 488, (17,), generator=torch.Generator().manual_seed(4)).tolist(),
    torch.randint(0, 488, (29,), generator=torch.Generator().manual_seed(5)).tolist(),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_plugin")


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_cache")


def _score(folder, cache_root, **kw):
    from fourbit.engines.vllm import prompt_logprobs

    return prompt_logprobs(folder, WINDOWS, dtype="float32", kv_cache_bytes=32 << 20,
                           cache_root=cache_root, **kw)


def _max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True)
               for x, y in zip(ra["token_logprobs"], rb["token_logprobs"], strict=True))


# --- no engine -------------------------------------------------------------------------

def test_op_paths_agree_with_dense_expansion():
    """torch.ops.fourbit.int4_linear, every kernel and mode, vs x @ W_hat.T (float32)."""
    from fourbit.kernels import int4_cpu, tinygemm
    from fourbit.vllm_plugin import ops

    gen = torch.Generator().manual_seed(0)
    qw = _random_qweight(96, 256, sym=False, gen=gen)
    w = qw.dequantize(torch.float32)
    packed, sz = tinygemm.to_tinygemm(qw, torch.float32)
    codes, scales, offsets = ops.kept_copy(qw.codes, qw.scales, qw.zeros, GROUP)
    assert torch.equal(ops.dequantize_kept(codes, scales, offsets, GROUP), w)  # exact
    e8, ef = torch.empty(0, dtype=torch.uint8), torch.empty(0)
    f32 = ops.DTYPE_CODE[torch.float32]
    tg = ops.KERNEL_TINYGEMM
    # (kernel, mode, op tensors after x, the path a small batch takes, the large batch's path)
    cases = [(tg, ops.MODE_NEVER, (packed, sz, e8, ef, ef, e8), "tinygemm", "tinygemm"),
             (tg, ops.MODE_KEPT, (packed, sz, codes, scales, offsets, e8), "tinygemm", "kept")]
    if tinygemm.supports_direct_dequant(96, 256):
        cases.append((tg, ops.MODE_DIRECT, (packed, sz, e8, ef, ef, e8), "tinygemm", "direct"))
    if int4_cpu.isa() != "none":
        mine = int4_cpu.repack(qw)
        tensors = (mine.packed, ef, e8, mine.scales, ef, mine.zeros)
        for name in int4_cpu.NUMERICS:
            code = ops.KERNEL_CODE[name]
            cases.append((code, ops.MODE_DIRECT, tensors, name, "direct"))
            cases.append((code, ops.MODE_NEVER, tensors, name, name))
    for rows in (1, 7, 40):
        x = torch.randn(rows, 256, generator=gen)
        ref = x.double() @ w.double().T
        for kernel, mode, tensors, small, large in cases:
            ops.clear_calls()
            knobs = torch.tensor([8, mode, f32, kernel])
            y = torch.ops.fourbit.int4_linear(x, *tensors, knobs, GROUP, 96)
            assert y.shape == (rows, 96) and y.dtype == torch.float32
            path = small if rows < 8 else large
            # W4A8 rounds activations to 8 bits: ~0.4% of |x| per element
            tol = 0.02 * ref.abs().max() if path.startswith("w4a8") else 1e-4
            assert (y.double() - ref).abs().max() < tol, (rows, kernel, mode)
            assert ops.path_calls() == {path: 1}


def test_bfloat16_decode_gives_the_float32_result_rounded_once():
    """A bfloat16 engine's decode step: the op widens x and narrows y itself (its own loops
    for decode-sized tensors, aten's copy for larger ones), and gives exactly the float32
    op's result rounded to bfloat16, for every numerics of fourbit's kernel."""
    from fourbit.kernels import int4_cpu
    from fourbit.vllm_plugin import ops

    if int4_cpu.isa() == "none":
        pytest.skip("no fourbit kernel on this host")
    gen = torch.Generator().manual_seed(4)
    # 99 outputs: a single row's 99 values end in a tail of 3 after the eight-wide loop
    mine = int4_cpu.repack(_random_qweight(99, 256, sym=False, gen=gen))
    e8, ef = torch.empty(0, dtype=torch.uint8), torch.empty(0)
    tensors = (mine.packed, ef, e8, mine.scales, ef, mine.zeros)
    # 1 and 7 rows: decode-sized; 700 rows x 256 columns: above the op's own loops' limit
    for rows, threshold in ((1, 8), (7, 8), (700, ops.NO_THRESHOLD)):
        x = torch.randn(rows, 256, generator=gen).bfloat16()
        for name in int4_cpu.NUMERICS:
            knobs = torch.tensor([threshold, ops.MODE_DIRECT, ops.DTYPE_CODE[torch.bfloat16],
                                  ops.KERNEL_CODE[name]])
            y = torch.ops.fourbit.int4_linear(x, *tensors, knobs, GROUP, 99)
            wide = torch.ops.fourbit.int4_linear(x.float(), *tensors, knobs, GROUP, 99)
            assert y.dtype == torch.bfloat16 and torch.equal(y, wide.bfloat16()), (rows, name)


def test_dense_path_expands_a_block_of_rows_at_a_time(monkeypatch):
    """The dense path over fourbit's layout in blocks of rows gives one whole expansion's
    product up to float32 summation order (the BLAS may block a narrower product
    differently), for N neither a multiple of the layout's 4 rows nor of the block."""
    from fourbit.kernels import int4_cpu
    from fourbit.vllm_plugin import ops

    if int4_cpu.isa() == "none":
        pytest.skip("no fourbit kernel on this host")
    gen = torch.Generator().manual_seed(3)
    qw = _random_qweight(99, 256, sym=False, gen=gen)
    mine = int4_cpu.repack(qw)
    x = torch.randn(9, 256, generator=gen)
    w = qw.dequantize(torch.float32)
    whole = ops.dense_blocks(x, mine.packed, mine.scales, mine.zeros, GROUP)
    assert torch.equal(whole, torch.nn.functional.linear(x, w))  # one block: the whole W_hat
    monkeypatch.setattr(ops, "DENSE_BLOCK_BYTES", 4 * 256 * 10)  # blocks of 8 rows
    blocked = ops.dense_blocks(x, mine.packed, mine.scales, mine.zeros, GROUP)
    bound = 1e-6 * 256 * (x.abs() @ w.abs().T)  # float32 sums of 256 products
    assert blocked.shape == (9, 99) and torch.all((blocked - whole).abs() <= bound)


def test_op_is_the_extensions_with_the_general_ops_arguments():
    """With the kernel built, fourbit::int4_linear is the extension's C++ op (the decode path
    without a Python round trip); its arguments are those of the Python op it hands the
    other paths to, so the traced graph is the same whichever defines the op."""
    from fourbit.kernels import int4_cpu
    from fourbit.vllm_plugin import ops  # noqa: F401  (defines the Python ops)

    if int4_cpu._ext() is None:
        pytest.skip("the extension is not built; test_op_without_the_extension covers this")
    op = torch.ops.fourbit.int4_linear.default._schema
    general = torch.ops.fourbit.int4_linear_general.default._schema
    assert "int4_cpu" in torch.ops.fourbit.int4_linear.default._handle.debug()
    assert [(a.name, str(a.type).replace("SymInt", "int")) for a in op.arguments] == \
        [(a.name, str(a.type).replace("SymInt", "int")) for a in general.arguments]


def test_op_without_the_extension():
    """A package installed without a compiler: fourbit::int4_linear is the Python op and runs
    tinygemm (in a fresh process whose import of the extension fails)."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["fourbit.kernels._int4_cpu"] = None  # import fails, as when it was never built
import torch
from fourbit.kernels import tinygemm
from fourbit.quant.qweight import QuantizedWeight
from fourbit.vllm_plugin import ops
qw = QuantizedWeight(torch.randint(0, 16, (16, 64), dtype=torch.uint8), torch.full((16, 1), 0.01),
                     torch.full((16, 1), 8, dtype=torch.uint8), 64)
packed, sz = tinygemm.to_tinygemm(qw, torch.bfloat16)
e = torch.empty(0)
x = torch.randn(2, 64)
y = torch.ops.fourbit.int4_linear(x, packed, sz, e, e, e, e, torch.tensor([8, 0, 0, 0]), 64, 16)
assert (y - x @ qw.dequantize().T).abs().max() < 0.05, y
assert ops.path_calls() == {"tinygemm": 1}, ops.path_calls()
assert "int4_cpu" not in torch.ops.fourbit.int4_linear.default._handle.debug()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_op_pads_and_casts():
    """out_features below the packed rows (tinygemm's multiple of 16) and a bf16 compute dtype."""
    from fourbit.kernels import tinygemm
    from fourbit.vllm_plugin import ops

    gen = torch.Generator().manual_seed(1)
    qw = _random_qweight(32, 128, sym=True, gen=gen)
    packed, sz = tinygemm.to_tinygemm(qw, torch.bfloat16)
    none = (torch.empty(0, dtype=torch.uint8), torch.empty(0), torch.empty(0),
            torch.empty(0, dtype=torch.uint8))
    x = torch.randn(5, 128, generator=gen)
    knobs = torch.tensor([ops.NO_THRESHOLD, ops.MODE_NEVER, ops.DTYPE_CODE[torch.bfloat16],
                          ops.KERNEL_TINYGEMM])
    y = torch.ops.fourbit.int4_linear(x, packed, sz, *none, knobs, GROUP, 20)
    assert y.shape == (5, 20) and y.dtype == torch.float32
    ref = x @ qw.dequantize(torch.float32).T
    assert (y - ref[:, :20]).abs().max() < 0.05 * ref.abs().max()


def test_config_reads_every_format_and_knobs():
    from fourbit.vllm_plugin.config import FourbitInt4Config
    from fourbit.vllm_plugin.knobs import DEFAULTS

    for fmt_name in FORMATS:
        fmt = formats.get_format(fmt_name)
        qc = fmt.quantization_config(GROUP, fmt_name == "gptq", lm_head=True)
        cfg = FourbitInt4Config.from_config(qc)
        assert cfg.format_name == fmt_name and cfg.group_size == GROUP
        assert cfg.dequant_threshold == DEFAULTS["dequant_threshold"]
        # claimed only when asked for
        assert FourbitInt4Config.override_quantization_method(qc, "fourbit_int4") == "fourbit_int4"
        assert FourbitInt4Config.override_quantization_method(qc, None) is None
    qc = dict(formats.get_format("cpu_int4").quantization_config(128, False),
              dequant_threshold=7, prefill_dequant=False, direct_dequant=True,
              activation_dtype="bfloat16", kernel="w4a8")
    cfg = FourbitInt4Config.from_config(qc)
    knobs = (cfg.dequant_threshold, cfg.prefill_dequant, cfg.direct_dequant, cfg.activation_dtype,
             cfg.kernel)
    assert knobs == (7, False, True, "bfloat16", "w4a8")
    with pytest.raises(ValueError):
        FourbitInt4Config.from_config(dict(qc, activation_dtype="int8"))
    with pytest.raises(ValueError, match="kernel"):
        FourbitInt4Config.from_config(dict(qc, kernel="w4a4"))
    gptq = formats.get_format("gptq").quantization_config(128, True)
    with pytest.raises(ValueError, match="desc_act"):
        FourbitInt4Config.from_config(dict(gptq, desc_act=True))
    awq = {"quant_method": "awq"}
    assert FourbitInt4Config.override_quantization_method(awq, "fourbit_int4") is None


def test_every_kernel_an_arm_may_name_is_one_the_plugin_runs():
    """The schema's kernel enum (what the plugin accepts) is fourbit's kernel's numerics
    plus tinygemm; a name only in the schema would run tinygemm silently."""
    from fourbit.schema import allowed
    from fourbit.kernels import int4_cpu

    assert set(allowed("kernel")) == {*int4_cpu.NUMERICS, "tinygemm"}


def test_the_runtime_line_names_each_wide_grid_with_its_matrices():
    from fourbit.vllm_plugin import describe_int8

    wide = {"lm_head": 8, **{f"model.layers.{i}.mlp.down_proj": 6 for i in range(5)}}
    line = describe_int8({"kernel": "w4a16"}, 32, wide)
    assert line.startswith("lm_head at 8 bits; 5 matrices at 6 bits (")
    assert line.endswith(", 5/6-bit codes unpacked to int8)")
    assert "unpacked" not in describe_int8({"kernel": "w4a16"}, 32, {"lm_head": 8})


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_embedding_lookup_is_exactly_the_dense_controls_rows(bits):
    """The quantized table (cpu_int4's 4-bit layout, or a wide one) is loaded through its
    placeholders like any layer; each looked-up row is bit for bit the row of W_hat the
    dense control stores (and only those rows)."""
    from fourbit.quant.int8 import quantize_int8
    from fourbit.vllm_plugin import ops
    from fourbit.vllm_plugin.config import FourbitInt4Config
    from fourbit.vllm_plugin.linear_methods import FourbitEmbeddingMethod

    fmt = formats.get_format("cpu_int4")
    config = FourbitInt4Config.from_config(fmt.quantization_config(GROUP, False, embedding=bits == 4))
    vocab, hidden = 40, 256
    gen = torch.Generator().manual_seed(7)
    layout = fmt if bits == 4 else formats.WIDE_LAYOUTS[bits]
    qw = (_random_qweight(vocab, hidden, sym=False, gen=gen) if bits == 4
          else quantize_int8(torch.randn(vocab, hidden, generator=gen), GROUP, bits=bits))
    layer, method = torch.nn.Module(), FourbitEmbeddingMethod(config, layout)
    method.create_weights(layer, hidden, [vocab], hidden, vocab, torch.float32)
    for suffix, tensor in layout.pack(qw).items():
        placeholder = getattr(layer, suffix)
        placeholder.weight_loader(placeholder, tensor)
    method.process_weights_after_loading(layer)
    ids = torch.tensor([[3, 0, 39], [7, 7, 12]])
    ops.clear_calls()
    rows = method.embedding(layer, ids)
    assert ops.path_calls()["embedding"] == 1
    assert rows.shape == (2, 3, hidden) and rows.dtype == torch.float32
    assert torch.equal(rows, qw.dequantize(torch.float32)[ids])
    assert method.embedding(layer, torch.tensor([], dtype=torch.long)).shape == (0, hidden)


@pytest.mark.parametrize("isa", ["host", "none"])
def test_linear_method_picks_the_kernel_or_falls_back_by_name(monkeypatch, caplog, isa):
    """A layer loads into fourbit's layout when the kernel runs here; with the ISA hidden
    (FOURBIT_INT4_ISA=none, what a CPU without AVX2 sees) it takes tinygemm and says so,
    naming the layer; either way the op reproduces W_hat."""
    from fourbit.kernels import int4_cpu
    from fourbit.vllm_plugin.config import FourbitInt4Config
    from fourbit.vllm_plugin.linear_methods import FourbitLinearMethod

    if isa == "none":
        monkeypatch.setenv("FOURBIT_INT4_ISA", "none")
    fmt = formats.get_format("cpu_int4")
    config = FourbitInt4Config.from_config(dict(fmt.quantization_config(GROUP, False),
                                                kernel="w4a16", prefill_dequant=False))
    n, k = 40, 256
    qw = _random_qweight(n, k, sym=False, gen=torch.Generator().manual_seed(9))
    layer, method = torch.nn.Module(), FourbitLinearMethod(config)
    layer.prefix = "model.layers.0.mlp.down_proj"
    method.create_weights(layer, k, [n], k, n, torch.float32)
    for suffix, tensor in fmt.pack(qw).items():
        placeholder = getattr(layer, suffix)
        placeholder.weight_loader(placeholder, tensor)
    with caplog.at_level("WARNING"):
        method.process_weights_after_loading(layer)
    expected = "w4a16" if int4_cpu.isa() != "none" else "tinygemm"
    assert layer.fourbit_kernel == expected
    if expected == "tinygemm":
        assert "model.layers.0.mlp.down_proj" in caplog.text and "AVX2" in caplog.text
    else:
        assert layer.fourbit_packed.shape == (n, k // 2)  # the kernel's layout, no copy of codes
        assert layer.fourbit_codes.numel() == 0 and layer.fourbit_sz.numel() == 0
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ qw.dequantize().double().T
    tol = 1e-4 if expected == "w4a16" else 0.05 * ref.abs().max()  # tinygemm runs bf16 on x86
    assert (method.apply(layer, x).double() - ref).abs().max() < tol


# --- vLLM --------------------------------------------------------------------------------

CASES = [(f, "llama", True, 512, False, "w4a16") for f in FORMATS] + [
    ("cpu_int4", "qwen2", True, 512, False, "w4a16"),  # biases on q/k/v
    ("gptq", "llama", False, 512, False, "w4a16"),  # lm_head left dense
    ("cpu_int4", "llama", True, 488, False, "w4a16"),  # vLLM pads the head to 512 rows
    ("cpu_int4", "llama", True, 488, True, "w4a16"),  # the input embedding from 4 bits too
    ("cpu_int4", "qwen2", True, 512, True, "w4a16"),  # ... where vLLM names the embedding
    ("gptq", "llama", True, 488, True, "w4a16"),  # ... in the table layout beside any format
    ("compressed_tensors", "qwen2", True, 512, True, "w4a16"),
] + [(f, "llama", 8, 488, False, "w4a16") for f in FORMATS] + [  # the head at 8 bits, padded
    ("gptq", "llama", 8, 488, 8, "w4a16"),  # the embedding at 8 bits, in any format
    ("compressed_tensors", "qwen2", True, 512, 8, "w4a16"),  # ... where vLLM names it
    ("cpu_int4", "llama", True, 488, 6, "w4a16"),  # the table packed at 6 bits, no name
] + [(f, "llama", True, 512, False, "w4a8") for f in FORMATS] + [
    ("cpu_int4", "llama", True, 488, False, "w4a8_group"),  # int8 per group, padded head
    ("gptq", "llama", 8, 488, False, "w4a8_group"),  # ... and the 8-bit head on W8A8
    ("gptq", "qwen2", True, 512, False, "w4a8_group"),
    ("cpu_int4", "llama", True, 488, False, "tinygemm"),  # bfloat16 where vectorized
]
EIGHT_BIT_PATHS = {"w8a16", "w8a8", "int8_dense"}  # ops.path_calls() paths of a matrix on the 8-bit grid
# Max |logprob difference| from the dense control over WINDOWS. w4a16 is exact up to
# float32 summation order (measured <= 3e-5). w4a8 rounds every linear's activations to
# int8 per 32 columns; on this random model that moves logprobs by up to 0.14-0.20
# (measured, all three formats); w4a8_group, rounding per group, is held to the same
# bound; tinygemm in bfloat16 by 0.075-0.09. A packing or
# zero-point error moves them by whole nats.
KERNEL_TOL = {"w4a16": TOL, "w4a8": 0.3, "w4a8_group": 0.3, "tinygemm": 0.15}


@pytest.mark.slow
@pytest.mark.parametrize(("fmt_name", "arch", "quantize_head", "vocab", "embedding", "kernel"),
                         CASES)
def test_plugin_matches_dense_control(root, cache_root, fmt_name, arch, quantize_head, vocab,
                                      embedding, kernel):
    """Every linear through the small-batch kernel (prefill_dequant off) vs the dense control."""
    from fourbit.kernels import int4_cpu
    from fourbit.vllm_plugin import ops

    quant_dir, dense_dir = build_pair(root, fmt_name, arch=arch, quantize_head=quantize_head,
                                      vocab=vocab, embedding=embedding)
    ops.clear_calls()
    quant = _score(quant_dir, cache_root,
                   quant_overrides={"kernel": kernel, "prefill_dequant": False})
    ran = kernel if kernel == "tinygemm" or int4_cpu.isa() != "none" else "tinygemm"
    assert set(ops.path_calls()) - {"embedding", *EIGHT_BIT_PATHS} == {ran}, dict(ops.path_calls())
    assert bool(set(ops.path_calls()) & EIGHT_BIT_PATHS) == (quantize_head == 8)
    if quantize_head == 8 and int4_cpu.isa() != "none":  # int8 activations for 8-bit ones too
        assert ("w8a8" in ops.path_calls()) == (kernel in int4_cpu.INT8_ACTIVATIONS)
    # 2 layers x (qkv, o, gate_up, down) per forward, plus the head's calls
    assert ops.path_calls()[ran] >= 8
    assert bool(ops.path_calls()["embedding"]) == bool(embedding)
    ops.clear_calls()
    dense = _score(dense_dir, cache_root)
    assert not ops.path_calls()
    assert [r["tokens"] for r in quant] == [len(w) - 1 for w in WINDOWS]
    diff = _max_diff(quant, dense)
    assert diff <= KERNEL_TOL[ran], diff
    # the distributions are far from flat (every logprob would be -log 512): the check has teeth
    lps = [x for r in quant for x in r["token_logprobs"]]
    assert max(lps) - min(lps) > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_plugin_runs_a_mixed_precision_checkpoint(root, cache_root, fmt_name):
    """A mixed_precision arm's checkpoint: merged q/k/v on the 6-bit grid and a down
    projection on the 5-bit one beside 4-bit layers and an 8-bit head, in a model with
    q/k/v biases. The packed layers load shard by shard into one matrix of int8 codes, the
    4-bit ones still take the kernel, and the result is the dense control's."""
    from fourbit.kernels import int4_cpu
    from fourbit.vllm_plugin import ops

    quant_dir, dense_dir = build_pair(root, fmt_name, arch="qwen2", quantize_head=8, mixed=True)
    kernel = "w4a16" if int4_cpu.isa() != "none" else "tinygemm"
    ops.clear_calls()
    quant = _score(quant_dir, cache_root, quant_overrides={"kernel": kernel, "prefill_dequant": False})
    # 2 layers x (qkv, o, gate_up, down) per forward, 2 of them wide, the head 8-bit too;
    # the windows shorter than INT8_DENSE_ROWS take the 8-bit kernel, the 40-token one not
    eight_bit = {"w8a16", "int8_dense"} if int4_cpu.isa() != "none" else {"int8_dense"}
    assert set(ops.path_calls()) == {kernel, *eight_bit} and ops.path_calls()[kernel] >= 6, dict(ops.path_calls())
    diff = _max_diff(quant, _score(dense_dir, cache_root))
    assert diff <= TOL, diff


@pytest.mark.slow
def test_plugin_runs_a_checkpoint_with_no_matrix_in_its_format(root, cache_root):
    """A budget that moved every set: decoder linears at 6 bits, the head at 8, nothing in
    the format's own layout. The plugin still reads it, runs only the wide op, and gives
    the dense control's result."""
    from fourbit.vllm_plugin import ops

    quant_dir, dense_dir = build_pair(root, "cpu_int4", quantize_head=8, mixed="all")
    ops.clear_calls()
    quant = _score(quant_dir, cache_root, quant_overrides={"prefill_dequant": False})
    assert set(ops.path_calls()) <= EIGHT_BIT_PATHS, dict(ops.path_calls())
    assert _max_diff(quant, _score(dense_dir, cache_root)) <= TOL


@pytest.mark.slow
def test_compiled_mode_runs_the_op(root, cache_root):
    """Eager forwards call the op's implementation directly (config.py apply); a compiled
    model (Dynamo traces apply, which then takes the custom op: the extension's C++ op,
    which counts its own calls, where it is built) must still run every linear on the
    kernel and agree with the dense control."""
    from fourbit.kernels import int4_cpu
    from fourbit.vllm_plugin import ops

    quant_dir, dense_dir = build_pair(root, "cpu_int4")
    kernel = "w4a16" if int4_cpu.isa() != "none" else "tinygemm"
    ops.clear_calls()
    quant = _score(quant_dir, cache_root, enforce_eager=False,
                   quant_overrides={"kernel": kernel, "prefill_dequant": False})
    assert set(ops.path_calls()) == {kernel} and ops.path_calls()[kernel] >= 8, dict(ops.path_calls())
    assert _max_diff(quant, _score(dense_dir, cache_root)) <= KERNEL_TOL[kernel]
    # ... and the 8-bit matrices take their own opaque op, both its paths
    quant_dir, dense_dir = build_pair(root, "cpu_int4", quantize_head=8, mixed=True)
    ops.clear_calls()
    quant = _score(quant_dir, cache_root / "mixed", enforce_eager=False,
                   quant_overrides={"kernel": kernel, "prefill_dequant": False})
    eight_bit = {"w8a16", "int8_dense"} if int4_cpu.isa() != "none" else {"int8_dense"}
    assert set(ops.path_calls()) == {kernel, *eight_bit}, dict(ops.path_calls())
    dense = _score(dense_dir, cache_root)
    assert _max_diff(quant, dense) <= KERNEL_TOL[kernel]
    if int4_cpu.isa() == "none":
        return
    # ... and with int8 activations the 8-bit op takes its W8A8 argument through the graph
    ops.clear_calls()
    quant = _score(quant_dir, cache_root / "mixed_w4a8_group", enforce_eager=False,
                   quant_overrides={"kernel": "w4a8_group", "prefill_dequant": False})
    assert {"w4a8_group", "w8a8"} <= set(ops.path_calls()), dict(ops.path_calls())
    assert _max_diff(quant, dense) <= KERNEL_TOL["w4a8_group"]


@pytest.mark.slow
def test_bfloat16_compiled_engine_passes_its_control(root, cache_root):
    """The runtime issue 36 asks for where the host has avx512_bf16: the plugin in a
    bfloat16 engine, compiled, every numerics of fourbit's kernel and the dense bfloat16
    path, each within the control tolerance of what it rounds (knobs.numerics) of the
    dense expansion in the same bfloat16 engine, on the study's measure (|mean NLL
    difference|, report.rows.control)."""
    from fourbit.engines.vllm import prompt_logprobs
    from fourbit.kernels import int4_cpu
    from fourbit.schema import block
    from fourbit.vllm_plugin import DEFAULTS, numerics, ops

    if int4_cpu.isa() == "none":
        pytest.skip("no fourbit kernel on this host (it needs AVX2 and FMA)")
    quant_dir, dense_dir = build_pair(root, "cpu_int4")
    tolerances = block("evaluation")["control_tolerance"]

    def mean_nll(folder, cache, **overrides):
        records = prompt_logprobs(folder, WINDOWS, dtype="bfloat16", kv_cache_bytes=32 << 20,
                                  cache_root=cache, enforce_eager=False, **overrides)
        logprobs = [x for r in records for x in r["token_logprobs"]]
        return -sum(logprobs) / len(logprobs)

    dense = mean_nll(dense_dir, cache_root / "bf16_dense")
    # (knobs, the one op path the windows take): each numerics of the kernel for every
    # forward, then the dense bfloat16 path for every forward
    runs = [({"kernel": kernel, "prefill_dequant": False}, kernel) for kernel in int4_cpu.NUMERICS]
    runs.append(({"kernel": "w4a8_group", "dequant_threshold": 1}, "direct"))
    for overrides, path in runs:
        ops.clear_calls()
        quant = mean_nll(quant_dir, cache_root / "bf16_quant", quant_overrides=overrides)
        assert set(ops.path_calls()) == {path}, (overrides, dict(ops.path_calls()))
        rounds = numerics({**DEFAULTS, **overrides}, "bfloat16", rows=len(WINDOWS[0]))
        assert rounds == ("int8_activations" if path.startswith("w4a8") else "bf16_activations")
        assert abs(quant - dense) <= tolerances[rounds], (overrides, quant, dense)


@pytest.mark.slow
def test_kernels_and_dequant_paths_agree(root, cache_root):
    """Every exact path through the op gives the same logprobs to float32 summation order:
    fourbit's W4A16 kernel, tinygemm in float32 (asked for by name), and the dense paths
    from fourbit's layout, from tinygemm's and from a kept copy (these three bit for bit)."""
    from fourbit.kernels import int4_cpu, tinygemm
    from fourbit.vllm_plugin import ops

    folder, _ = build_pair(root, "compressed_tensors")
    f32 = {"activation_dtype": "float32"}
    variants = {  # name: (quant_overrides, the one op path it must take)
        "tinygemm": ({"prefill_dequant": False, "kernel": "tinygemm", **f32}, "tinygemm"),
        "kept": ({"dequant_threshold": 0, "direct_dequant": False, "kernel": "tinygemm"}, "kept"),
    }
    if tinygemm.probe_layout() is not None:
        variants["direct"] = ({"dequant_threshold": 0, "kernel": "tinygemm", **f32}, "direct")
    if int4_cpu.isa() != "none":
        variants["w4a16"] = ({"prefill_dequant": False, "kernel": "w4a16"}, "w4a16")
        variants["w4a16 direct"] = ({"dequant_threshold": 0, "kernel": "w4a16"}, "direct")
    runs = {}
    for name, (overrides, path) in variants.items():
        ops.clear_calls()
        runs[name] = _score(folder, cache_root, quant_overrides=overrides)
        assert set(ops.path_calls()) == {path}, (name, dict(ops.path_calls()))
    for a in runs:
        for b in runs:
            assert _max_diff(runs[a], runs[b]) <= TOL, (a, b)
    # the dense kernels from a kept copy and from either packed layout compute the same W_hat
    dense = [name for name in ("kept", "direct", "w4a16 direct") if name in runs]
    for name in dense[1:]:
        assert _max_diff(runs[name], runs["kept"]) == 0.0, name


# --- vLLM's own kernel (the vllm_native engine) -------------------------------------------


@pytest.mark.slow
def test_native_kernel_runs_the_gptq_checkpoint_without_the_plugin(root, cache_root):
    """Where vLLM's cpu_gemm_wna16 exists (AVX-512), the vllm_native engine runs a GPTQ
    checkpoint on it, not on the plugin, and stays within bf16 rounding of its dense control."""
    from fourbit.bench.hostprobe import choose_runtimes
    from fourbit.cpuinfo import isa_flags
    from fourbit.engines import unavailable_here, vllm_native
    from fourbit.vllm_plugin import ops

    verdict = choose_runtimes(isa_flags())["vllm_native_w4a16"]
    assert unavailable_here("vllm_native") == (None if verdict["available"] else verdict["reason"])
    if not verdict["available"]:
        pytest.skip(f"vLLM's native 4-bit kernel cannot run here: {verdict['reason']}")
    quant_dir, dense_dir = build_pair(root, "gptq")
    settings = {**engine_settings("vllm_native", kv_cache_gib=1 / 32), "cache_root": str(cache_root)}
    engine = vllm_native.VllmNativeEngine()
    ops.clear_calls()
    native = engine.score_windows(quant_dir, WINDOWS, settings, 2)
    assert not ops.path_calls()  # the plugin's op never ran
    dense = engine.score_windows(dense_dir, WINDOWS, settings, 2)
    nll = [sum(r["nll_sum"] for r in side) / sum(r["tokens"] for r in side) for side in (native, dense)]
    assert abs(nll[0] - nll[1]) <= 0.002 * nll[1], nll  # perplexity within ~0.2%
    assert "cpu_gemm_wna16" in engine.runtime(quant_dir, settings)


def test_numerics_name_what_each_path_rounds(monkeypatch):
    """The control's tolerance class: windows at or above the threshold run the dense path
    in the compute dtype; below it the kernel's own numerics."""
    from fourbit.kernels import int4_cpu
    from fourbit.vllm_plugin import DEFAULTS, numerics

    monkeypatch.setattr(int4_cpu, "isa", lambda: "avx2")
    w4a8 = {**DEFAULTS, "kernel": "w4a8"}
    assert numerics(w4a8, "float32", rows=512) == "exact"  # dense path above the threshold
    assert numerics(w4a8, "float32", rows=1) == "int8_activations"
    assert numerics({**w4a8, "prefill_dequant": False}, "float32", rows=512) == "int8_activations"
    assert numerics({**DEFAULTS, "kernel": "w4a8_group"}, "float32", rows=1) == "int8_activations"
    assert numerics(DEFAULTS, "float32", rows=1) == "exact"  # W4A16
    assert numerics({**DEFAULTS, "activation_dtype": "bfloat16"}, "float32", rows=512) == "bf16_activations"
    # 8-bit matrices of an int8 kernel round from 2 rows up to INT8_DENSE_ROWS, whatever the
    # threshold; one row runs W8A16, and W4A16 arms keep W8A16 throughout
    low = {**DEFAULTS, "kernel": "w4a8_group", "dequant_threshold": 4}
    assert numerics(low, "float32", rows=8) == "exact"
    assert numerics(low, "float32", rows=8, eight_bit=True) == "int8_activations"
    assert numerics(low, "float32", rows=512, eight_bit=True) == "exact"
    assert numerics({**DEFAULTS, "dequant_threshold": 4}, "float32", rows=8, eight_bit=True) == "exact"
    monkeypatch.setattr(int4_cpu, "isa", lambda: "none")  # the fallback: tinygemm
    bf16_vectorized = tinygemm.vectorized(torch.bfloat16)
    assert numerics(DEFAULTS, "float32", rows=1) == ("bf16_activations" if bf16_vectorized else "exact")
