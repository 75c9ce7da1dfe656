from fourbit.steps.llamacpp import quantize_arm
from fourbit.progress import setup_logging

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
quantize_arm(
    snakemake.input.gguf,
    snakemake.output.gguf,
    snakemake.output.arm,
    dict(snakemake.params.arm),
    snakemake.input.tools,
    threads=snakemake.threads,
    imatrix=snakemake.input.get("imatrix"),
    imatrix_record=snakemake.input.get("imatrix_record"),
)
