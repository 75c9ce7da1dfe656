from fourbit.benchmark import bench_arm
from fourbit.progress import setup_logging

setup_logging(snakemake.log[0])
bench_arm(
    snakemake.input.checkpoint,
    snakemake.input.baseline,
    dict(snakemake.params.engine),
    dict(snakemake.params.bench),
    snakemake.output.bench,
    threads=snakemake.threads,
)
