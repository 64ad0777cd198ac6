"""Numba CPU kernel for the logit lens: what a row of logits says, in one pass.

`lens_rows(logits, top_ids, top_probs, entropy)` reads each row of logits (R, V) once
for its maximum and once for the softmax's normaliser, the entropy and the k largest
logits (k = top_ids.shape[1]); NumPy would need an exp array of R x V floats and an
argpartition per row. On SmolLM2's 49152-token vocabulary that is the difference
between the lens costing about as much as the output matmul and costing several times it.

The normaliser and the entropy are float32 sums over blocks of `_BLOCK` logits (which
vectorize), added up in float64, of `exp_neg` (float32, relative error < 3e-7); the
k probabilities are `exp(z - max) / normaliser` in float64.
The tests hold the kernel to float64 NumPy.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from workbench.kernels.cache import njit
from workbench.kernels.layers import exp_neg

_FM = {"reassoc", "contract"}  # reorder sums, fuse multiply-adds; NaN/inf semantics kept
_BLOCK = 512  # logits summed in float32 at a time


@njit(parallel=True, fastmath=_FM, error_model="numpy", cache=True)
def lens_rows(logits, top_ids, top_probs, entropy):
    """For each row r of logits (R, V) float32: the k most likely ids, most likely first,
    into top_ids[r] (int32, k = top_ids.shape[1]), their probabilities into
    top_probs[r] (float32) and the softmax's entropy in nats into entropy[r]."""
    R, V = logits.shape
    k = top_ids.shape[1]
    for r in prange(R):
        row = logits[r]
        m = row[0]
        for j in range(1, V):
            m = max(m, row[j])
        total = 0.0  # float64: sum of e^(z - m)
        weighted = 0.0  # float64: sum of e^(z - m) (z - m)
        for j0 in range(0, V, _BLOCK):  # float32 sums over blocks (vectorized), then float64
            s = np.float32(0.0)
            w = np.float32(0.0)
            for j in range(j0, min(V, j0 + _BLOCK)):
                y = row[j] - m
                e = exp_neg(y)
                s += e
                w += e * y
            total += s
            weighted += w
        vals = np.full(k, -np.inf, np.float32)  # the k largest, descending
        ids = np.zeros(k, np.int32)
        floor = vals[k - 1]
        for j in range(V):
            z = row[j]
            if z > floor:  # insert, keeping vals sorted (ties: the lower id first)
                i = k - 1
                while i > 0 and vals[i - 1] < z:
                    vals[i] = vals[i - 1]
                    ids[i] = ids[i - 1]
                    i -= 1
                vals[i] = z
                ids[i] = j
                floor = vals[k - 1]
        entropy[r] = np.float32(math.log(total) - weighted / total)
        for i in range(k):
            top_ids[r, i] = ids[i]
            top_probs[r, i] = np.float32(math.exp(float(vals[i]) - float(m)) / total)
