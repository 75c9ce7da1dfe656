"""Throughput (prefill pp512, decode tg128): not measured in this version.

The `bench` rule exists so the DAG and the report's columns are in place; until
the benchmark lands it writes a record that says plainly that nothing was
measured, and the report prints that instead of a number.
"""

from __future__ import annotations

import os

from fourbit.atomic import write_json

NOT_MEASURED = "throughput is not measured yet: the bench step is a placeholder in this version"


def write_not_measured(out_path: str | os.PathLike, engine_settings: dict) -> None:
    write_json(out_path, {"measured": False, "reason": NOT_MEASURED, "engine": engine_settings})
