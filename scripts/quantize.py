from fourbit.progress import setup_logging
from fourbit.steps.quantize import quantize_checkpoint

shared_pass = snakemake.input.get("shared_pass")  # a mixed_precision arm's (rule sensitivity)
setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
quantize_checkpoint(
    snakemake.input.model,
    snakemake.output.checkpoint,
    snakemake.output.arm,
    dict(snakemake.params.arm),
    calibration_text=snakemake.input.get("calibration"),
    shared_pass=(shared_pass, snakemake.input.sensitivity) if shared_pass else None,
    threads=snakemake.threads,
)
