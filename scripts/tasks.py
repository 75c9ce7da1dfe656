from fourbit.inputs.sources import source_weights_sha256
from fourbit.progress import setup_logging
from fourbit.steps.serve import ServedArm
from fourbit.steps.tasks import tasks_study

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
tasks_study(
    [ServedArm(**arm) for arm in snakemake.params.arms],
    dict(snakemake.params.tasks),
    dict(snakemake.params.serve),
    dict(snakemake.params.bench),
    out=snakemake.output.record,
    server_logs=snakemake.params.server_logs,
    threads=snakemake.threads,
    model_weights_sha256=source_weights_sha256(snakemake.input.source),
    control_tolerance=dict(snakemake.params.control_tolerance),
    positions=snakemake.params.positions,
    llamacpp_tools=snakemake.input.get("tools"),
)
