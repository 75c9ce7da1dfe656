"""The quadratic form GPTQ minimises, accumulated from a layer's calibration inputs.

For a linear layer y = W x, the output error over n calibration tokens is

    sum_t |(W - W_hat) x_t|^2 = tr((W - W_hat) (sum_t x_t x_t^T) (W - W_hat)^T),

so H = 2/n * sum_t x_t x_t^T (the factor 2 is the second derivative of the square)
holds everything the quantizer needs to know about the data. It is kept as a running
mean over tokens rather than a sum, so its entries stay the size of x^2 however many
tokens are seen, and float32 accumulation loses nothing to growing magnitudes.
"""

from __future__ import annotations

import torch


class Hessian:
    def __init__(self, k: int, dtype: torch.dtype = torch.float32):
        self.h = torch.zeros(k, k, dtype=dtype)  # [K, K]
        self.n = 0  # tokens seen

    def add_batch(self, x: torch.Tensor) -> None:
        """Fold in inputs x [..., K] (any leading batch/sequence dims)."""
        k = self.h.shape[0]
        if x.shape[-1] != k:
            raise ValueError(f"Hessian is {k}x{k} but the inputs have width {x.shape[-1]}")
        x = x.reshape(-1, k).to(self.h.dtype)  # [..., K] -> [n, K]
        n = x.shape[0]
        # H_new = (n_old * H_old + 2 * X^T X) / (n_old + n), without forming the sum
        self.h *= self.n / (self.n + n)
        self.n += n
        x = x * (2 / self.n) ** 0.5
        self.h.addmm_(x.T, x)
