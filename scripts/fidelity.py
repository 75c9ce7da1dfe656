from fourbit.fidelity import compare_arm
from fourbit.progress import setup_logging

setup_logging(snakemake.log[0])
compare_arm(
    snakemake.input.checkpoint,
    snakemake.input.baseline,
    snakemake.input.windows,
    snakemake.output.fidelity,
    dict(snakemake.params.engine),
    dict(snakemake.params.fidelity),
    threads=snakemake.threads,
    text_path=snakemake.input.text,
)
