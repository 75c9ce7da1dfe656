"""Which architectures and tokenizers the installed vLLM and llama.cpp's converter read,
found where each lists them, so a model they cannot run stops the study before any job.

- vLLM: the causal-LM table of its model registry (``_TEXT_GENERATION_MODELS`` in
  vllm/model_executor/models/registry.py), read as source text: importing vLLM costs
  seconds at every DAG build.
- llama.cpp: the architectures its converter classes register
  (``@ModelBase.register("LlamaForCausalLM", ...)`` in convert_hf_to_gguf.py and its
  conversion/ package), and the BPE pre-tokenizers it recognises (the ``chkhsh`` table
  of ``get_vocab_base_pre``), read from the tree fourbit built (fourbit.llamacpp.build).

Nothing here imports torch, transformers or vLLM on the way to a yes.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import re
from hashlib import sha256
from pathlib import Path

from fourbit.versions import vllm_version

# get_vocab_base_pre's probe text, from this llama.cpp commit's conversion/base.py;
# converter_tokenizer_probe() reads it from the tree itself when the tree is there.
_CHKHSH = re.compile(r'if chkhsh == "([0-9a-f]{64})":\s*\n(?:\s*#.*\n)*\s*res = "([^"]+)"')
_REGISTER = re.compile(r"@(?:ModelBase|Model|TextModel)\.register\(([^)]*)\)")
_CHKTXT = re.compile(r"^\s*chktxt = (.+)$", re.M)


class Unsupported(ValueError):
    """The model's architecture or tokenizer is one an engine's toolchain cannot read."""


@functools.cache
def vllm_architectures() -> tuple[str, frozenset[str]]:
    """(vLLM's version, the causal-LM architectures its registry lists)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise Unsupported("vLLM is not installed in this environment; the study's vLLM engines need it")
    registry = Path(spec.submodule_search_locations[0]) / "model_executor" / "models" / "registry.py"
    for node in ast.parse(registry.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "_TEXT_GENERATION_MODELS":
            names = frozenset(k.value for k in node.value.keys if isinstance(k, ast.Constant))
            return vllm_version() or "(version unknown)", names
    raise Unsupported(f"{registry} has no _TEXT_GENERATION_MODELS table; fourbit cannot tell what vLLM runs")



@functools.cache
def llamacpp_architectures(tree: Path) -> frozenset[str]:
    """The Hugging Face architectures llama.cpp's converter at ``tree`` registers a class for."""
    files = [tree / "convert_hf_to_gguf.py", *sorted((tree / "conversion").glob("*.py"))]
    names: set[str] = set()
    for path in files:
        if path.is_file():
            for arguments in _REGISTER.findall(path.read_text()):
                names.update(re.findall(r'"([^"]+)"', arguments))
    return frozenset(names)


@functools.cache
def llamacpp_pre_tokenizers(tree: Path) -> tuple[str, dict[str, str]]:
    """(the probe text, {token ids hash: pre-tokenizer name}) of get_vocab_base_pre."""
    for path in [tree / "conversion" / "base.py", tree / "convert_hf_to_gguf.py"]:
        text = path.read_text() if path.is_file() else ""
        probe = _CHKTXT.search(text)
        if probe:
            return ast.literal_eval(probe[1]), dict(_CHKHSH.findall(text))
    raise Unsupported(f"{tree}: no get_vocab_base_pre with a chktxt probe; fourbit cannot check tokenizers")


def check_vllm(config: dict, engines: list[str]) -> None:
    """Raise naming the architecture unless vLLM's registry lists every one config.json names."""
    version, known = vllm_architectures()
    unknown = [a for a in config.get("architectures") or [] if a not in known]
    if unknown:
        raise Unsupported(
            f"model architecture {', '.join(unknown)} is not one vLLM {version} runs (its registry's "
            f"_TEXT_GENERATION_MODELS, {len(known)} entries, e.g. {_examples(known)}); "
            f"engines {', '.join(engines)} need it: use a model of a listed architecture or drop those engines"
        )


def check_llamacpp(config: dict, tree: Path, model_dir: Path | None) -> None:
    """Raise naming the architecture or the tokenizer unless llama.cpp's converter reads both.

    ``model_dir``: a folder with the model's tokenizer files before any job (a local
    path, or a Hub revision's snapshot; fourbit.inputs.sources.tokenizer_folder); None skips the
    tokenizer check (builtin and synthetic models get fourbit's own SentencePiece
    tokenizer, which the converter reads from tokenizer.model).
    """
    known = llamacpp_architectures(tree)
    unknown = [a for a in config.get("architectures") or [] if a not in known]
    if unknown:
        raise Unsupported(
            f"model architecture {', '.join(unknown)} is not one llama.cpp's converter ({tree}) registers "
            f"({len(known)} architectures, e.g. {_examples(known)}); "
            "drop the llamacpp engine and arms, or use a model of a registered architecture"
        )
    if model_dir is not None:
        check_tokenizer(model_dir, tree)


def _examples(known: frozenset[str]) -> str:
    """The Llama-layout architectures fourbit quantizes, where the list has them."""
    common = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
    return ", ".join(a for a in common if a in known) + ", ..."


def needs_pre_tokenizer_hash(model_dir: Path) -> bool:
    """Whether the converter identifies this tokenizer by hashing its token ids (its GPT-2
    path): not for a SentencePiece tokenizer.model, nor for a byte-fallback BPE (Llama's
    LlamaHfVocab path)."""
    tokenizer_json = model_dir / "tokenizer.json"
    if (model_dir / "tokenizer.model").is_file() or not tokenizer_json.is_file():
        return False
    model = json.loads(tokenizer_json.read_text()).get("model", {})
    return model.get("type") == "BPE" and not model.get("byte_fallback", False)


def check_tokenizer(model_dir: Path, tree: Path) -> None:
    if not needs_pre_tokenizer_hash(model_dir):
        return
    probe, known = llamacpp_pre_tokenizers(tree)
    digest = pre_tokenizer_hash(model_dir, probe, exact=False)
    if digest in known:
        return
    # The fast path (the tokenizers library) may differ from transformers' tokenizer in
    # the special tokens it adds; before refusing, hash exactly as the converter does.
    digest = pre_tokenizer_hash(model_dir, probe, exact=True)
    if digest not in known:
        names = sorted(set(known.values()))
        raise Unsupported(
            f"the tokenizer of {model_dir} is a BPE whose pre-tokenizer llama.cpp's converter does not "
            f"recognise (chkhsh {digest}; get_vocab_base_pre in {tree} knows {len(names)}: "
            f"{', '.join(names)}); drop the llamacpp engine and arms, or use a model whose "
            "tokenizer is one of those"
        )


def pre_tokenizer_hash(model_dir: Path, probe: str, *, exact: bool) -> str:
    """sha256 of str(token ids of ``probe``), as get_vocab_base_pre computes it."""
    if exact:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model_dir).encode(probe)
    else:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(probe).ids
    return sha256(str(ids).encode()).hexdigest()
