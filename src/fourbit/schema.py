"""The config schema (src/fourbit/schemas/config.schema.yaml) and validation against it.

The schema is the only source of defaults: validating a block fills them in, so every
reader of a block, the workflow's config check and the library functions a caller gives a
partial block, sees the same values. Errors name the key, what is wrong and what is allowed.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from fourbit.hashing import canonical_json
# Inside the package, so an installed fourbit (not only this checkout) validates configs.
SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "config.schema.yaml"

class ConfigError(ValueError):
    """A config problem, reported before any job runs."""


@functools.cache
def _schema_text(path: Path) -> str:
    return Path(path).read_text()


def load_schema(path: Path = SCHEMA_PATH) -> dict:
    """The config schema, a fresh copy each call (validation fills defaults into what it
    checks, never into the schema, but callers may edit what they get)."""
    return yaml.safe_load(_schema_text(path))


def block(name: str, given: Mapping[str, Any] | None = None) -> dict:
    """One block of the config (``name`` a dotted path of the schema's properties, e.g.
    "bench", "fidelity", "engines.vllm"), validated and with the schema's defaults filled:
    the one way a library function gets settings a caller may have left out, so the schema
    stays the only source of defaults. Raises ConfigError naming the key and the fix."""
    schema = load_schema()
    node = schema
    for part in name.split("."):
        node = node["properties"][part]
        if "$ref" in node:
            node = _resolve(schema, node["$ref"])
    filled = copy.deepcopy(dict(given or {}))
    validate(filled, {**node, "$defs": schema["$defs"]}, name)
    return sorted_keys(filled)


def _with_defaults(validator_class):
    """A validator that also fills in ``default`` values (the jsonschema recipe)."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema:
                    instance.setdefault(name, copy.deepcopy(subschema["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_Validator = _with_defaults(jsonschema.Draft202012Validator)


def validate(instance: Any, schema: dict, where: str) -> None:
    """Check ``instance`` against ``schema``, filling the schema's defaults into it; a
    ConfigError lists every failure by its key under ``where``, with what is allowed."""
    errors = sorted(_Validator(schema).iter_errors(instance), key=lambda e: list(e.path))
    if errors:
        lines = []
        for error in errors:
            path = ".".join(str(p) for p in error.absolute_path) or "(top level)"
            hint = ""
            context = _message_of(error, schema)
            if context:
                hint = f" ({context})"
            elif error.validator == "additionalProperties":
                allowed = sorted(error.schema.get("properties", {}))
                hint = f"; allowed keys: {', '.join(allowed)}"
            elif error.validator in ("enum", "const"):
                allowed = error.schema.get("enum", [error.schema.get("const")])
                hint = f"; allowed: {', '.join(map(str, allowed))}"
            if not context and error.path and "description" in error.schema:
                hint += f" ({error.schema['description'].strip()})"
            lines.append(f"{where}{'.' + path if path != '(top level)' else ''}: {error.message}{hint}")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines))


def _message_of(error, root: dict) -> str | None:
    """The deepest ``errorMessage`` written in the schema on the way to the failed rule."""
    message, node = None, root
    for step in error.absolute_schema_path:
        if not isinstance(node, (dict, list)):
            break
        if isinstance(node, dict) and step not in node and "$ref" in node:
            node = _resolve(root, node["$ref"])  # the schema path steps through refs silently
        node = node[step]
        if isinstance(node, dict) and "errorMessage" in node:
            message = node["errorMessage"]
    return message


def _resolve(root: dict, ref: str) -> dict:
    """A local "#/$defs/name" reference of ``root``."""
    node = root
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def canonical_quant(quant: dict, schema: dict, where: str = "quant") -> dict:
    """Validate one arm's quant config against its method's schema; fill defaults."""
    methods = schema["$defs"]["methods"]
    method = quant.get("method")
    if method not in methods:
        raise ConfigError(
            f"{where}.method: {method!r} is not a known quantization method; "
            f"allowed: {', '.join(sorted(methods))}"
        )
    filled = copy.deepcopy(quant)
    validate(filled, {**methods[method], "$defs": schema["$defs"]}, where)
    mixed = filled.get("mixed_precision")
    if mixed and mixed["windows"] > filled["calibration"]["heldout"]:
        raise ConfigError(
            f"{where}.mixed_precision.windows: {mixed['windows']} windows, but calibration.heldout "
            f"draws only {filled['calibration']['heldout']}; lower windows or raise heldout"
        )
    if mixed:  # a set of grids: [8, 6] and [6, 8] are one arm
        mixed["grids"] = sorted(mixed["grids"])
    return sorted_keys(filled)


def sorted_keys(value: Any) -> Any:
    """Keys sorted all the way down: Snakemake compares rule params by their text,
    and a reordered (but equal) config must not rerun anything."""
    return json.loads(canonical_json(value))


@functools.cache
def allowed(name: str) -> tuple:
    """The values the schema's ``$defs.<name>`` enum allows, in its order: the one list of
    them, for code below the config that checks a value the config also constrains (a
    grid's group size, the plugin's kernel)."""
    return tuple(load_schema()["$defs"][name]["enum"])
