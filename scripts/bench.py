from fourbit.benchmark import BenchPair, bench_study
from fourbit.progress import setup_logging

setup_logging(snakemake.log[0])
bench_study(
    [BenchPair(**pair) for pair in snakemake.params.pairs],
    dict(snakemake.params.bench),
    threads=snakemake.threads,
)
