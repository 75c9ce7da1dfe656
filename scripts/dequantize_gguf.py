from fourbit.steps.llamacpp import dequantize_arm
from fourbit.progress import setup_logging

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
dequantize_arm(snakemake.input.gguf, snakemake.output.gguf, snakemake.input.tools, threads=snakemake.threads)
