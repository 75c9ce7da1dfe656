"""Provenance of a measurement: host, ISA, placement, versions, speed-relevant settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fourbit.bench.provenance import ISA_FLAGS_OF_INTEREST, provenance


def test_records_host_placement_and_versions():
    record = provenance(threads=2, cores=[1, 0])
    json.dumps(record)  # a plain, JSON-able dict
    assert record["cores"] == [0, 1] and record["threads"] == 2
    assert record["affinity"] == sorted(os.sched_getaffinity(0))
    assert set(record["isa"]) == set(ISA_FLAGS_OF_INTEREST)
    assert all(isinstance(v, bool) for v in record["isa"].values())
    assert record["cpu_model"]
    assert len(record["load_average"]) == 3
    assert record["versions"]["torch"].startswith("2.")
    assert {"numpy", "safetensors", "sentencepiece", "snakemake"} <= record["versions"].keys()
    assert record["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))


def test_keeps_speed_switches_drops_the_rest_and_redacts_credentials(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor")
    monkeypatch.setenv("VLLM_API_KEY", "do-not-record")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    env = provenance(threads=1, cores=[0])["env"]
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/inductor"
    assert env["VLLM_API_KEY"] == "<redacted>"
    assert "UNRELATED_SETTING" not in env


def test_reads_versions_without_importing_the_engines():
    probe = (
        "import sys; from fourbit.bench.provenance import provenance; provenance(1, [0]); "
        "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
