"""Mixture-of-experts feed-forward: Mixtral (llama), Qwen2-MoE, Qwen3-MoE.

Each token's hidden state is scored by a router (`ffn_gate_inp`, one row per
expert); the softmax of those scores picks the `n_used` best experts, whose
SwiGLU outputs are summed with the chosen probabilities as weights, rescaled to
sum to 1 when the family does so (Mixtral, Qwen3-MoE; not Qwen2-MoE). The
experts of a layer are stored as one 3-D tensor per projection
(`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: (n_expert, N, K)); each
expert's slice stays in the file's format and only the experts some token is
routed to are read. Qwen2-MoE adds a shared expert that every token goes
through, scaled by sigmoid(x . ffn_gate_inp_shexp).
"""

from __future__ import annotations

import numpy as np

from workbench.engine.formats.gguf import GGUFError, GGUFFile
from workbench.engine.models.feed_forward import device_glu, glu
from workbench.engine.models.weights import Stacked, experts, fused, linear, vector


class MoEFeedForward:
    """The feed-forward of one mixture-of-experts layer."""

    def __init__(self, g: GGUFFile, i: int, n_used: int, normalize: bool):
        p = f"blk.{i}."
        self.router = linear(g, p + "ffn_gate_inp.weight")  # (n_expert, n_embd)
        if p + "ffn_gate_up_exps.weight" in g.tensors:  # gate and up rows in one tensor
            self.gate_up = experts(g, p + "ffn_gate_up_exps.weight")
        else:
            self.gate_up = [Stacked([a, b]) for a, b in zip(
                experts(g, p + "ffn_gate_exps.weight"), experts(g, p + "ffn_up_exps.weight"))]
        self.down = experts(g, p + "ffn_down_exps.weight")
        n_expert = self.router.shape[0]
        if not 0 < n_used <= n_expert or len(self.down) != n_expert:
            raise GGUFError(f"{g.path.name}: layer {i}: routing to {n_used} of {n_expert} "
                            f"router rows over {len(self.down)} experts does not fit together; "
                            "the file is damaged or its metadata does not match its weights")
        self.n_used, self.normalize = n_used, normalize
        self.shared = None  # Qwen2-MoE: (gate_up, down, gate vector (n_embd,))
        if p + "ffn_up_shexp.weight" in g.tensors:
            self.shared = (fused(g, [p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"]),
                           linear(g, p + "ffn_down_shexp.weight"),
                           vector(g, p + "ffn_gate_inp_shexp.weight", optional=True))

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x (T, n_embd) -> the chosen experts (T, n_used), best first, and their weights."""
        logits = self.router.matmul(x)  # (T, n_expert)
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        chosen = np.argsort(-probs, axis=1, kind="stable")[:, : self.n_used]
        weights = np.take_along_axis(probs, chosen, axis=1)
        if self.normalize:
            weights /= weights.sum(axis=1, keepdims=True)
        return chosen, weights

    def __call__(self, x: np.ndarray, counts=None) -> np.ndarray:
        """x (T, n_embd) -> (T, n_embd). `counts` (x's rows are chunks of several
        sequences) is not used: each expert runs on the tokens routed to it from all of
        them, so a prefill pass over several prompts is not batch-invariant here."""
        chosen, weights = self.route(x)
        out = np.zeros_like(x)
        for e in np.unique(chosen):
            rows, rank = np.nonzero(chosen == e)  # the tokens routed to expert e
            out[rows] += weights[rows, rank, None] * glu(self.gate_up[e], self.down[e], x[rows])
        if self.shared is not None:
            gate_up, down, gate = self.shared
            y = glu(gate_up, down, x)
            if gate is not None:
                y *= 1.0 / (1.0 + np.exp(-(x @ gate)))[:, None]
            out += y
        return out


class DeviceMoEFeedForward:
    """`MoEFeedForward` on a GPU backend's arrays (`workbench.engine.runtime.backend`).

    The router, the top-k choice and the weights run on the device; the chosen expert
    ids (T, n_used) are then copied to the host, so that only the experts some token
    is routed to are run, each on its own tokens. That is one small copy per layer and
    step, the one exception to "nothing but the token id leaves the device".
    """

    def __init__(self, ffn: MoEFeedForward, backend):
        self.backend, self.n_used, self.normalize = backend, ffn.n_used, ffn.normalize
        self.router = backend.weight(ffn.router)
        self.gate_up = [backend.weight(w) for w in ffn.gate_up]
        self.down = [backend.weight(w) for w in ffn.down]
        self.shared = None
        if ffn.shared is not None:
            gate_up, down, gate = ffn.shared
            self.shared = (backend.weight(gate_up), backend.weight(down), backend.vector(gate))

    def __call__(self, x):
        """x (T, n_embd) device array -> (T, n_embd)."""
        be = self.backend
        xp = be.xp
        probs = be.softmax(self.router.matmul(x), axis=-1)  # (T, n_expert)
        chosen = xp.argsort(-probs, axis=1)[:, : self.n_used]  # (T, n_used), best first
        weights = xp.take_along_axis(probs, chosen, axis=1)
        if self.normalize:
            weights = weights / weights.sum(axis=1, keepdims=True)
        routes = be.to_host(chosen)
        out = xp.zeros_like(x)
        for e in np.unique(routes):
            rows, rank = np.nonzero(routes == e)  # the tokens routed to expert e (once each)
            r, k = be.asarray(rows.astype(np.int32)), be.asarray(rank.astype(np.int32))
            y = device_glu(be, self.gate_up[e], self.down[e], x[r])
            out[r] = out[r] + weights[r, k][:, None] * y
        if self.shared is not None:
            gate_up, down, gate = self.shared
            y = device_glu(be, gate_up, down, x)
            if gate is not None:
                y = y * (1.0 / (1.0 + xp.exp(-(x @ gate))))[:, None]
            out = out + y
        return out
