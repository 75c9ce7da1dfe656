from fourbit.progress import setup_logging
from fourbit.steps.prepare import fetch_model

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
fetch_model(dict(snakemake.params.spec), snakemake.output.model, snakemake.params.corpus_dir,
            snakemake.threads, model_id=snakemake.wildcards.model,
            corpus_id=snakemake.params.corpus_id, planned=snakemake.input.get("planned"))
