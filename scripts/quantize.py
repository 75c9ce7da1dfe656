from fourbit.progress import setup_logging
from fourbit.steps.quantize import quantize_checkpoint

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
quantize_checkpoint(
    snakemake.input.model,
    snakemake.output.checkpoint,
    snakemake.output.arm,
    dict(snakemake.params.arm),
    calibration_text=snakemake.input.get("calibration"),
    threads=snakemake.threads,
)
