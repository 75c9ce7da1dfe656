from fourbit.steps.fidelity import compare_arm
from fourbit.progress import setup_logging
from fourbit.inputs.sources import source_weights_sha256

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
# the sides the ppl jobs kept, for an engine that keeps them (get_fidelity_input)
sides = {side: snakemake.input.get(f"{side}_side") for side in ("arm", "baseline")}
compare_arm(
    snakemake.input.checkpoint,
    snakemake.input.baseline,
    snakemake.input.windows,
    snakemake.output.fidelity,
    dict(snakemake.params.engine),
    dict(snakemake.params.fidelity),
    threads=snakemake.threads,
    model_weights_sha256=source_weights_sha256(snakemake.input.source),
    sides=sides if sides["arm"] else None,
)
