from pathlib import Path

from fourbit.hashing import model_weights_sha256
from fourbit.steps.evaluate import score_checkpoint
from fourbit.progress import setup_logging
from fourbit.inputs.sources import MANIFEST

setup_logging(snakemake.log[0])
weights = model_weights_sha256(Path(snakemake.input.source) / MANIFEST)
# rule ppl: the arm as quantized, then its dense expansion; rule ppl_baseline: the baseline
for form, out in snakemake.output.items():
    score_checkpoint(
        getattr(snakemake.input, form),
        snakemake.input.windows,
        out,
        dict(snakemake.params.engine),
        threads=snakemake.threads,
        model_weights_sha256=weights,
        cache_root=snakemake.params.cache_roots[form],
        fidelity_side=dict(snakemake.params.fidelity_sides[form]),
    )
