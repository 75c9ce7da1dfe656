from fourbit.steps.evaluate import tokenize_windows
from fourbit.progress import setup_logging

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
tokenize_windows(
    snakemake.input.model,
    snakemake.input.evaluation,
    snakemake.output.windows,
    window=snakemake.params.window,
    max_windows=snakemake.params.max_windows,
)
