from fourbit.progress import setup_logging
from fourbit.steps.llamacpp import importance_matrix

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
importance_matrix(
    snakemake.input.gguf,
    snakemake.input.model,
    snakemake.input.calibration,
    snakemake.output.imatrix,
    snakemake.output.record,
    dict(snakemake.params.calibration),
    snakemake.input.tools,
    threads=snakemake.threads,
)
