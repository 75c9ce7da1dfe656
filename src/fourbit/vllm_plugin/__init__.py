"""fourbit's vLLM plugin: quantization method "fourbit_int4" on fourbit's own CPU 4-bit kernel.

None of vLLM's own 4-bit paths run on this project's CPUs (GPTQ, AWQ and
compressed-tensors W4A16 all go to cpu_gemm_wna16, built for AVX-512 only). This
method reads three checkpoint formats through fourbit.formats, losslessly
(format.unpack -> QuantizedWeight -> kernels.tinygemm), and runs every quantized
linear -- merged qkv_proj / gate_up_proj included, and an untied lm_head -- on
fourbit's AVX2 kernel (kernels/int4_cpu.py, W4A16 or W4A8) or PyTorch's
aten._weight_int4pack_mm_for_cpu, or on a dense matmul over W_hat for large batches.

    checkpoint quant_method          how vLLM gets here
    "fourbit_int4" (cpu_int4)        by name: config.json's quant_method is ours
    "gptq" (v1, sym, no act-order)   LLM(..., quantization="fourbit_int4")
    "compressed-tensors" (W4A16)     LLM(..., quantization="fourbit_int4")

fourbit.engines.vllm picks the method itself (quantization="auto").

Knobs, all in config.json's quantization_config (the engine merges overrides in,
engines/vllm/lifecycle.py ``quant_overrides``):
    dequant_threshold  int, default 64: a forward step with at least this many rows
                       (tokens, all sequences of the step together) takes the dense path
    prefill_dequant    bool, default true; false = tinygemm for every row count
    direct_dequant     bool, default true: the dense path reads W_hat out of the packed
                       tinygemm tensors instead of a kept copy of the codes (uint8
                       [N, K] + float32 scales/offsets per group); falls back to the
                       kept copy where kernels.tinygemm cannot read the layout, or runs
                       in bfloat16 under a model of another dtype (its scales are then
                       not exact); false = always the kept copy
    activation_dtype   "auto" (the model's dtype), "float32", "bfloat16" or "float16":
                       the dtype the dense path and tinygemm compute in (inputs cast in,
                       outputs back); with "auto" and a float32 model tinygemm runs in
                       bfloat16 where torch vectorizes only that (x86 AVX2/AVX-512,
                       kernels/tinygemm.py kernel_dtype); fourbit's kernel computes in float32
    kernel             "w4a16" (default), "w4a8", "w4a8_group" or "tinygemm": what runs batches below
                       the threshold (DEFAULTS in knobs.py; kernels/int4_cpu.py); with the int8
                       numerics, matrices stored at 8 bits run W8A8 from 2 rows too
The dense path computes W_hat in float32 (exact) and casts it to activation_dtype; in
float32 it reproduces the dense expansion of the checkpoint up to matmul summation
order, so quantized-vs-dense-control logprobs agree to ~1e-5 (tests/test_vllm_plugin.py).
Shapes tinygemm cannot take (group not in 32/64/128/256) run dense only, with a warning.

How vLLM 0.32 takes an out-of-tree method (line numbers: site-packages/vllm):
  * register_quantization_config(name)(cls) (model_executor/layers/quantization/
    __init__.py:61-109) appends the name to QUANTIZATION_METHODS and to the platform's
    supported list; get_quantization_config looks it up (same file, :194-197).
  * The method is chosen in ModelConfig._verify_quantization (config/model.py:1370-1457):
    every registered config's override_quantization_method(hf_quant_cfg, user_quant) is
    asked, custom methods first; the first non-None answer wins; otherwise
    LLM(quantization=X) must equal config.json's quant_method or it is a ValueError
    (:1440-1449). Ours answers only when user_quant == "fourbit_int4", so a gptq or
    compressed-tensors checkpoint is never claimed unasked.
  * get_quant_config (model_executor/model_loader/weight_utils.py:192-274) calls
    from_config(config.json's quantization_config); then VllmConfig checks
    get_supported_act_dtypes and calls maybe_update_config(model path)
    (config/vllm.py:886-919), where this config reads the safetensors headers to learn
    which modules are stored quantized.
  * Layers: LinearBase.__init__ (layers/linear.py:285-291) and VocabParallelEmbedding
    (layers/vocab_parallel_embedding.py:318-366) call get_quant_method(layer, prefix)
    and then quant_method.create_weights(layer, input_size_per_partition,
    output_partition_sizes, input_size, output_size, params_dtype, weight_loader=...);
    after loading, process_weights_after_loading(layer) for every module with a
    quant_method (model_loader/utils.py:133-175); forward is apply(layer, x, bias).
    The lm_head (ParallelLMHead) goes through the same three calls: the logits
    processor calls lm_head.quant_method.apply (layers/logits_processor.py:136-146).
    get_quant_method returns our LinearMethod for quantized linears and a quantized
    ParallelLMHead, our EmbeddingMethod for an input embedding stored quantized
    (VocabParallelEmbedding.forward calls quant_method.embedding, vocab_parallel_
    embedding.py:522-525), vLLM's UnquantizedLinearMethod for other linears, None for
    everything else (a dense embedding: vLLM's UnquantizedEmbeddingMethod, which on
    the CPU also keeps a packed GEMM copy of the table, :66-71).
  * Merged layers: vLLM's GPTQ/AWQ declare PackedvLLMParameter/GroupQuantScaleParameter
    with output_dim/input_dim/packed_dim so linear.py's loaders narrow each shard into
    place. Here the parameters are empty placeholders whose weight_loader keeps each
    shard's tensors separately; see loading.py.
  * The "vllm.general_plugins" entry point (pyproject.toml: fourbit =
    "fourbit.vllm_plugin:register") is loaded in every vLLM process
    (plugins/__init__.py:69); register() is idempotent and may also be called directly.
  * Classes are module-level, so the config pickles (multiprocessing engine).
"""

from __future__ import annotations

# What the rest of fourbit asks of the plugin without importing vLLM (the engine, the
# quantize step), from the package itself.
from fourbit.vllm_plugin.knobs import (
    DEFAULTS,
    QUANT_METHOD,
    describe,
    describe_int8,
    numerics,
    write_arm_knobs,
)

__all__ = ["DEFAULTS", "QUANT_METHOD", "describe", "describe_int8", "numerics", "register",
           "write_arm_knobs"]

_registered = False


def register() -> None:
    """vLLM general-plugin entry point: register the "fourbit_int4" quantization method.

    Idempotent; cheap enough to run in every vLLM process.
    """
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from fourbit.vllm_plugin import ops  # noqa: F401  (defines torch.ops.fourbit.int4_linear)
    from fourbit.vllm_plugin.config import FourbitInt4Config

    register_quantization_config(QUANT_METHOD)(FourbitInt4Config)
    _registered = True
