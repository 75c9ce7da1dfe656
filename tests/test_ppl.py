"""The perplexity step's record (fourbit.steps.evaluate.score_checkpoint), on the reference engine."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import save_tiny_llama
from engine_settings import engine_settings

from fourbit.records import RecordError
from fourbit.steps.evaluate import score_checkpoint

REFERENCE = engine_settings("reference", threads=1)
WEIGHTS = "ab" * 32  # the source model's model_weights_sha256, carried into the record
TOKENS = "cd" * 32  # the windows file's token_ids_sha256


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppl")
    save_tiny_llama(root / "model", tied=False, layers=1)
    windows = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0)).tolist()
    (root / "windows.json").write_text(json.dumps(
        {"definition": "test windows", "windows": windows, "token_ids_sha256": TOKENS}))
    return root


def test_the_record_carries_the_weights_hash_and_its_numbers(scored, tmp_path):
    out = tmp_path / "dense.ppl.json"
    record = score_checkpoint(scored / "model", scored / "windows.json", out, REFERENCE,
                              threads=1, model_weights_sha256=WEIGHTS,
                              cache_root=tmp_path / "ppl.cache")
    assert json.loads(out.read_text()) == record
    assert record["model_weights_sha256"] == WEIGHTS and record["token_ids_sha256"] == TOKENS
    assert record["window_tokens"] == [15, 15] and record["tokens"] == 30
    assert record["ppl"] == pytest.approx(math.exp(sum(record["window_nll_sum"]) / 30))


def test_a_weights_hash_that_is_not_one_is_refused_before_scoring(scored, tmp_path):
    with pytest.raises(ValueError, match="model_weights_sha256 must be a sha256 in lowercase hex"):
        score_checkpoint(scored / "model", scored / "windows.json", tmp_path / "x.ppl.json",
                         REFERENCE, threads=1, model_weights_sha256="results/model/source",
                         cache_root=tmp_path / "ppl.cache")
    assert not (tmp_path / "x.ppl.json").exists()


def test_a_record_readers_could_not_use_is_refused_before_it_is_written(scored, tmp_path):
    """The record goes through fourbit.records.write: one its schema refuses never lands."""
    windows = json.loads((scored / "windows.json").read_text())
    (tmp_path / "windows.json").write_text(json.dumps({**windows, "token_ids_sha256": "test"}))
    with pytest.raises(RecordError, match="token_ids_sha256"):
        score_checkpoint(scored / "model", tmp_path / "windows.json", tmp_path / "x.ppl.json",
                         REFERENCE, threads=1, model_weights_sha256=WEIGHTS,
                         cache_root=tmp_path / "ppl.cache")
    assert not (tmp_path / "x.ppl.json").exists()


def test_an_engine_that_keeps_no_fidelity_side_is_given_none(scored, tmp_path):
    with pytest.raises(ValueError, match="engine reference keeps no fidelity side"):
        score_checkpoint(scored / "model", scored / "windows.json", tmp_path / "x.ppl.json",
                         REFERENCE, threads=1, model_weights_sha256=WEIGHTS,
                         cache_root=tmp_path / "ppl.cache", side_path=tmp_path / "x.side.json")
    assert not (tmp_path / "x.ppl.json").exists() and not (tmp_path / "x.side.json").exists()
