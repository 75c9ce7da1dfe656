from pathlib import Path

from fourbit.steps.bench import BenchPair, bench_study
from fourbit.hashing import model_weights_sha256
from fourbit.progress import setup_logging
from fourbit.inputs.sources import MANIFEST

setup_logging(snakemake.log[0])
bench_study(
    [BenchPair(**pair) for pair in snakemake.params.pairs],
    dict(snakemake.params.bench),
    threads=snakemake.threads,
    model_weights_sha256=model_weights_sha256(Path(snakemake.input.source) / MANIFEST),
)
