from fourbit.steps.llamacpp import build_tools
from fourbit.progress import setup_logging

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
build_tools(snakemake.output.tools, jobs=snakemake.threads)
