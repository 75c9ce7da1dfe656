from fourbit.steps.quantize import dequantize_checkpoint
from fourbit.progress import setup_logging

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
dequantize_checkpoint(snakemake.input.checkpoint, snakemake.output.checkpoint)
