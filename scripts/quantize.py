from fourbit.progress import setup_logging
from fourbit.steps.quantize import quantize_checkpoint

four_bit = snakemake.input.get("four_bit")  # a mixed_precision arm's shared pass (rule sensitivity)
setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
quantize_checkpoint(
    snakemake.input.model,
    snakemake.output.checkpoint,
    snakemake.output.arm,
    dict(snakemake.params.arm),
    calibration_text=snakemake.input.get("calibration"),
    shared_pass=(four_bit, snakemake.input.sensitivity_record) if four_bit else None,
    threads=snakemake.threads,
)
