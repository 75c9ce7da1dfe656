from fourbit.steps.bench import BenchPair, bench_study
from fourbit.progress import setup_logging
from fourbit.inputs.sources import source_weights_sha256

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
bench_study(
    [BenchPair(**pair) for pair in snakemake.params.pairs],
    dict(snakemake.params.bench),
    threads=snakemake.threads,
    model_weights_sha256=source_weights_sha256(snakemake.input.source),
    control_tolerance=dict(snakemake.params.control_tolerance),
)
