"""Task accuracy: does a build still solve the problems its model solves?

fourbit.tasks.registry holds the task sets (importing this package registers the shipped
ones and those installed packages add through the fourbit.tasks entry points), fourbit.tasks.preflight checks the enabled ones before any job,
fourbit.tasks.sandbox runs model-written code and fourbit.tasks.scoring checks a set of
completions with it; the statistics are in fourbit.metrics.passrate.
"""

from fourbit.tasks import humaneval  # noqa: F401 - registers HumanEval
from fourbit.tasks.registry import load_plugins

load_plugins()  # a user's task sets (registry's docstring)
