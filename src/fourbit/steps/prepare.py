"""workflow/rules/prepare.smk: the study's inputs, one function per rule.

- prepare_corpus: the corpus's train / calibration / evaluation splits plus a manifest
  that says exactly what was taken (fourbit.inputs.corpus selects the documents).
- record_model_folder: the model's local folders as the DAG's build found them
  (fourbit.inputs.folder_state.local_state), for the download job to compare with; a local
  rule, so written where the workflow started, whichever host runs the download.
- fetch_model (rule download): the model into results/<model id>/source, with
  fourbit-source.json holding the content hash of every weight file (the weights'
  identity every downstream record carries; fourbit.inputs.sources fetches), once the
  folder passes fourbit.inputs.model_folder's checks on the host that runs the job.
- untie_head: the output head given its own tensor, so it can be quantized on its own.
  A tied model shares one matrix between the input embedding (a lookup: a few
  hundred bytes per token) and the output head (a GEMM that reads the whole matrix
  every decoded token). Leaving the head dense because it is "the embedding"
  invalidated a whole round of the reference study; untying first makes the head
  an ordinary linear layer for every quantizer.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from fourbit.atomic import atomic_dir, write_json
from fourbit.config import model_identity
from fourbit.schema import block
from fourbit.checkpoints.hf import (
    load_tensors,
    module_name,
    read_config,
    skeleton,
    weight_files,
    write_checkpoint,
)
from fourbit.hashing import file_sha256
from fourbit.inputs import corpus, folder_state, model_folder, sources, tokenizer_files

log = logging.getLogger("fourbit")


def prepare_corpus(spec: dict, out_dir: Path) -> dict:
    """Write the three split files and manifest.json into ``out_dir``; return the manifest."""
    selection = corpus.select(spec)
    split_texts = {split: corpus.join_documents(selection.splits[split]) for split in corpus.SPLITS}
    manifest = corpus.manifest(spec, selection, split_texts)
    with atomic_dir(out_dir) as temp:
        for split, text in split_texts.items():
            # newline="" keeps the documents' own line endings byte for byte.
            with open(temp / f"{split}.txt", "w", encoding="utf-8", newline="") as f:
                f.write(text)
        (temp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    log.info(
        "corpus %s: %s",
        spec["source"],
        ", ".join(f"{s} {manifest['splits'][s]['bytes']:,} bytes" for s in corpus.SPLITS),
    )
    return manifest


def record_model_folder(state: dict, out: str | os.PathLike) -> None:
    """Write ``state`` (fourbit.inputs.folder_state.local_state, taken when the DAG was built)
    to ``out``, where the download job and every job on a cluster node compare the
    model's local folders with it."""
    write_json(out, state)


def fetch_model(spec: dict, target: str | os.PathLike, corpus_dir: str | os.PathLike, threads: int,
                *, model_id: str | None = None, corpus_id: str | None = None,
                planned: str | os.PathLike | None = None) -> None:
    """The model ``spec`` names (the config's model block, its defaults filled here if a
    caller left them out), written to ``target`` with a manifest of its weights' hashes,
    once the folder passes fourbit.inputs.model_folder's checks (here, on the host that
    runs the job, whatever the source).
    ``model_id``, ``corpus_id``: the ids the study computed where the workflow started
    (the workflow passes both; a direct call may leave them out); refused before any work
    if this host would make another model id (a builtin model trained on another CPU
    vendor or other library versions, as on a cluster node unlike the submitting host).
    ``planned``: the record_model_folder file, the model's local folders as the DAG's
    build found them; refused, naming each file that changed since."""
    spec = block("model", spec)
    if planned is not None:
        folder_state.refuse_changes(spec, json.loads(Path(planned).read_text()),
                                    f"recorded in {planned} when the DAG was built")
    if model_id is not None and (here := model_identity(spec, corpus_id)) != model_id:
        raise ValueError(
            f"this host would make model {here}, not the study's {model_id}: the id holds "
            f"what sets the weights ({_what_sets_the_weights(spec)}), computed where the "
            "workflow started; run this job on a host like that one (same CPU vendor, same "
            "environment), or start the workflow here"
        )
    source = sources.source_of(spec)
    with atomic_dir(target) as folder:
        source.fetch(spec, folder, Path(corpus_dir), threads)
        _check_fetched(spec, folder, Path(target))
        weights = {p.name: file_sha256(p) for p in weight_files(folder)}
        manifest = {"spec": spec, "weights_sha256": weights}
        (folder / sources.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _check_fetched(spec: dict, folder: Path, target: Path) -> None:
    """fourbit.inputs.model_folder's checks on the fetched folder, whose messages name the
    files where they came from (the local folder, the Hub revision, or the target) rather
    than the temporary folder they are linked into, which is gone once the job fails."""
    where = {"path": spec.get("path"), "hf": f"{spec.get('repo_id')}@{spec.get('revision')}"}
    try:
        model_folder.check_folder(folder, read_config(folder), load_tokenizer=True)
    except model_folder.FolderError as error:
        named = str(error)
        for name in tokenizer_files.FILES if spec.get("tokenizer") else ():
            named = named.replace(str(folder / name), str(Path(spec["tokenizer"]) / name))
        named = named.replace(str(folder), where.get(spec["source"]) or str(target))
        raise model_folder.FolderError(named) from None


def _what_sets_the_weights(spec: dict) -> str:
    if spec["source"] == "path":
        weights = sorted(Path(spec["path"]).glob("*.safetensors"))
        sizes = ", ".join(f"{path.name} {path.stat().st_size:,} bytes" for path in weights)
        return (f"for a model folder its config.json and the size of each weight file, here "
                f"{sizes}: the folder changed since the workflow started")
    if spec["source"] != "builtin":
        return "the model block"
    from fourbit.inputs.builtin_model import training_identity

    identity = training_identity(spec["preset"], spec.get("train", {}))
    versions = ", ".join(f"{name} {v}" for name, v in sorted(identity["versions"].items()))
    return f"for the builtin model the CPU vendor, here {identity['cpu_vendor']}, and {versions}"


def untie_head(source: str | os.PathLike, target: str | os.PathLike) -> None:
    model = skeleton(source)
    embed_name = module_name(model, model.get_input_embeddings()) + ".weight"
    head_name = module_name(model, model.get_output_embeddings()) + ".weight"
    config = read_config(source)
    tied = model.config.tie_word_embeddings
    with atomic_dir(target) as folder:
        if not tied:
            log.info("%s: head already untied (%s); linking files, not copying", source, head_name)
            for path in Path(source).iterdir():
                os.symlink(path.resolve(), folder / path.name)
            return
        tensors = load_tensors(source)
        if embed_name not in tensors:
            raise ValueError(f"{source}: tied model without its embedding tensor {embed_name}")
        # [vocab, hidden] -> a separate copy with the same values, bit for bit.
        tensors[head_name] = tensors[embed_name].clone()
        config["tie_word_embeddings"] = False
        write_checkpoint(folder, tensors, config, copy_from=source)
        log.info("%s: untied %s from %s %s", source, head_name, embed_name, tuple(tensors[head_name].shape))
