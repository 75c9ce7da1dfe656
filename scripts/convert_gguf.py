from fourbit.steps.llamacpp import convert_base
from fourbit.progress import setup_logging

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
convert_base(snakemake.input.model, snakemake.output.gguf, snakemake.output.storage, snakemake.input.tools)
