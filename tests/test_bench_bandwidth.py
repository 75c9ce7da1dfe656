"""The triad bandwidth measurement and the decode roofline."""

from __future__ import annotations

import pytest
import torch

from fourbit.bench.bandwidth import (
    MIN_ARRAY_BYTES,
    _parse_size,
    decode_roofline,
    default_array_bytes,
    last_level_cache_bytes,
    main,
    measure_bandwidth,
)


def test_cache_sizes_from_sysfs_are_parsed():
    assert _parse_size("32768K") == 32 << 20
    assert _parse_size("1M") == 1 << 20
    assert _parse_size("512") == 512
    assert last_level_cache_bytes() >= 1 << 20
    assert default_array_bytes() >= max(MIN_ARRAY_BYTES, 8 * last_level_cache_bytes())


def test_arrays_that_fit_in_cache_are_refused():
    with pytest.raises(ValueError, match="under 4x the last-level cache"):
        measure_bandwidth(bytes_per_array=1 << 20)


@pytest.mark.slow
def test_measurement_reports_best_of_repeats_and_restores_threads():
    before = torch.get_num_threads()
    result = measure_bandwidth(repeats=2, threads=1)
    assert torch.get_num_threads() == before
    assert result["threads"] == 1
    assert result["gbs"] == max(result["gbs_per_repeat"]) > 0
    assert result["bytes_counted_per_iteration"] == 3 * result["bytes_per_array"]


def test_decode_roofline():
    # 2 GB of weights per token at 5 tok/s reads 10 GB/s, half of a 20 GB/s limit of 10 tok/s.
    assert decode_roofline(2e9, 5.0, 20.0) == {
        "effective_gbs": 10.0,
        "bandwidth_gbs": 20.0,
        "fraction_of_limit": 0.5,
        "limit_tokens_per_s": 10.0,
    }
    with pytest.raises(ValueError, match="tokens_per_s is 0; it must be a positive number"):
        decode_roofline(2e9, 0, 20.0)


@pytest.mark.slow
def test_the_command_prints_the_number(capsys):
    main(["--repeats", "1", "--threads", "1"])
    assert capsys.readouterr().out.startswith("triad bandwidth: ")
