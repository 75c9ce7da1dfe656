"""An engine's settings as the workflow passes them, for tests that call engines directly."""

from __future__ import annotations

from fourbit.schema import block


def engine_settings(name: str, **given) -> dict:
    """{"name": name, **the study config's engines.<name> block}, with the schema's
    defaults filled exactly as config validation fills them (common.smk's
    engine_settings passes the same), so no test retypes a default."""
    return {"name": name, **block(f"engines.{name}", given)}
