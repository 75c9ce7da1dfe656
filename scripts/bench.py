from fourbit.bench import write_not_measured
from fourbit.progress import setup_logging

setup_logging(snakemake.log[0])
write_not_measured(snakemake.output.bench, dict(snakemake.params.engine))
