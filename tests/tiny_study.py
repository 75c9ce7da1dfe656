"""Snakemake on the tiny study (tests/workflow/tiny.yaml), for the workflow tier:
tests/test_workflow.py and tests/test_faults.py share one finished run of it
(conftest.py's ``finished_study``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "workflow" / "tiny.yaml"
SNAKEMAKE = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile")]


def command(workdir: Path, *args: str, config: Path = TINY) -> list[str]:
    return [*SNAKEMAKE, "--directory", str(workdir), "--configfile", str(config), "--cores", "2", *args]


def snakemake(workdir: Path, *args: str, config: Path = TINY, **run) -> subprocess.CompletedProcess:
    return subprocess.run(command(workdir, *args, config=config), capture_output=True, text=True,
                          timeout=900, **run)


def scheduled_jobs(output: str) -> dict[str, int]:
    """Job counts from Snakemake's 'Job stats' table of a dry run."""
    table = output.split("Job stats:")[1].split("\n\n")[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "total"}
