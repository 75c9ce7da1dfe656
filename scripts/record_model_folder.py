from fourbit.progress import setup_logging
from fourbit.steps.prepare import record_model_folder

setup_logging(snakemake.log[0])
record_model_folder(dict(snakemake.params.state), snakemake.output.planned)
