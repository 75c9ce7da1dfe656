import pytest
import torch

from fourbit.quant import grid as grid_mod
from fourbit.quant.grid import Grid, quantize_rtn

SCALE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def heavy_tailed(n, k, seed=0):
    """Weights with outliers, so that clipping some of the range can pay."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.02 * torch.rand(n, k, generator=gen).pow(-0.3)


def group_error(weight, qw, importance=None):
    """Squared error per group [N, K/G], optionally weighted per column."""
    sq = (qw.dequantize() - weight).square()
    if importance is not None:
        sq = sq * importance
    n, k = weight.shape
    return sq.view(n, k // qw.group_size, qw.group_size).sum(-1)


@pytest.mark.parametrize("shape", [(8, 128), (16, 256), (3, 384)])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_shrink_search_never_worse_than_min_max(shape, sym, group):
    w = heavy_tailed(*shape)
    grid = Grid(group_size=group, sym=sym)
    plain = group_error(w, quantize_rtn(w, grid, shrink_steps=0))
    searched = group_error(w, quantize_rtn(w, grid, shrink_steps=20))
    assert (searched <= plain).all()
    assert searched.sum() < plain.sum()  # the outliers make clipping pay somewhere


@pytest.mark.parametrize("sym", [False, True])
def test_all_zero_group_is_exact(sym):
    w = heavy_tailed(4, 256)
    w[1, 128:] = 0
    qw = quantize_rtn(w, Grid(sym=sym))
    assert torch.equal(qw.dequantize()[1, 128:], torch.zeros(128))
    assert qw.scales[1, 1].item() == 1.0


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("dtype", SCALE_DTYPES)
@pytest.mark.parametrize("value", [0.3, -0.3, 1e-3, -7.25])
def test_constant_group_is_exact(sym, dtype, value):
    c = torch.tensor(value).to(dtype).float()  # a value the scale dtype can hold
    w = heavy_tailed(2, 128)
    w[0, 64:] = c
    qw = quantize_rtn(w, Grid(group_size=64, sym=sym, scale_dtype=dtype))
    assert torch.equal(qw.dequantize()[0, 64:], c.expand(64))


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("dtype", SCALE_DTYPES)
@pytest.mark.parametrize("group", [32, 128])
def test_weights_on_the_grid_are_reproduced(sym, dtype, group):
    gen = torch.Generator().manual_seed(1)
    n, k = 6, 256
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    codes[:, ::group], codes[:, 1::group] = 0, 15  # each group spans the full code range
    # float16-representable scales even for float32, so that every level (q - z) * s is
    # exact in float32 and the grid can be read back off the weights
    scales = (torch.rand(n, k // group, generator=gen) * 0.05 + 1e-3).half().to(dtype)
    if sym:
        zeros = torch.full((n, k // group), 8, dtype=torch.uint8)
    else:
        zeros = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.uint8)
    w = grid_mod.QuantizedWeight(codes, scales, zeros, group).dequantize()
    grid = Grid(group_size=group, sym=sym, scale_dtype=dtype)
    for steps in (0, 20):
        assert torch.equal(quantize_rtn(w, grid, shrink_steps=steps).dequantize(), w)


@pytest.mark.parametrize("sym", [False, True])
def test_importance_weighted_search_lowers_weighted_error(sym):
    w = heavy_tailed(32, 256, seed=2)
    importance = torch.exp(torch.randn(256, generator=torch.Generator().manual_seed(3)) * 2)
    grid = Grid(group_size=64, sym=sym)
    plain = group_error(w, quantize_rtn(w, grid), importance)
    aware = group_error(w, quantize_rtn(w, grid, importance=importance), importance)
    assert (aware <= plain).all()  # same candidates, chosen by the weighted error
    assert aware.sum() < plain.sum()


def test_k_not_multiple_of_group_raises():
    with pytest.raises(ValueError, match="K=200 is not a multiple of group 128"):
        quantize_rtn(torch.randn(4, 200), Grid())


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("dtype", SCALE_DTYPES)
def test_scales_are_exact_in_scale_dtype(sym, dtype):
    grid = Grid(group_size=32, sym=sym, scale_dtype=dtype)
    w = heavy_tailed(8, 128, seed=4)
    scale, zero = grid.find_params(w.view(8, 4, 32), shrink_steps=10)
    assert torch.equal(scale.to(dtype).float(), scale)
    assert torch.equal(zero, zero.round()) and zero.min() >= 0 and zero.max() <= 15
    qw = quantize_rtn(w, grid, shrink_steps=10)
    assert qw.scales.dtype == dtype
    assert torch.equal(qw.scales.float(), scale.view(8, 4))


def test_row_chunks_do_not_change_the_result(monkeypatch):
    w = heavy_tailed(50, 256, seed=5)
    whole = quantize_rtn(w, Grid(group_size=64))
    monkeypatch.setattr(grid_mod, "ROW_CHUNK_ELEMS", 7 * 256)  # 8 chunks, the last partial
    assert quantize_rtn(w, Grid(group_size=64)).equal(whole)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bits": 3}, "only 4-bit"),
        ({"group_size": 16}, "group_size=16"),
        ({"scale_dtype": torch.int8}, "scale_dtype"),
    ],
)
def test_grid_rejects_unsupported_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Grid(**kwargs)


def test_scale_overflow_names_the_step():
    with pytest.raises(ValueError, match="does not fit a torch.float16 scale"):
        quantize_rtn(torch.full((1, 128), 1e6).index_fill_(1, torch.tensor([0]), -1e6), Grid())
