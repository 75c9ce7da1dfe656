from fourbit.progress import setup_logging
from fourbit.steps.prepare import untie_head

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
untie_head(snakemake.input.model, snakemake.output.model)
