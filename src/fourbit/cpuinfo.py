"""What Linux's /proc/cpuinfo says about this CPU, read in one place: its instruction-set
flags (which kernels can run, which build a cache holds) and its vendor (part of the
builtin model's id). The first processor's block stands for the machine: a node's
processors are one model."""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def first_processor(text: str | None = None) -> dict[str, str]:
    """The ``key: value`` lines of the first processor's block of /proc/cpuinfo (or of
    ``text``); {} where the file does not exist (not Linux)."""
    if text is None:
        if not CPUINFO.is_file():
            return {}
        text = CPUINFO.read_text()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # a blank line ends a processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def isa_flags(text: str | None = None) -> set[str]:
    """The instruction-set flags: x86 lists them under "flags", Arm under "Features"."""
    fields = first_processor(text)
    for key in ("flags", "Features"):
        if key in fields:
            return set(fields[key].split())
    source = "the text given" if text is not None else str(CPUINFO)
    raise ValueError(f"{source} has no 'flags' or 'Features' line: cannot tell this CPU's "
                     "instruction sets (a Linux /proc/cpuinfo has one)")


def vendor(text: str | None = None) -> str | None:
    """x86's vendor_id ("AuthenticAMD", "GenuineIntel"), or None where there is none."""
    return first_processor(text).get("vendor_id")
