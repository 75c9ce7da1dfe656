import logging

import pytest
import torch

from fourbit.quant.gptq import SingularHessianError, gptq_quantize
from fourbit.quant.grid import Grid, quantize_rtn
from fourbit.quant.hessian import Hessian

N, K, TOKENS = 48, 256, 1024


def layer(seed=0):
    """Weights W [N, K] and correlated activations X [TOKENS, K] with uneven column scales."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 0.05
    mix = torch.eye(K) + torch.randn(K, K, generator=gen) * 0.2
    x = torch.randn(TOKENS, K, generator=gen) @ mix * torch.exp(torch.randn(K, generator=gen))
    return w, x


def hessian_of(x):
    h = Hessian(x.shape[-1])
    for chunk in x.split(300):  # uneven batches exercise the running mean
        h.add_batch(chunk)
    return h.h


def output_error(w, w_hat, x):
    return ((w - w_hat) @ x.T).square().sum().item()


def test_hessian_is_twice_the_mean_outer_product():
    _, x = layer()
    torch.testing.assert_close(hessian_of(x), 2 * x.T @ x / TOKENS, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("act_order, static_groups", [(False, False), (False, True), (True, True)])
def test_gptq_output_error_at_most_rtn(sym, group, act_order, static_groups):
    w, x = layer()
    grid = Grid(group_size=group, sym=sym)
    h = hessian_of(x)
    qw, info = gptq_quantize(w, h, grid, act_order=act_order, static_groups=static_groups)
    rtn = quantize_rtn(w, grid)  # with its weighted search, which GPTQ here does without
    assert output_error(w, qw.dequantize(), x) <= output_error(w, rtn.dequantize(), x)
    assert info["damp_percent_used"] == 0.01 and info["dead_columns"] == 0
    assert 0 < info["relative_loss"] < 0.01


def textbook_gptq(w, h, grid, damp_percent=0.01):
    """Frantar et al.'s Algorithm 1 without lazy batches, in float64: one column at a
    time, the full inverse Hessian of the columns left updated after each (OBS)."""
    w, h = w.double().clone(), h.double().clone()
    h.diagonal().add_(damp_percent * h.diagonal().mean())
    hinv = torch.linalg.inv(h)
    codes = torch.empty(w.shape, dtype=torch.uint8)
    g = grid.group_size
    for i in range(w.shape[1]):
        if i % g == 0:
            scale, zero = (t.double() for t in grid.find_params(w[:, i : i + g].float()))
        q = grid.quantize(w[:, i], scale, zero)
        codes[:, i] = q.to(torch.uint8)
        err = (w[:, i] - grid.dequantize(q, scale, zero)) / hinv[i, i]  # [N]
        w[:, i + 1 :] -= err.unsqueeze(1) * hinv[i, i + 1 :].unsqueeze(0)
        hinv -= hinv[:, i : i + 1] @ hinv[i : i + 1, :] / hinv[i, i]  # drop column i
    return codes


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("block_size", [32, 128])
def test_lazy_blocks_give_the_textbook_algorithm(sym, block_size):
    """The blocked, transposed-block loop quantizes as the one-column-at-a-time
    algorithm does: the same codes but for rare rounding ties of float32 vs float64."""
    w, x = layer()
    grid = Grid(group_size=32, sym=sym)
    h = hessian_of(x)
    qw, _ = gptq_quantize(w, h, grid, block_size=block_size)
    same = (qw.codes == textbook_gptq(w, h, grid)).float().mean().item()
    assert same > 0.995, same


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("search", ["minmax", "shrink", "weighted"])
def test_stored_weight_is_exactly_what_gptq_used(monkeypatch, act_order, search):
    """Every column GPTQ fed back as quantized equals the stored QuantizedWeight's."""
    used = []
    original = Grid.dequantize

    def spy(codes, scale, zero):
        out = original(codes, scale, zero)
        if codes.dim() == 1:  # one column inside the GPTQ loop (not the range search)
            used.append(out.clone())
        return out

    monkeypatch.setattr(Grid, "dequantize", staticmethod(spy))
    w, x = layer(seed=1)
    h = hessian_of(x)
    qw, _ = gptq_quantize(
        w, h, Grid(group_size=32), act_order=act_order, static_groups=act_order,
        search=search, shrink_steps=10,
    )
    w_hat = torch.stack(used, 1)  # [N, K], columns in processing order
    if act_order:  # back to original column order
        order = torch.argsort(h.diagonal(), descending=True, stable=True)
        w_hat = w_hat[:, torch.argsort(order)]
    assert torch.equal(qw.dequantize(), w_hat)
    assert qw.codes.max() <= 15 and qw.zeros.max() <= 15 and qw.scales.dtype == torch.float16


@pytest.mark.parametrize("search", ["shrink", "weighted"])
@pytest.mark.parametrize("sym", [False, True])
def test_range_search_lowers_gptq_error(search, sym):
    w, x = layer(seed=2)
    h, grid = hessian_of(x), Grid(group_size=64, sym=sym)
    plain, _ = gptq_quantize(w, h, grid)
    searched, info = gptq_quantize(w, h, grid, search=search)
    assert info["search"] == search
    assert output_error(w, searched.dequantize(), x) < output_error(w, plain.dequantize(), x)


@pytest.mark.parametrize("sym", [False, True])
def test_dead_input_column_is_zeroed(sym):
    w, x = layer(seed=3)
    x[:, [5, 200]] = 0
    qw, info = gptq_quantize(w, hessian_of(x), Grid(group_size=64, sym=sym), layer_name="mlp.up")
    assert info["dead_columns"] == 2
    assert torch.equal(qw.dequantize()[:, [5, 200]], torch.zeros(N, 2))


def test_damping_is_raised_when_cholesky_fails(caplog):
    w, x = layer(seed=4)
    h = hessian_of(x[:100])  # rank 100 < K: singular, then pushed indefinite
    h -= 0.05 * h.diagonal().mean() * torch.eye(K)  # needs damp > 5% of the mean diagonal
    with caplog.at_level(logging.WARNING, logger="fourbit"):
        _, info = gptq_quantize(w, h, Grid(), layer_name="layers.3.self_attn.q_proj")
    assert info["damp_percent_used"] == pytest.approx(0.1)
    assert "layers.3.self_attn.q_proj" in caplog.text and "succeeded at 0.1" in caplog.text


def test_singular_hessian_error_names_the_layer_and_damp():
    w, _ = layer()
    h = 3 * torch.ones(K, K) - 2 * torch.eye(K)  # diagonal 1, eigenvalues -2 (and 3K - 2)
    with pytest.raises(SingularHessianError, match=r"layers\.7\.mlp\.down_proj.*damp 1 x mean"):
        gptq_quantize(w, h, Grid(), layer_name="layers.7.mlp.down_proj")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"act_order": True}, "act_order needs static_groups"),
        ({"block_size": 96}, "block_size=96 is not a multiple of group 64"),
        ({"hessian": torch.eye(128)}, r"Hessian \(128, 128\) does not match K=256"),
    ],
)
def test_invalid_settings_name_the_layer(kwargs, message):
    w, x = layer()
    args = {"hessian": hessian_of(x), **kwargs}
    with pytest.raises(ValueError, match=f"lm_head: {message}"):
        gptq_quantize(w, args.pop("hessian"), Grid(group_size=64), layer_name="lm_head", **args)
