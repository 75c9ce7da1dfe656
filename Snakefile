# fourbit: which 4-bit CPU build of a causal LM to ship, measured end to end.
# This file only declares; the rules live in workflow/rules/, the logic in src/fourbit/.
from snakemake.utils import min_version

min_version("9.0")


# config.yaml is the study unless --configfile names another; then that file is
# the whole study (Snakemake would otherwise merge the two, engines included).
if not workflow.config_settings.configfiles:

    configfile: "config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/prepare.smk"
include: "workflow/rules/quantize.smk"
include: "workflow/rules/llamacpp.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/fidelity.smk"
include: "workflow/rules/bench.smk"
include: "workflow/rules/serve.smk"


# Task accuracy runs model-written code: its rule exists only when the study enables a task.
if TASKS:

    include: "workflow/rules/tasks.smk"


include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        f"{RESULTS}/report.md",
