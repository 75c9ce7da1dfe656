from fourbit.steps.evaluate import score_checkpoint
from fourbit.progress import setup_logging
from fourbit.inputs.sources import source_weights_sha256

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
weights = source_weights_sha256(snakemake.input.source)
# rules ppl, ppl_with_side: the arm as quantized, then its dense expansion; rules
# ppl_baseline, ppl_baseline_with_side: the baseline (get_ppl_caches names the forms). The
# *_with_side rules also name where the compared form's fidelity side goes, and the
# baseline's logits: its own job's output, an arm's job's input (get_baseline_kept).
baseline_logits = snakemake.output.get("dense_logits") or snakemake.input.get("baseline_logits")
for form, cache_root in snakemake.params.cache_roots.items():
    score_checkpoint(
        getattr(snakemake.input, form),
        snakemake.input.windows,
        getattr(snakemake.output, form),
        dict(snakemake.params.engine),
        threads=snakemake.threads,
        model_weights_sha256=weights,
        cache_root=cache_root,
        side_path=snakemake.output.get(f"{form}_side"),
        fidelity_settings=snakemake.params.get("fidelity"),
        baseline_logits=baseline_logits,
        baseline_side=snakemake.input.get("baseline_side"),
    )
