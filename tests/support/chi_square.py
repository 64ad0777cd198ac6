"""Pearson's chi-square goodness-of-fit test, for checking that a sampler draws from the
distribution it should (scipy is not a dependency; the p-value is the regularized upper
incomplete gamma function, summed as its power series in log space)."""

from __future__ import annotations

import math

import numpy as np

MIN_EXPECTED = 5.0  # cells expecting fewer draws are pooled into one


def chi_square_p(observed: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the counts `observed` against the cell probabilities `probs` (same
    shape, summing to 1). Cells expecting fewer than `MIN_EXPECTED` draws are pooled;
    a draw in a cell of probability 0 gives 0.0 (the distribution cannot produce it)."""
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    n = observed.sum()
    if observed[probs <= 0].any():
        return 0.0
    expected = probs * n
    small = (expected < MIN_EXPECTED) & (probs > 0)
    big = expected >= MIN_EXPECTED
    obs = list(observed[big])
    exp = list(expected[big])
    if small.any():
        pooled_obs, pooled_exp = observed[small].sum(), expected[small].sum()
        if pooled_exp < MIN_EXPECTED and exp:  # too small alone: join the smallest cell
            i = int(np.argmin(exp))
            obs[i] += pooled_obs
            exp[i] += pooled_exp
        else:
            obs.append(pooled_obs)
            exp.append(pooled_exp)
    if len(exp) < 2:
        raise ValueError("fewer than two cells: draw more")
    obs_a, exp_a = np.asarray(obs), np.asarray(exp)
    stat = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    return chi2_sf(stat, len(exp) - 1)


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square with `dof` degrees of freedom:
    1 - P(dof/2, x/2), with P(s, z) = e^-z z^s / Gamma(s+1) * sum_n z^n / ((s+1)...(s+n))."""
    if x <= 0:
        return 1.0
    s, z = dof / 2.0, x / 2.0
    n = np.arange(1, int(z + 20 * math.sqrt(z) + 200))
    log_terms = np.concatenate([[0.0], np.cumsum(math.log(z) - np.log(s + n))])
    top = log_terms.max()
    log_sum = top + math.log(np.exp(log_terms - top).sum())
    lower = math.exp(min(0.0, -z + s * math.log(z) - math.lgamma(s + 1) + log_sum))
    return max(0.0, 1.0 - lower)
