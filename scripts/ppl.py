from fourbit.ppl import score_checkpoint
from fourbit.progress import setup_logging

setup_logging(snakemake.log[0])
score_checkpoint(
    snakemake.input.checkpoint,
    snakemake.input.windows,
    snakemake.output.ppl,
    dict(snakemake.params.engine),
    threads=snakemake.threads,
)
