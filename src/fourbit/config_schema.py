"""The config schema (schemas/config.schema.yaml), read in one place below every layer.

fourbit.config validates studies with it. Code further down that checks a value the
config also constrains (a grid's group size, the plugin's kernel knob) reads the
allowed values from the schema's enum here, so each list has one home and the schema,
which fills every default, is also the one place that says what a setting may be.
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

# Inside the package, so an installed fourbit (not only this checkout) validates configs.
SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "config.schema.yaml"


@functools.cache
def _schema_text(path: Path) -> str:
    return Path(path).read_text()


def load_schema(path: Path = SCHEMA_PATH) -> dict:
    """The config schema, a fresh copy each call (validation fills defaults into what it
    checks, never into the schema, but callers may edit what they get)."""
    return yaml.safe_load(_schema_text(path))


@functools.cache
def allowed(name: str) -> tuple:
    """The values the schema's ``$defs.<name>`` enum allows, in its order."""
    return tuple(load_schema()["$defs"][name]["enum"])
