from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fourbit.schema import allowed
from fourbit.quant import grid as grid_mod
from fourbit.quant.grid import SEARCHES, Grid, quantize_rtn
from fourbit.quantizers.methods import HeldOutGuard, heldout_error

SCALE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def heavy_tailed(n, k, seed=0):
    """Weights with outliers, so that clipping some of the range can pay."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.02 * torch.rand(n, k, generator=gen).pow(-0.3)


def group_error(weight, qw, importance=None):
    """Squared error per group [N, K/G], optionally weighted per column (or per weight)."""
    sq = (qw.dequantize() - weight).square()
    if importance is not None:
        sq = sq * importance
    n, k = weight.shape
    return sq.view(n, k // qw.group_size, qw.group_size).sum(-1)


def llama_weights(weight, group, importance=None):
    """The weighted search's per-weight weights [N, K], as llama.cpp's quantize_row_q4_K
    computes them: av_x + |x|, or quant_weights * sqrt(sigma2 + x^2); per group."""
    n, k = weight.shape
    w = weight.view(n, k // group, group)
    sigma2 = w.square().mean(-1, keepdim=True)
    if importance is None:
        return (sigma2.sqrt() + w.abs()).view(n, k)
    return (importance.view(k // group, group) * (sigma2 + w.square()).sqrt()).view(n, k)


@pytest.mark.parametrize("shape", [(8, 128), (16, 256), (3, 384)])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_shrink_search_never_worse_than_min_max(shape, sym, group):
    w = heavy_tailed(*shape)
    grid = Grid(group_size=group, sym=sym)
    plain = group_error(w, quantize_rtn(w, grid, search="minmax"))
    searched = group_error(w, quantize_rtn(w, grid, search="shrink", shrink_steps=20))
    assert (searched <= plain).all()
    assert searched.sum() < plain.sum()  # the outliers make clipping pay somewhere


@pytest.mark.parametrize("shape", [(8, 128), (16, 256), (3, 384)])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("with_importance", [False, True])
def test_weighted_search_never_worse_than_min_max_on_its_objective(shape, sym, group,
                                                                   with_importance):
    w = heavy_tailed(*shape)
    gen = torch.Generator().manual_seed(7)
    importance = torch.exp(torch.randn(shape[1], generator=gen) * 2) if with_importance else None
    grid = Grid(group_size=group, sym=sym)
    e = llama_weights(w, group, importance)
    plain = group_error(w, quantize_rtn(w, grid, search="minmax"), e)
    searched = group_error(w, quantize_rtn(w, grid, search="weighted", importance=importance), e)
    assert (searched <= plain).all()  # min/max is a candidate and wins ties
    assert searched.sum() < plain.sum()  # and strictly better somewhere


def test_weighted_search_follows_llama_cpp_on_an_outlier_group():
    """One large weight: the weighted search keeps it (av_x + |x| counts it most) where the
    squared-error shrink search clips it for the many small ones."""
    w = torch.full((1, 32), 0.01)
    w[0, ::2] = -0.01
    w[0, 5] = 0.3
    grid = Grid(group_size=32)
    for search, kept in (("weighted", True), ("shrink", False)):
        w_hat = quantize_rtn(w, grid, search=search).dequantize()
        assert (abs(w_hat[0, 5] - 0.3) < 0.01) == kept, search


def test_integer_zero_worked_example():
    """The numbers of Grid._to_integer_zero's docstring."""
    w = torch.tensor([[-0.31, -0.02, 0.07, 0.44]])
    scale = torch.tensor([0.050062]).half().float()
    zero = Grid._to_integer_zero(torch.tensor([-0.315548]), scale)
    assert scale.item() == 0.050048828125 and zero.item() == 6
    codes = Grid.quantize(w, scale, zero)
    assert codes.tolist() == [[0, 6, 7, 15]]
    torch.testing.assert_close(Grid.dequantize(codes, scale, zero),
                               torch.tensor([[-0.300293, 0.0, 0.050049, 0.450439]]))


def test_unknown_search_is_refused():
    with pytest.raises(ValueError, match="search='clip' is not one of"):
        quantize_rtn(torch.randn(2, 128), Grid(), search="clip")


def test_the_searches_a_config_may_name_are_the_ones_find_params_runs():
    """SEARCHES is what find_params implements, the schema's search enum what an arm may
    name; a name only in the schema would run the shrink branch silently."""
    assert SEARCHES == allowed("search")


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("search", SEARCHES)
def test_all_zero_group_is_exact(sym, search):
    w = heavy_tailed(4, 256)
    w[1, 128:] = 0
    qw = quantize_rtn(w, Grid(sym=sym), search=search)
    assert torch.equal(qw.dequantize()[1, 128:], torch.zeros(128))
    assert qw.scales[1, 1].item() == 1.0


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("dtype", SCALE_DTYPES)
@pytest.mark.parametrize("value", [0.3, -0.3, 1e-3, -7.25])
@pytest.mark.parametrize("search", SEARCHES)
def test_constant_group_is_exact(sym, dtype, value, search):
    c = torch.tensor(value).to(dtype).float()  # a value the scale dtype can hold
    w = heavy_tailed(2, 128)
    w[0, 64:] = c
    qw = quantize_rtn(w, Grid(group_size=64, sym=sym, scale_dtype=dtype), search=search)
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
    for search in SEARCHES:
        assert torch.equal(quantize_rtn(w, grid, search=search).dequantize(), w), search


@pytest.mark.parametrize("sym", [False, True])
def test_importance_weighted_search_lowers_weighted_error(sym):
    w = heavy_tailed(32, 256, seed=2)
    importance = torch.exp(torch.randn(256, generator=torch.Generator().manual_seed(3)) * 2)
    grid = Grid(group_size=64, sym=sym)
    plain = group_error(w, quantize_rtn(w, grid, search="shrink"), importance)
    aware = quantize_rtn(w, grid, search="shrink", importance=importance)
    aware = group_error(w, aware, importance)
    assert (aware <= plain).all()  # same candidates, chosen by the weighted error
    assert aware.sum() < plain.sum()


def test_k_not_multiple_of_group_raises():
    with pytest.raises(ValueError, match="K=200 is not a multiple of group 128"):
        quantize_rtn(torch.randn(4, 200), Grid())


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("dtype", SCALE_DTYPES)
@pytest.mark.parametrize("search", SEARCHES)
def test_scales_are_exact_in_scale_dtype(sym, dtype, search):
    grid = Grid(group_size=32, sym=sym, scale_dtype=dtype)
    w = heavy_tailed(8, 128, seed=4)
    scale, zero = grid.find_params(w.view(8, 4, 32), search=search, shrink_steps=10)
    assert torch.equal(scale.to(dtype).float(), scale) and (scale > 0).all()
    assert torch.equal(zero, zero.round()) and zero.min() >= 0 and zero.max() <= 15
    qw = quantize_rtn(w, grid, search=search, shrink_steps=10)
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


# ---- real layers: held-out output error against plain rounding ----

GOLDEN = Path(__file__).parent / "golden" / "grid_layers_builtin_default.safetensors"
REAL_LAYERS = ("model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj")


def real_layer(name):
    """Rows 0:32, columns 0:256 of a layer of the workflow's default model (builtin,
    trained here; see the file's metadata), with diag(H) of 32 calibration windows and
    the Hessian of 16 held-out ones, both of the unquantized model's inputs."""
    tensors = load_file(GOLDEN)
    w = tensors[f"{name}.weight"].float()  # [32, 256]
    k = w.shape[1]
    rows, cols = torch.triu_indices(k, k)
    h = torch.zeros(k, k)
    h[rows, cols] = tensors[f"{name}.heldout_hessian_triu"].float()  # upper triangle [K(K+1)/2]
    h = h + h.triu(1).T  # -> the symmetric [K, K]
    return w, tensors[f"{name}.importance"], h


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_guarded_search_never_worse_than_min_max_on_real_layers(sym, group):
    """cpu_int4 importance: activation's rule on real weights and activations: per layer,
    the stored result is the weighted search's unless plain min/max rounding of the same
    grid has the smaller held-out output error; so it is never worse, layer by layer. And
    the search earns its place: summed over the layers it beats min/max on held-out data."""
    grid = Grid(group_size=group, sym=sym)
    guard = HeldOutGuard("weighted")
    searched_total = plain_total = 0.0
    for name in REAL_LAYERS:
        w, importance, h_heldout = real_layer(name)
        searched = quantize_rtn(w, grid, importance=importance)
        plain = quantize_rtn(w, grid, search="minmax")
        kept = guard.choose(name, w, h_heldout, searched, plain)
        e_kept = heldout_error(w, kept.dequantize(), h_heldout)
        e_plain = heldout_error(w, plain.dequantize(), h_heldout)
        e_searched = heldout_error(w, searched.dequantize(), h_heldout)
        assert e_kept <= e_plain, name
        assert e_kept == min(e_searched, e_plain)
        assert kept is (searched if guard.kept[name] == "weighted" else plain)
        searched_total, plain_total = searched_total + e_searched, plain_total + e_plain
    assert searched_total < plain_total
    if not sym and group == 128:  # where the search loses on this layer, the guard says no
        assert guard.kept["model.layers.1.self_attn.q_proj"] == "minmax"
    facts = guard.facts(16)
    assert sorted(facts["kept_search"] + facts["kept_minmax"]) == sorted(REAL_LAYERS)


def test_old_shrink_search_loses_to_min_max_where_the_weighted_one_wins():
    """Why the default changed, on the default model's down_proj (rows 0:32, columns 0:256):
    the squared-weight-error shrink search clips the extremes and loses to plain rounding on
    held-out output error; llama.cpp's weighting with diag(H) wins by a wide margin."""
    w, importance, h_heldout = real_layer("model.layers.1.mlp.down_proj")
    for group in (32, 64):
        grid = Grid(group_size=group)
        plain = heldout_error(w, quantize_rtn(w, grid, search="minmax").dequantize(), h_heldout)
        shrink = heldout_error(w, quantize_rtn(w, grid, search="shrink").dequantize(), h_heldout)
        weighted = quantize_rtn(w, grid, importance=importance).dequantize()
        assert shrink > plain
        assert heldout_error(w, weighted, h_heldout) < 0.75 * plain
