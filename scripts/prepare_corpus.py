from pathlib import Path

from fourbit.steps.prepare import prepare_corpus
from fourbit.progress import setup_logging

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
prepare_corpus(dict(snakemake.params.spec), Path(snakemake.output.manifest).parent)
