from fourbit.report.loading import record_paths

# What each record is (engine id, arm id, kind) is said here, not read back from its path.
REPORT_RECORDS = all_results()
# Before any job: the outputs still to write fit where they go, or the study is refused.
check_disk_space()


rule report:
    input:
        **baseline_storage_inputs(),
        **serving_report_input(),
        **tasks_report_input(),
        results=record_paths(REPORT_RECORDS),
        arms=expand(rules.quantize.output.arm, arm=STUDY.arms),
        corpus=expand(rules.prepare_corpus.output.manifest, corpus=CORPUS),
        model=expand(rules.untie_head.output.model, model=MODEL),
    output:
        **serving_report_plots(),
        **tasks_report_plots(),
        markdown=report(f"{RESULTS}/report.md", caption="../report/report.rst", category="Report"),
        table=report(f"{RESULTS}/report.tsv", caption="../report/table.rst", category="Report"),
        quality_vs_bits=report(
            f"{RESULTS}/report-quality-vs-bits.png",
            caption="../report/quality_vs_bits.rst",
            category="Plots",
        ),
        quality_vs_decode=report(
            f"{RESULTS}/report-quality-vs-decode.png",
            caption="../report/quality_vs_decode.rst",
            category="Plots",
        ),
        frontier=report(
            f"{RESULTS}/report-frontier.png",
            caption="../report/frontier.rst",
            category="Plots",
        ),
    log:
        f"{RESULTS}/logs/report.log",
    conda:
        "../../envs/fourbit.yaml"
    resources:
        mem_mb=2000,
        runtime=15,
        disk_mb=disk_need("records"),
    params:
        study=STUDY.summary(),
        report_settings=STUDY.config["report"],
        records=REPORT_RECORDS,
        training=f"{MODEL_DIR}/untied/training.json",
    script:
        "../../scripts/report.py"
