"""A model folder checked before any job uses it: its weight files' headers, their tensors
against config.json, its tokenizer (or the one the study names in model.tokenizer).

Where each check runs:
- a ``path`` source: when the workflow builds its DAG (fourbit.config.Study.from_config,
  through fourbit.inputs.sources.check_local_folder), and again in the download job
  (fourbit.steps.prepare.fetch_model) on the host that runs it, a cluster node too, after
  the folder was compared with what it held when the DAG was built
  (fourbit.inputs.folder_state);
- an ``hf`` source: in the download job, on the downloaded snapshot, before the manifest
  is written (there is no folder before that job);
- ``builtin`` and ``synthetic``: in the download job on the folder fourbit has just built,
  which costs a header read and a tokenizer load, and stops a builder that drifted from
  what the later steps read.

The checks cost the headers (kilobytes) and one tokenizer load: seconds for a real model.
The tensor names are the Llama layout every model_type fourbit quantizes shares
(fourbit.quantizers.shapes.LLAMA_LAYOUT): model.embed_tokens, model.layers.N.self_attn.
{q,k,v,o}_proj, model.layers.N.mlp.{gate,up,down}_proj, their norms, model.norm, lm_head.
Nothing here imports torch.
"""

from __future__ import annotations

import re
from pathlib import Path

from fourbit.inputs import tokenizer_files
from fourbit.inputs.weight_headers import FolderError, Tensor, read_tensors
from fourbit.quantizers import shapes

__all__ = ["FolderError", "check_folder", "check_weights"]
# Norm weights every Llama-layout decoder stores, one vector of hidden_size each.
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
FINAL_NORM = "model.norm"
SAME_MODEL = "use the config.json that came with these weights"
_LAYER = re.compile(rf"{re.escape(shapes.LAYER_PREFIX)}\.(\d+)\.")


def check_folder(folder: str | Path, config: dict, *, tokenizer: str | Path | None = None,
                 load_tokenizer: bool = False) -> None:
    """FolderError naming the file and the fix unless ``folder``'s weights agree with
    ``config`` (its config.json) and its tokenizer loads and fits the embedding.
    ``tokenizer``: the folder whose tokenizer the study names (model.tokenizer), checked
    in place of the model folder's own. ``load_tokenizer``: also load it with
    transformers' AutoTokenizer, as the evaluation does (seconds of imports: for a job,
    not for the DAG)."""
    folder = Path(folder)
    tensors = read_tensors(folder)
    rows = check_weights(folder, tensors, config)
    tokenizer_files.check_tokenizer(Path(tokenizer or folder), rows, load=load_tokenizer,
                                    named=tokenizer is not None)


def _tied(config: dict) -> bool:
    """config.json's tie_word_embeddings; absent, False: the default of transformers'
    LlamaConfig, MistralConfig, Qwen2Config and Qwen3Config (tests/test_model_folder.py)."""
    return bool(config.get("tie_word_embeddings", False))


def _expected(config: dict, matrices: shapes.Matrices) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, the config.json values that give it)} of what the weights hold."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    dim = f"head_dim {head_dim}"
    if not config.get("head_dim"):
        dim += " = hidden_size / num_attention_heads"
    why = {
        "self_attn.q_proj": f"num_attention_heads {heads} x {dim}, hidden_size {hidden}",
        "self_attn.k_proj": f"num_key_value_heads {kv_heads} x {dim}, hidden_size {hidden}",
        "self_attn.v_proj": f"num_key_value_heads {kv_heads} x {dim}, hidden_size {hidden}",
        "self_attn.o_proj": f"hidden_size {hidden}, num_attention_heads {heads} x {dim}",
        "mlp.gate_proj": f"intermediate_size {inter}, hidden_size {hidden}",
        "mlp.up_proj": f"intermediate_size {inter}, hidden_size {hidden}",
        "mlp.down_proj": f"hidden_size {hidden}, intermediate_size {inter}",
    }
    vocab = f"vocab_size {config['vocab_size']}, hidden_size {hidden}"
    expected = {f"{matrices.embedding}.weight": (matrices.embedding_shape, vocab)}
    for name, shape in matrices.linears.items():
        if name == matrices.head:
            if not _tied(config):
                expected[f"{name}.weight"] = (shape, vocab)
            continue
        expected[f"{name}.weight"] = (shape, why[name.split(".", 3)[3]])
        if name.endswith("down_proj"):  # once per layer, after its linears: its norms
            layer = name.rsplit(".", 2)[0]
            for norm in LAYER_NORMS:
                expected[f"{layer}.{norm}.weight"] = ((hidden,), f"hidden_size {hidden}")
    expected[f"{FINAL_NORM}.weight"] = ((hidden,), f"hidden_size {hidden}")
    return expected


def check_weights(folder: Path, tensors: dict[str, Tensor], config: dict) -> int:
    """FolderError unless the tensors are the ones config.json describes, in its shapes;
    the embedding's rows (the largest token id the model can take, plus one)."""
    try:
        matrices = shapes.matrices_from_config(config)
    except shapes.ShapeError as error:
        raise FolderError(f"{folder / 'config.json'}: {error}") from None
    expected = _expected(config, matrices)
    embedding = f"{matrices.embedding}.weight"
    _check_vocabulary(folder, tensors, config, embedding)
    _check_head(folder, tensors, config, f"{matrices.head}.weight", embedding)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise FolderError(
            f"{_files(folder, tensors)} no {', '.join(missing[:4])}"
            f"{f' nor {len(missing) - 4} more' if len(missing) > 4 else ''}, which config.json "
            f"calls for ({len(missing)} of its {len(expected)} tensors; num_hidden_layers "
            f"{config['num_hidden_layers']}); the weights and config.json are of different models "
            f"or a weight file is missing: {SAME_MODEL}")
    layers = config["num_hidden_layers"]
    indices = {int(m[1]) for name in tensors if (m := _LAYER.match(name))}
    extra = sorted(i for i in indices if i >= layers)
    if extra:
        raise FolderError(
            f"{_files(folder, tensors)} decoder layer {extra[0]} ({shapes.LAYER_PREFIX}.{extra[0]}.*"
            f"{f', and {len(extra) - 1} more layers' if len(extra) > 1 else ''}), but config.json "
            f"says num_hidden_layers {layers}; {SAME_MODEL}")
    for name, (shape, why) in expected.items():
        if tensors[name].shape != shape:
            raise FolderError(
                f"{folder / tensors[name].file}: tensor {name} has shape {list(tensors[name].shape)}, "
                f"but config.json ({why}) gives {list(shape)}; {SAME_MODEL}")
    return tensors[embedding].shape[0]


def _files(folder: Path, tensors: dict[str, Tensor]) -> str:
    """The weight files, as the subject of a sentence ("<folder>/model.safetensors holds")."""
    files = sorted({t.file for t in tensors.values()})
    if len(files) == 1:
        return f"{folder / files[0]} holds"
    return f"the weight files of {folder} ({', '.join(files)}) hold"


def _check_vocabulary(folder: Path, tensors: dict[str, Tensor], config: dict,
                      embedding: str) -> None:
    """A vocabulary larger than the embedding: ids past its last row would index nothing."""
    vocab = config["vocab_size"]
    shape = tensors[embedding].shape if embedding in tensors else ()
    if len(shape) == 2 and shape[0] < vocab:
        rows = shape[0]
        raise FolderError(
            f"{folder / 'config.json'}: vocab_size {vocab} is larger than the embedding {embedding} "
            f"in {tensors[embedding].file}, which has {rows} rows: token ids {rows}..{vocab - 1} "
            f"would have no embedding; set vocab_size to {rows} if the weights are right, or "
            f"{SAME_MODEL}")


def _check_head(folder: Path, tensors: dict[str, Tensor], config: dict, head: str,
                embedding: str) -> None:
    """lm_head.weight is stored iff config.json unties the head, as fourbit's untie step
    expects: it copies the embedding into a tied model's head, and links an untied one."""
    setting = config.get("tie_word_embeddings")
    said = f"tie_word_embeddings: {str(setting).lower()}" if setting is not None else \
        "no tie_word_embeddings (false for this model_type)"
    if _tied(config) and head in tensors:
        raise FolderError(
            f"{folder / 'config.json'} says tie_word_embeddings: true, yet {tensors[head].file} "
            f"holds {head}, which fourbit's untie step would replace by a copy of {embedding} (as "
            f"transformers does when it loads a tied model): set tie_word_embeddings: false if "
            f"{head} is the model's own head, or remove it from the weights if it is a copy")
    if not _tied(config) and head not in tensors:
        raise FolderError(
            f"{folder / 'config.json'} has {said}, so the head is its own matrix, but no weight "
            f"file holds {head} (transformers would give it random weights): set "
            "tie_word_embeddings: true if the head shares the embedding, or add the head's weights")
