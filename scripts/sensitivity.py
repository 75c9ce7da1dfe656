from fourbit.progress import setup_logging
from fourbit.steps.quantize import measure_sensitivity

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
measure_sensitivity(
    snakemake.input.model,
    snakemake.output.checkpoint,
    snakemake.output.record,
    dict(snakemake.params.sensitivity),
    calibration_text=snakemake.input.calibration,
    threads=snakemake.threads,
)
