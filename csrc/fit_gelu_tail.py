"""Fit the polynomial of the 16-bit GELU in ffn_math.h (gelu_tail) and print it as C++.

For a >= 0, the upper tail of the normal distribution is written Q(a) = 1 - Phi(a) = u * R(u) * phi(a) with
u = 1 / (1 + K a), phi(a) = exp(-a^2 / 2) / sqrt(2 pi). R(u) = Q(a) / (u phi(a)) = (1 + K a) * Mills ratio(a) is
smooth and bounded on [0, inf): sqrt(pi / 2) at a = 0, K as a -> inf, so a polynomial in u fits it closely. The fit
minimises the largest relative error of R (= that of Q) over a in [0, 14] (beyond ~13.2 Q underflows in float)
by Lawson's iteratively reweighted least squares on Chebyshev points, in float64 against torch.special.erfcx.

    python csrc/fit_gelu_tail.py            # prints K, the coefficients and the fit's error
The result is checked in tests/test_host_math.py (every bfloat16 and float16 value through the header's code).
"""

import math

import torch

K = 0.305  # chosen by scanning 0.26..0.40: smallest error at degree 7
DEGREE = 7  # 8 coefficients: 7 FFMA in Horner's scheme; degree 8 gains nothing visible after float rounding
A_MAX = 14.0


def target(u):
    a = (1.0 / u - 1.0) / K
    mills = math.sqrt(math.pi / 2) * torch.special.erfcx(a / math.sqrt(2))  # Q(a) / phi(a)
    return mills / u


def fit(points=4000, iterations=300):
    u_min = 1.0 / (1.0 + K * A_MAX)
    j = torch.arange(points, dtype=torch.float64)
    u = (u_min + 1) / 2 + (1 - u_min) / 2 * torch.cos(math.pi * (j + 0.5) / points)
    f = target(u)
    V = torch.stack([u**i for i in range(DEGREE + 1)], 1)
    w = torch.full_like(u, 1.0 / points)
    for _ in range(iterations):  # Lawson: weights grow where the error is largest -> minimax
        s = w.sqrt() / f
        c = torch.linalg.lstsq(V * s[:, None], f * s).solution
        err = ((V @ c - f) / f).abs()
        w = w * err
        w = w / w.sum()
    return c, float(err.max())


if __name__ == "__main__":
    c, err = fit()
    print(f"// K = {K}, degree {DEGREE}, max relative error of Q on [0, {A_MAX}]: {err:.2e}")
    print("c[] = {" + ", ".join(f"{v:.9g}f" for v in c.tolist()) + "}  // c[0] + c[1] u + ...")
