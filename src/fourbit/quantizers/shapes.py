"""What an arm would quantize, and whether every matrix fits its grid and format.

Decided from config.json alone while the workflow builds its DAG (fourbit.config), so
an arm that cannot apply to the model is dropped, with its reason, before any job
runs; and decided again by the same ``plan_arm`` on the model's real module tree when
the arm's quantize job starts (fourbit.steps.quantize.select_modules), so the job never
disagrees with the plan. Nothing here imports torch or transformers: the dry run
stays fast.

Shapes are (N, K) = (out_features, in_features) of each weight matrix; the input
embedding [V, H] counts as N = V, K = H (its groups run along H, like a linear's K).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from fourbit.schema import allowed
from fourbit.layouts import GGUF_TYPES, LAYOUTS, TABLE_LAYOUT

# Within a decoder layer, in forward order; each group's members share one input, and
# vLLM merges q/k/v into qkv_proj and gate/up into gate_up_proj, whose members must be
# all quantized or all dense (fourbit.vllm_plugin.config.is_quantized). The walk
# (fourbit.quantizers.walk) measures them in this order.
LAYER_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
HEAD = "lm_head"
EMBEDDING = "model.embed_tokens"
LAYER_PREFIX = "model.layers"
# model_type values whose decoder is the Llama layout above (what the walk, the untie
# step and the plugin's merged layers expect); others are refused before any job.
LLAMA_LAYOUT = ("llama", "mistral", "qwen2", "qwen3")

# A tensor whose row (K) is not a multiple of its llama.cpp type's block (GGUF_TYPES) is
# stored in a fallback type chosen by llama-quantize itself (Q4_K -> Q5_0, Q5_K -> Q5_1,
# Q6_K -> Q8_0, IQ4_XS -> IQ4_NL, a 32-block type or a row not a multiple of 32 -> F16;
# src/llama-quant.cpp tensor_type_fallback), never an error.
# Blocks of the types --output-tensor-type / --token-embedding-type may name (ggml's
# QK_K = 256 for the K-quants and IQ4_XS, QK4_0 ... QK8_0 = 32, one element for floats).
GGML_TYPE_BLOCK = {**{t: 256 for t in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")},
                   **{t: 32 for t in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl")},
                   **{t: 1 for t in ("f32", "f16", "bf16")}}


class ShapeError(ValueError):
    """config.json does not describe a model whose matrices fourbit can list."""


@dataclass(frozen=True)
class Matrices:
    """The weight matrices an arm may quantize, by module name."""

    linears: dict[str, tuple[int, int]]  # every decoder linear and the untied head, in order
    head: str
    embedding: str
    embedding_shape: tuple[int, int]  # [V, H]


@dataclass(frozen=True)
class ArmPlan:
    """What one arm does to one model's matrices."""

    quantized: dict[str, tuple[int, int]]  # linears (and the embedding) the arm quantizes
    kept_dense: dict[str, tuple[int, int]] = field(default_factory=dict)  # by fallback: dense
    misfits: dict[str, str] = field(default_factory=dict)  # name -> why it does not fit
    refusal: str | None = None  # why the arm cannot run on this model; None: it can

    def summary(self) -> dict:
        """Plain data for the study summary and the arm's manifest."""
        return {
            "kept_dense": {name: list(shape) for name, shape in self.kept_dense.items()},
            "misfits": collapse(self.misfits, {**self.quantized, **self.kept_dense}),
        }


def symmetric_gptq_else_compressed(quant: dict) -> str:
    """vLLM's GPTQ loader refuses sym=False; asymmetric grids go to compressed-tensors."""
    return "gptq" if quant["sym"] else "compressed_tensors"


def format_of(quant: dict) -> str:
    """The on-disk format of a fourbit method's checkpoints: the same answer as
    fourbit.quantizers.methods' ``format`` (tests check), without importing torch."""
    if quant["method"] == "cpu_int4":
        return "cpu_int4"
    return symmetric_gptq_else_compressed(quant)


def matrices_from_config(config: Mapping) -> Matrices:
    """Every matrix of a Llama-layout decoder, from its config.json (as the untied model
    has them: the head is its own matrix even when config.json ties it)."""
    model_type = config.get("model_type")
    if model_type not in LLAMA_LAYOUT:
        raise ShapeError(
            f"model_type {model_type!r} (architectures {config.get('architectures')}): fourbit "
            f"quantizes decoders of the Llama layout only ({', '.join(LLAMA_LAYOUT)})"
        )
    try:
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
        vocab = config["vocab_size"]
    except KeyError as missing:
        raise ShapeError(f"config.json has no {missing} ({model_type} configs need it)") from None
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    linears = {f"{LAYER_PREFIX}.{i}.{name}": shape
               for i in range(layers) for name, shape in per_layer.items()}
    linears[HEAD] = (vocab, hidden)
    return Matrices(linears, HEAD, EMBEDDING, (vocab, hidden))


def does_not_fit(format_name: str, n: int, k: int, group_size: int) -> str | None:
    """Why ``format_name`` cannot store an N x K matrix in groups of ``group_size``, or None:
    every division of its layout table (fourbit.layouts) that does not come out even."""
    sizes = {"N": n, "K": k, "G": group_size}
    reasons = []
    for spec in LAYOUTS[format_name]:
        for expr in spec.shape:
            num, _, den = expr.partition("/")
            divisor = sizes.get(den) or (int(den) if den else 1)
            if sizes.get(num, 1) % divisor:
                what = (f"group_size {group_size}" if den == "G"
                        else f"{divisor} ({format_name} {spec.suffix} is [{', '.join(spec.shape)}])")
                reason = f"{num}={sizes[num]} is not a multiple of {what}"
                if reason not in reasons:
                    reasons.append(reason)
    return "; ".join(reasons) or None


def sibling_groups(names) -> list[list[str]]:
    """``names`` partitioned into the sets that must be quantized together (LAYER_GROUPS
    within one layer); every other matrix is a set of its own."""
    member = {suffix: index for index, group in enumerate(LAYER_GROUPS) for suffix in group}
    groups: dict[tuple, list[str]] = {}
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        prefix, _, parent = prefix.rpartition(".")
        key = (prefix, member[f"{parent}.{suffix}"]) if f"{parent}.{suffix}" in member else (name,)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def shared_pass_quant(quant: dict) -> dict:
    """What a mixed_precision arm's 4-bit pass and sensitivity measurement depend on
    (fourbit.quantizers.sensitivity): its quant without the budget
    (``mixed_precision.extra_bits``), so arms that differ only there share them."""
    spec = {k: v for k, v in quant["mixed_precision"].items() if k != "extra_bits"}
    return {**quant, "mixed_precision": spec}


def plan_arm(matrices: Matrices, quant: dict, arm_name: str = "arm") -> ArmPlan:
    """Which matrices a fourbit (Hugging Face format) arm quantizes, which it keeps dense by
    its fallback policy, and whether it can run at all."""
    chosen = {name: shape for name, shape in matrices.linears.items()
              if quant["quantize_head"] or name != matrices.head}
    if quant.get("quantize_embedding"):
        chosen[matrices.embedding] = matrices.embedding_shape
    fmt, group = format_of(quant), quant["group_size"]
    # a 4-bit table is stored in its own layout whatever the format (fourbit.formats.table)
    layout = {matrices.embedding: TABLE_LAYOUT} if quant.get("quantize_embedding") is True else {}
    misfits = {name: why for name, (n, k) in chosen.items()
               if (why := does_not_fit(layout.get(name, fmt), n, k, group))}
    if not misfits:
        return ArmPlan(chosen)
    policy = quant.get("fallback", "refuse")
    dense: set[str] = set()
    if policy == "dense":
        for siblings in sibling_groups(chosen):
            if any(name in misfits for name in siblings):
                dense.update(siblings)
    quantized = {name: shape for name, shape in chosen.items() if name not in dense}
    kept = {name: shape for name, shape in chosen.items() if name in dense}
    refusal = None
    if policy != "dense" or not quantized:
        fits = [g for g in allowed("group_size")
                if not any(does_not_fit(fmt, n, k, g) for n, k in chosen.values())]
        suggestion = (f"group sizes that fit every matrix: {', '.join(map(str, fits))}" if fits
                      else "no group size fits every matrix")
        lines = "\n    ".join(collapse(misfits, chosen)[:12])
        refusal = (
            f"arm {arm_name} ({quant['method']}, group_size {group}, format {fmt}): "
            f"{len(misfits)} of {len(chosen)} matrices do not fit:\n    {lines}\n  "
            + (f"{suggestion}; or set quant.fallback: dense to keep those unquantized"
               if policy != "dense" else f"{suggestion}, and fallback: dense would leave nothing quantized")
        )
    return ArmPlan(quantized, kept, misfits, refusal)


def llamacpp_fallbacks(matrices: Matrices, quant: dict) -> dict[str, str]:
    """The tensors llama-quantize will store in another type than the arm's mix asks for
    (by its own per-tensor fallback; not an error), with why."""
    every = {**matrices.linears, matrices.embedding: matrices.embedding_shape}
    chosen = {matrices.head: quant.get("output_tensor_type"),
              matrices.embedding: quant.get("token_embedding_type")}  # None: the mix decides
    fallbacks = {}
    for name, (_, k) in every.items():
        kind = chosen.get(name) or quant["type"]
        block = GGML_TYPE_BLOCK.get(kind.lower(), 1) if chosen.get(name) else GGUF_TYPES[kind].block
        if k % block:
            fallbacks[name] = f"K={k} is not a multiple of {block} ({kind}'s block)"
    return fallbacks


def collapse(reasons: Mapping[str, str], shapes: Mapping[str, tuple[int, int]]) -> list[str]:
    """One line per module and reason across layers: "model.layers.{0-29}.mlp.down_proj
    (N=576, K=1536): K=1536 is not ...", so 30 layers do not print 30 lines."""
    rows: dict[tuple, list[int]] = {}
    for name, why in reasons.items():
        match = re.fullmatch(rf"{re.escape(LAYER_PREFIX)}\.(\d+)\.(.+)", name)
        key = (match[2] if match else name, tuple(shapes[name]), why)
        rows.setdefault(key, []).append(int(match[1]) if match else -1)
    lines = []
    for (module, (n, k), why), layers in rows.items():
        name = module if layers == [-1] else f"{LAYER_PREFIX}.{_span(layers)}.{module}"
        lines.append(f"{name}: {why} (N={n}, K={k})")
    return lines


def _span(layers: list[int]) -> str:
    if len(layers) == 1:
        return str(layers[0])
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{{{layers[0]}-{layers[-1]}}}"
    return "{" + ",".join(map(str, layers)) + "}"
