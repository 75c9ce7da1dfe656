from pathlib import Path

from fourbit.hashing import model_weights_sha256
from fourbit.steps.evaluate import score_checkpoint
from fourbit.progress import setup_logging
from fourbit.inputs.sources import MANIFEST

setup_logging(snakemake.log[0])
score_checkpoint(
    snakemake.input.checkpoint,
    snakemake.input.windows,
    snakemake.output.ppl,
    dict(snakemake.params.engine),
    threads=snakemake.threads,
    model_weights_sha256=model_weights_sha256(Path(snakemake.input.source) / MANIFEST),
    cache_root=snakemake.params.cache_root,
    fidelity_side=dict(snakemake.params.fidelity_side),
)
