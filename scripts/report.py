from fourbit.progress import setup_logging
from fourbit.steps.report import write_report

setup_logging(snakemake.log[0], disk_mb=snakemake.resources.disk_mb)
write_report(
    dict(snakemake.params.study),
    report_settings=dict(snakemake.params.report_settings),
    records=snakemake.params.records,
    arm_manifests=list(snakemake.input.arms),
    markdown_path=snakemake.output.markdown,
    table_path=snakemake.output.table,
    plot_paths={
        "quality_vs_bits": snakemake.output.quality_vs_bits,
        "quality_vs_decode": snakemake.output.quality_vs_decode,
        "frontier": snakemake.output.frontier,
        # the Serving section's, when the serve step runs (report.smk)
        # and the Task accuracy section's, when a task is enabled
        **{name: snakemake.output[name] for name in ("serving_throughput", "serving_pareto", "tasks_delta")
           if name in snakemake.output.keys()},
    },
    baseline_checkpoint=snakemake.input.model[0],
    gguf_base_storage=snakemake.input.get("gguf_base_storage"),
    training_path=snakemake.params.training,
    corpus_manifest=snakemake.input.corpus[0],
    serve_record=snakemake.input.get("serve"),
    tasks_record=snakemake.input.get("tasks"),
)
