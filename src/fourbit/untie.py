"""Give the output head its own tensor, so it can be quantized on its own.

A tied model shares one matrix between the input embedding (a lookup: a few
hundred bytes per token) and the output head (a GEMM that reads the whole matrix
every decoded token). Leaving the head dense because it is "the embedding"
invalidated a whole round of the reference study; untying first makes the head
an ordinary linear layer for every quantizer.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from fourbit.atomic import atomic_dir
from fourbit.checkpoint import (
    load_tensors,
    module_name,
    read_config,
    skeleton,
    write_checkpoint,
)

log = logging.getLogger("fourbit")


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
