"""One module per rule file: workflow/rules/<name>.smk runs its rules' scripts
(scripts/<rule>.py), and each script calls one function of fourbit.steps.<name>
with the paths and settings the rule gives it. The README's "rule → script →
module" table lists them all. Step functions do a step's input and output; the
work itself is in the packages beside this one (inputs, checkpoints, quant,
formats, engines, bench, metrics, report).
"""
