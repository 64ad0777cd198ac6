"""The llama-family forward pass (Gemma 3 included) on a GPU backend's arrays
(`workbench.engine.backend`: CuPy on CUDA, MLX), built from a loaded `LlamaModel`.

The math is the host model's, written over the backend's array module: the same
`rms_norm` and RoPE `rotate`, the family's quirks read from the same blocks (Gemma 3's
post-norms and GeGLU, sliding windows, Qwen's Q/K norms and biases). The tests check
it against transformers' logits on the "cuda-on-numpy" and "mlx" devices
(tests/test_tiny_models.py, tests/test_tiny_families.py).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import numpy as np

from workbench.engine.models import llama
from workbench.engine.models.feed_forward import FeedForward, device_glu
from workbench.engine.models.llama import (
    Block,
    LlamaModel,
    check_batch,
    check_ids,
    masked_keys,
    rms_norm,
    split_heads,
)
from workbench.engine.models.llama_config import LlamaConfig
from workbench.engine.models.moe import DeviceMoEFeedForward, MoEFeedForward
from workbench.engine.models.rope import rotate

_RECORDING_ERRORS = (RuntimeError,)  # what CuPy raises when a CUDA graph cannot be made


class DeviceLlamaModel:
    """The llama-family forward pass (Gemma 3 included) on a GPU backend's arrays.

    Built from a loaded `LlamaModel`: every weight is uploaded once
    (`Backend.weight`), and the host copies are dropped with the CPU model. The
    caches are a `DeviceKVPool`'s. A decode step moves nothing between host and
    device: in `hidden` positions are Python ints that slice the device's RoPE tables
    and caches, and `hidden` / `device_logits` return device arrays. `step_logits`,
    the generation loop's step, reads the token and its position from device buffers
    instead, so that the backend can record it once and replay it (CUDA graphs:
    one launch per token instead of a few hundred). `logits` returns NumPy, for the
    callers that read every logit (branches, speculative decoding, `LLM.forward`).
    Mixture-of-experts layers copy their routing to the host (`DeviceMoEFeedForward`),
    so their steps are never recorded.
    """

    def __init__(self, model: LlamaModel, backend):
        self.config = model.config
        self.backend, self.xp, self.max_len = backend, backend.xp, model.max_len
        self.embed_scale = float(model.embed_scale)
        self.embed = backend.weight(model.embed)
        self.output = self.embed if model.output is model.embed else backend.weight(model.output)
        self.norm = backend.vector(model.norm)
        self.ropes = [b.attn.rope for b in model.blocks]  # host tables, for kv_remove
        tables = {}  # one device copy of each distinct RoPE table (Gemma: local and global)
        for rope in self.ropes:
            if id(rope) not in tables:
                tables[id(rope)] = (backend.asarray(rope.cos), backend.asarray(rope.sin))
        self.layers = [_DeviceLayer(b, backend, *tables[id(b.attn.rope)]) for b in model.blocks]
        ffn = model.blocks[0].ffn
        self.gelu = isinstance(ffn, FeedForward) and ffn.gelu  # GeGLU (Gemma 3)
        self.positions = backend.asarray(np.arange(model.max_len, dtype=np.int32))
        # recorded decode steps: where the backend records, for models without experts
        # (their routing goes through the host), until a recording fails
        self._recording = backend.records and all(layer.moe is None for layer in self.layers)

    # -- caches -----------------------------------------------------------------------------
    def new_pool(self, n_slots: int, max_len: int | None = None):
        """Device KV-cache room for `n_slots` sequences of up to `max_len` positions."""
        from workbench.engine.kv_cache import DeviceKVPool

        cfg = self.config
        max_len = min(max_len or self.max_len, self.max_len)
        return DeviceKVPool(self.backend, cfg.n_layer, n_slots, cfg.n_head_kv, cfg.head_dim,
                            max_len)

    def new_cache(self, max_len: int | None = None):
        """An empty device KV cache for one sequence."""
        return self.new_pool(1, max_len).caches()[0]

    # -- forward ----------------------------------------------------------------------------
    def _embed(self, ids) -> object:
        """ids: host ints or a device int array (a token sampled on the device) -> (T, D)."""
        if isinstance(ids, np.ndarray):
            ids = self.backend.asarray(ids.astype(np.int32))
        x = self.embed.rows(ids)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def hidden(self, ids, cache, device_ids=None):
        """Run tokens `ids` (T,) at the cache's next positions; return the final-normed
        hidden states (T, n_embd) on the device. `device_ids`: the same tokens already on
        the device (a sampled token), which saves uploading them."""
        ids = check_ids(ids, self.config.n_vocab)
        if not ids.size:
            raise ValueError("hidden needs at least one token")
        cache.check_room(ids.size)
        x = self._embed(ids if device_ids is None else device_ids)  # (T, D)
        h = self._layers(x, [cache], [ids.size])
        cache.advance(ids)
        return h

    def hidden_batch(self, chunks) -> list:
        """`LlamaModel.hidden_batch`'s interface: (ids (T_i,), cache) pairs -> each chunk's
        final-normed hidden states (T_i, n_embd) on the device. A fallback: it runs
        `hidden` once per chunk (one forward pass each), not one pass for all."""
        return [self.hidden(ids, cache) for ids, cache in chunks]

    def decode(self, ids, caches, device_ids=None):
        """One token for each of N caches (of one pool): final-normed hidden states (N, D).
        `device_ids`: the same N tokens already on the device (sampled there)."""
        ids = check_batch(ids, caches, self.config.n_vocab)
        for c in caches:
            c.check_room(1)
        h = self._layers(self._embed(ids if device_ids is None else device_ids), caches,
                         [1] * len(caches))
        for c, t in zip(caches, ids):
            c.advance([int(t)])
        return h

    def _layers(self, x, caches, counts):
        """x (sum(counts), D): `counts[i]` tokens of `caches[i]`, each at its next positions."""
        cfg, be = self.config, self.backend
        return self._stack(x, lambda i, layer, h: layer.attention(be, cfg, h, caches, counts, i))

    def _stack(self, x, attend):
        """The layers and the final norm; `attend(i, layer, h)` is layer i's attention of
        its normed input h."""
        cfg, be = self.config, self.backend
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, cfg.norm_eps, be.xp)
            a = attend(i, layer, h)
            if layer.post_attn_norm is not None:
                a = rms_norm(a, layer.post_attn_norm, cfg.norm_eps, be.xp)
            x = x + a
            h = rms_norm(x, layer.ffn_norm, cfg.norm_eps, be.xp)
            if layer.moe is not None:
                f = layer.moe(h)
            else:
                f = device_glu(be.xp, layer.gate_up, layer.down, h, self.gelu)
            if layer.post_ffn_norm is not None:
                f = rms_norm(f, layer.post_ffn_norm, cfg.norm_eps, be.xp)
            x = x + f
        return rms_norm(x, self.norm, cfg.norm_eps, be.xp)

    # -- decoding one sequence, recorded ---------------------------------------------------
    @property
    def records_steps(self) -> bool:
        """Whether `step_logits` replays a recording (one launch per token). A batched
        `decode` is not recorded: it launches every kernel from Python, so on such a
        backend one recorded step per sequence is faster than one batched step for
        all (measured on an H100: 2.5 ms against 38 ms)."""
        return self._recording

    def step_logits(self, token: int, cache, device_token):
        """Feed one sampled token (`token` on the host, `device_token` the same id still
        on the device, shape (1,)) at the cache's next position; return the logits
        (n_vocab,) on the device.

        Where the backend records (`Backend.capture`: CUDA graphs), the step runs from a
        recording of its kernels, one per slot and span of `STEP_SPAN` positions
        (`_StepRecordings`); else, and for mixture-of-experts models, it is `hidden`
        then `device_logits`."""
        if not self._recording:
            return self._direct_step(token, cache, device_token)
        check_ids([token], self.config.n_vocab)
        cache.check_room(1)
        pool = cache.pool
        recordings = pool.recordings.get(cache.slot)
        if recordings is None:
            recordings = pool.recordings[cache.slot] = _StepRecordings(self, pool, cache.slot)
        try:
            logits = recordings.run(device_token, cache.offset)
        except _RECORDING_ERRORS as e:  # the backend could not record it: run unrecorded
            warnings.warn(f"recording the decode step failed ({e}); decoding without it",
                          RuntimeWarning, stacklevel=2)
            self._recording = False
            pool.recordings.clear()
            return self._direct_step(token, cache, device_token)
        cache.advance([token])
        return logits

    def _direct_step(self, token: int, cache, device_token):
        """`step_logits` unrecorded: `hidden` at the cache's positions, then the logits."""
        return self.device_logits(self.hidden(np.asarray([token]), cache, device_token))[0]

    def _recorded_step(self, token, pos, keys, values, length: int):
        """The decode step as `Backend.capture` records it: token (1,) and pos (1,) int32
        device buffers, the slot's keys and values per layer ((n_kv, max_len, hd) views
        into the pool), attention over the first `length` positions (those past `pos`
        masked). Nothing here depends on the position as a Python value."""
        cfg, be = self.config, self.backend
        x = self._embed(token)  # (1, D)
        h = self._stack(x, lambda i, layer, h: layer.attend_at(
            be, cfg, h, keys[i], values[i], pos, self.positions[:length]))
        return self.device_logits(h)  # (1, n_vocab)

    def device_logits(self, hidden):
        """(T, n_embd) device hidden states -> (T, n_vocab) device logits."""
        return self.output.matmul(hidden)

    def logits(self, hidden) -> np.ndarray:
        """(T, n_embd) hidden states -> (T, n_vocab) logits as NumPy."""
        if isinstance(hidden, np.ndarray):
            hidden = self.backend.asarray(hidden.astype(np.float32))
        return self.backend.to_host(self.device_logits(hidden))

    def forward(self, ids, cache) -> np.ndarray:
        """Logits (T, n_vocab), as NumPy, at every position of `ids`."""
        return self.logits(self.hidden(ids, cache))

    def kv_remove(self, cache, start: int, end: int) -> None:
        """`LlamaModel.kv_remove` on a device cache: the moved keys are re-rotated on the
        host (a rare edit, not the decode path)."""
        cache.check_span(start, end)
        n, shift = cache.offset, end - start
        if shift and end < n:
            be = self.backend
            for i, rope in enumerate(self.ropes):
                keys, values = cache.pool.keys[i], cache.pool.values[i]
                moved = be.to_host(keys[cache.slot, :, end:n])  # (n_kv, n - end, hd)
                keys[cache.slot, :, start : n - shift] = be.asarray(rope.shift(moved, -shift))
                values[cache.slot, :, start : n - shift] = values[cache.slot, :, end:n] + 0.0
        cache.offset = n - shift
        del cache.tokens[start:end]


class _StepRecordings:
    """The recorded decode steps of one KV-pool slot, one per span of `STEP_SPAN`
    positions, in least-recently-used order. The token and its position reach a
    recording through two device buffers, written before each replay (a device copy
    and a fill: nothing crosses from the host but a kernel argument)."""

    def __init__(self, model: DeviceLlamaModel, pool, slot: int):
        xp = model.xp
        self.model, self.max_len = model, pool.max_len
        self.token = xp.zeros((1,), dtype=xp.int32)
        self.pos = xp.zeros((1,), dtype=xp.int32)
        self.keys = [k[slot] for k in pool.keys]  # (n_kv, max_len, hd) views, per layer
        self.values = [v[slot] for v in pool.values]
        self.steps: OrderedDict[int, object] = OrderedDict()

    def run(self, device_token, offset: int):
        """Logits (n_vocab,) on the device of the token `device_token` (1,) at `offset`."""
        self.token[...] = device_token
        self.pos.fill(offset)
        length = min(self.max_len, (offset // llama.STEP_SPAN + 1) * llama.STEP_SPAN)
        step = self.steps.get(length)
        if step is not None:
            self.steps.move_to_end(length)
            return step()[0].copy()  # the recording's output is overwritten by its next replay

        def unrecorded():
            return self.model._recorded_step(self.token, self.pos, self.keys, self.values,
                                             length)

        logits = unrecorded()  # this step, run directly: kernels compile before the capture
        recorded = self.model.backend.capture(unrecorded) or unrecorded
        if recorded is not unrecorded:
            self._check(recorded(), logits)
        self.steps[length] = recorded
        if len(self.steps) > llama.MAX_RECORDINGS:
            self.steps.popitem(last=False)
        return logits[0]

    def _check(self, replayed, direct) -> None:
        """A new recording replayed once (the same token at the same position: it writes
        what the direct run wrote) must give the direct run's logits; else RuntimeError
        (`step_logits` then stops recording). One float comes to the host per recording."""
        xp = self.model.xp
        err = float(xp.abs(replayed - direct).max())
        scale = float(xp.abs(direct).max())
        if not err <= 1e-4 * scale:  # also catches NaN
            raise RuntimeError(f"the recorded decode step disagrees with the direct one "
                               f"(max |difference| {err:.3g}, logits up to {scale:.3g})")


class _DeviceLayer:
    """One layer's weights on the device, and its attention."""

    def __init__(self, block: Block, backend, cos, sin):
        attn = block.attn
        self.attn_norm = backend.vector(block.attn_norm)
        self.ffn_norm = backend.vector(block.ffn_norm)
        self.post_attn_norm = backend.vector(block.post_attn_norm)
        self.post_ffn_norm = backend.vector(block.post_ffn_norm)
        self.wqkv = backend.weight(attn.wqkv)
        self.bqkv = backend.vector(attn.bqkv)
        self.wo = backend.weight(attn.wo)
        self.q_norm, self.k_norm = backend.vector(attn.q_norm), backend.vector(attn.k_norm)
        self.moe = None
        if isinstance(block.ffn, MoEFeedForward):
            self.moe = DeviceMoEFeedForward(block.ffn, backend)
        else:
            self.gate_up = backend.weight(block.ffn.gate_up)
            self.down = backend.weight(block.ffn.down)
        self.window = attn.window
        self.cos, self.sin = cos, sin  # (max_len, rope_dim / 2)
        self.rope_dim, self.neox = attn.rope.dim, attn.rope.neox

    def _rope(self, xp, x, cos, sin):
        """x (T, heads, head_dim) rotated by the angles' cos and sin (T, 1, rope_dim / 2)."""
        return rotate(xp, x, cos, sin, self.rope_dim, self.neox)

    def _qkv(self, be, cfg: LlamaConfig, h):
        """h (T, D) normed input -> q (T, n_head, hd), k and v (T, n_kv, hd), before RoPE."""
        qkv = self.wqkv.matmul(h)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        return split_heads(qkv, cfg, self.q_norm, self.k_norm, be.xp)

    def _attend(self, be, cfg: LlamaConfig, q, kk, vv, hidden):
        """q (T, n_head, hd) over keys and values kk, vv (n_kv, S, hd), with `hidden`
        (T, S) or (S,) True where a query may not look (None: nowhere) -> (T, n_head * hd)."""
        xp = be.xp
        T, (n_head, n_kv, hd) = q.shape[0], (cfg.n_head, cfg.n_head_kv, cfg.head_dim)
        qg = q.reshape(T, n_kv, n_head // n_kv, hd).transpose(1, 2, 0, 3)  # (n_kv, group, T, hd)
        scores = (qg @ kk[:, None].swapaxes(-1, -2)) * (1.0 / float(np.sqrt(hd)))
        if hidden is not None:  # scores: (n_kv, group, T, S)
            scores = xp.where(hidden, -np.inf, scores)
        out = be.softmax(scores, axis=-1) @ vv[:, None]  # (n_kv, group, T, hd)
        return out.transpose(2, 0, 1, 3).reshape(T, n_head * hd)

    def attention(self, be, cfg: LlamaConfig, h, caches, counts, layer: int):
        """h (sum(counts), D) normed input -> (sum(counts), D) attention output; writes each
        sequence's new keys and values into its cache."""
        xp = be.xp
        q, k, v = self._qkv(be, cfg, h)
        outs, row = [], 0
        for cache, count in zip(caches, counts):  # each sequence at its own positions
            span = slice(row, row + count)
            outs.append(self._attend_one(be, cfg, q[span], k[span], v[span], cache, layer))
            row += count
        out = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=0)
        return self.wo.matmul(out)

    def _attend_one(self, be, cfg: LlamaConfig, q, k, v, cache, layer: int):
        """One sequence: q (T, n_head, hd), k, v (T, n_kv, hd) at positions start ..
        start + T - 1 -> (T, n_head * hd)."""
        xp = be.xp
        start, T = cache.offset, q.shape[0]
        end = start + T
        cos, sin = self.cos[start:end, None, :], self.sin[start:end, None, :]
        q, k = self._rope(xp, q, cos, sin), self._rope(xp, k, cos, sin)
        keys, values = cache.pool.keys[layer], cache.pool.values[layer]
        keys[cache.slot, :, start:end] = k.transpose(1, 0, 2)
        values[cache.slot, :, start:end] = v.transpose(1, 0, 2)
        lo = max(0, start - self.window + 1) if self.window else 0
        hidden = None
        if T > 1:  # query t at start + t sees keys up to it
            key_pos = xp.arange(lo, end)[None, :]
            query_pos = xp.arange(start, end)[:, None]
            hidden = masked_keys(key_pos, query_pos, self.window)
        return self._attend(be, cfg, q, keys[cache.slot, :, lo:end],
                            values[cache.slot, :, lo:end], hidden)

    def attend_at(self, be, cfg: LlamaConfig, h, keys, values, pos, key_pos):
        """The recorded step's attention: one token h (1, D) at position `pos` (1,) int32
        on the device, writing into keys and values ((n_kv, max_len, hd) views of one
        slot) and attending over the positions `key_pos` (S,), with those after `pos`
        (and, in a sliding window, those too far behind it) masked -> (1, D)."""
        q, k, v = self._qkv(be, cfg, h)
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]  # (1, 1, rope_dim / 2)
        q, k = self._rope(be.xp, q, cos, sin), self._rope(be.xp, k, cos, sin)
        keys[:, pos] = k.transpose(1, 0, 2)  # (n_kv, 1, hd) into position pos
        values[:, pos] = v.transpose(1, 0, 2)
        S = key_pos.shape[0]
        # one kernel where the backend has it (CUDA: cupy.matmul calls cuBLAS, which
        # CuPy refuses while a CUDA graph is being captured)
        out = be.attend_step(q[0], keys, values, pos, S, self.window,
                             1.0 / float(np.sqrt(cfg.head_dim)))
        if out is not None:
            return self.wo.matmul(out.reshape(1, -1))
        hidden = masked_keys(key_pos, pos, self.window)
        out = self._attend(be, cfg, q, keys[:, :S], values[:, :S], hidden)
        return self.wo.matmul(out)
