"""The result records steps write and the report reads, checked against one schema.

Each kind (ppl, fidelity, bench, arm, ...) is defined once, in
fourbit/schemas/records.schema.yaml. A producer writes through :func:`write`, which
refuses a record that lacks what readers rely on before anything lands on disk; the
report reads through :func:`check`, so a record from an older or foreign run is named
with the field it lacks instead of failing somewhere in the table.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jsonschema
import yaml

from fourbit.atomic import write_json

SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "records.schema.yaml"
KINDS = ("ppl", "fidelity", "bench", "serve", "tasks", "arm", "sensitivity")


class RecordError(ValueError):
    """A record that does not have what its kind promises its readers."""


@functools.cache
def _validator(kind: str) -> jsonschema.Draft202012Validator:
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r}; the kinds are {', '.join(KINDS)}")
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    return jsonschema.Draft202012Validator({**schema["$defs"][kind], "$defs": schema["$defs"]})


def check(kind: str, record: dict, where: str | os.PathLike) -> dict:
    """``record`` if it is a valid ``kind`` record; else RecordError naming ``where``,
    each field that is wrong, and what it should be."""
    errors = sorted(_validator(kind).iter_errors(record), key=lambda e: list(e.path))
    if errors:
        problems = "; ".join(
            f"{'.'.join(map(str, e.absolute_path)) or '(record)'}: {e.message}" for e in errors)
        raise RecordError(f"{where}: not a valid {kind} record ({problems}); "
                          f"the fields are defined in {SCHEMA_PATH.name}")
    return record


def write(kind: str, path: str | os.PathLike, record: dict) -> None:
    """Check, then write ``record`` atomically (a temporary name, then the rename)."""
    write_json(path, check(kind, record, path))
