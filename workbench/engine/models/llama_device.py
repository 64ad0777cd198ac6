"""The llama-family forward pass (Gemma 3 included) on a GPU backend's arrays
(`workbench.engine.runtime.backend`: CuPy on CUDA, MLX), built from a loaded `LlamaModel`.

The math is the host model's, written over the backend's array module and its
operations (`Backend.rms_norm`, `rope` and `glu`: the host's formulas, one kernel each on
CUDA), the family's quirks read from the same blocks (Gemma 3's
post-norms and GeGLU, sliding windows, Qwen's Q/K norms and biases). The tests check
it against transformers' logits on the "cuda-on-numpy" and "mlx" devices
(tests/test_tiny_models.py, tests/test_tiny_families.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from workbench.engine.models.feed_forward import FeedForward, device_glu
from workbench.engine.models.llama import (
    Block,
    LlamaModel,
    check_batch,
    check_chunks,
    check_ids,
    masked_keys,
    split_heads,
)
from workbench.engine.models.llama_config import LlamaConfig
from workbench.engine.models.moe import DeviceMoEFeedForward, MoEFeedForward
from workbench.engine.runtime.backend import BatchRow, row_array, stack_rows

_RECORDING_ERRORS = (RuntimeError,)  # what CuPy raises when a CUDA graph cannot be made
RECORDED_PREFILL_ROWS = 512  # `DeviceLlamaModel.recorded_prefill_rows`' default


class DeviceLlamaModel:
    """The llama-family forward pass (Gemma 3 included) on a GPU backend's arrays.

    Built from a loaded `LlamaModel`: every weight is uploaded once
    (`Backend.weight`), and the host copies are dropped with the CPU model. The
    caches are a `DeviceKVPool`'s. A decode step moves nothing between host and
    device: in `hidden` positions are Python ints that slice the device's RoPE tables
    and caches, and `hidden` / `device_logits` return device arrays. `step_logits`,
    the scheduler's step, reads the sequences' tokens, slots and positions from device
    buffers instead, so that the backend can record it once and replay it (CUDA graphs:
    one launch per step of up to `step_rows` sequences instead of a few hundred). `logits`
    returns NumPy, for the callers that read every logit (branches, speculative
    decoding, `LLM.forward`).
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
        # recorded decode steps: where the backend records, for models without experts
        # (their routing goes through the host), until a recording fails
        self._recording = backend.records and all(layer.moe is None for layer in self.layers)
        # the fused step (six launches a layer) where the backend has its kernels and every
        # layer is llama's plain one (no post-norms); else the layers' kernels one by one
        self._fused = (self._recording and backend.fused_rows > 0
                       and hasattr(self.output, "step_matmul") and hasattr(self.embed, "rows")
                       and all(layer.fusable for layer in self.layers))
        # prompts of up to this many tokens (in one pass) are read by the fused step's
        # recordings, `step_rows` tokens a replay (`_recorded_hidden`); longer ones by the
        # layers' kernels one by one (a few dozen launches a layer, cuBLAS for the
        # products). An estimate until measured on a card (bench/gpu.py prints both).
        self.recorded_prefill_rows = RECORDED_PREFILL_ROWS

    @property
    def step_rows(self) -> int:
        """How many sequences one recorded decode step takes."""
        return self.backend.fused_rows if self._fused else self.backend.step_rows

    # -- caches -----------------------------------------------------------------------------
    def new_pool(self, n_slots: int, max_len: int | None = None):
        """Device KV-cache room for `n_slots` sequences of up to `max_len` positions."""
        from workbench.engine.runtime.kv_cache import DeviceKVPool

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
        if self._prefills_recorded(ids.size, cache.pool.shape[1]):
            h = self._recorded_hidden([ids], [cache])
        else:
            x = self._embed(ids if device_ids is None else device_ids)  # (T, D)
            h = self._layers(x, [cache], [ids.size])
        cache.advance(ids)
        return h

    def hidden_batch(self, chunks) -> list:
        """`LlamaModel.hidden_batch` on the device: (ids (T_i,), cache) pairs, one forward
        pass for all (every product over all sum(T_i) rows, attention per sequence) ->
        each chunk's final-normed hidden states (T_i, n_embd) on the device."""
        if not chunks:
            return []
        ids, caches, counts = check_chunks(chunks, self.config.n_vocab)
        if self._prefills_recorded(sum(counts), caches[0].pool.shape[1]):
            h = self._recorded_hidden(ids, caches)  # (sum T_i, D)
        else:
            h = self._layers(self._embed(np.concatenate(ids)), caches, counts)
        for c, t in zip(caches, ids):
            c.advance(t)
        bounds = np.cumsum(counts).tolist()
        return [h[lo:hi] for lo, hi in zip([0] + bounds[:-1], bounds)]

    def _prefills_recorded(self, rows: int, n_slots: int) -> bool:
        """Whether prompt tokens (`rows` in one pass, in a pool of `n_slots`) run on the
        recorded decode step's kernels (`_recorded_hidden`) rather than the layers'
        kernels one by one. Recordings belong to a KV pool and cost a few passes to make
        and check, so a pool of one sequence (`new_cache`: a branch's, `forward`'s) reads
        without them; the scheduler's pool of many slots makes them once."""
        return (self._recording and self._fused and rows <= self.recorded_prefill_rows
                and n_slots > 1)

    def _recorded_hidden(self, ids: list[np.ndarray], caches: list):
        """Prompt chunks `ids[i]` of `caches[i]` (at the caches' offsets; not advanced
        here) through the fused step's recordings, up to `step_rows` tokens a replay,
        each token a row at its own slot and position -> final-normed hidden states
        (sum T_i, D) on the device."""
        tokens = np.concatenate(ids).astype(np.int32)
        slots = np.concatenate([np.full(len(t), c.slot, np.int32) for t, c in zip(ids, caches)])
        pos = np.concatenate([np.arange(c.offset, c.offset + len(t), dtype=np.int32)
                              for t, c in zip(ids, caches)])
        pool = caches[0].pool
        per, parts = self.step_rows, []
        for i in range(0, tokens.size, per):
            try:
                parts.append(self._recordings(pool).hidden(tokens[i : i + per], slots[i : i + per],
                                                    pos[i : i + per]))
            except _RECORDING_ERRORS as e:  # the layers' kernels one by one instead
                self._recording_failed(e, pool)
                counts = [len(t) for t in ids]
                return self._layers(self._embed(tokens), caches, counts)
        return parts[0] if len(parts) == 1 else self.xp.concatenate(parts)

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
        its normed input h. Each residual add goes with the norm after it (one kernel on
        CUDA: `Backend.rms_norm` with `add`)."""
        cfg, be, layers = self.config, self.backend, self.layers
        eps = cfg.norm_eps
        h = be.rms_norm(x, layers[0].attn_norm, eps)
        for i, layer in enumerate(layers):
            a = attend(i, layer, h)
            if layer.post_attn_norm is not None:
                a = be.rms_norm(a, layer.post_attn_norm, eps)
            x, h = be.rms_norm(x, layer.ffn_norm, eps, add=a)
            if layer.moe is not None:
                f = layer.moe(h)
            else:
                f = device_glu(be, layer.gate_up, layer.down, h, self.gelu)
            if layer.post_ffn_norm is not None:
                f = be.rms_norm(f, layer.post_ffn_norm, eps)
            after = layers[i + 1].attn_norm if i + 1 < len(layers) else self.norm
            x, h = be.rms_norm(x, after, eps, add=f)
        return h

    # -- the decode step, recorded -----------------------------------------------------------
    def step_logits(self, tokens: Sequence[int], caches: list, device_tokens: list) -> Any:
        """Feed one sampled token to each of N caches (of one pool) at its next position:
        `tokens` (N,) on the host, `device_tokens` the same ids still on the device (each
        a (1,) array or a `BatchRow` of one; None where only the host has it). Returns the
        logits (N, n_vocab) on the device.

        Where the backend records (`Backend.capture`: CUDA graphs), the step runs from
        recordings of its kernels that read the tokens, slots and positions from device
        buffers: one recording per number of rows (1, 2, 4, ... `step_rows`), so one
        launch decodes up to `step_rows` sequences at any positions (`_StepRecordings`).
        The fused step (`_fused_step`: 64 rows on CUDA) is checked against the layers'
        kernels run one by one when each recording is made, and left for them if it
        disagrees. Else, and for mixture-of-experts models, it is `decode` then
        `device_logits`."""
        tokens = check_batch(tokens, caches, self.config.n_vocab)
        if not self._recording:
            return self._direct_step(tokens, caches, device_tokens)
        for c in caches:
            c.check_room(1)
        pool = caches[0].pool
        parts, per = [], self.step_rows
        try:
            for i in range(0, len(caches), per):
                parts.append(self._recordings(pool).run(tokens[i : i + per],
                                                 device_tokens[i : i + per],
                                                 caches[i : i + per]))
        except _RECORDING_ERRORS as e:
            self._recording_failed(e, pool)
            return self.step_logits(tokens, caches, device_tokens)
        for c, t in zip(caches, tokens):
            c.advance([int(t)])
        return parts[0] if len(parts) == 1 else self.xp.concatenate(parts)

    def _recordings(self, pool) -> _StepRecordings:
        """`pool`'s recordings of the step (made empty on first use)."""
        if pool.recordings is None:
            pool.recordings = _StepRecordings(self, pool)
        return pool.recordings

    def _recording_failed(self, error: RuntimeError, pool) -> None:
        """A recording could not be made (warned once): where the fused step disagreed
        with the layers' kernels, record those instead; where the backend could not
        record at all (or a replay disagreed), run without recordings."""
        if isinstance(error, _FusedStepMismatch):
            warnings.warn(f"{error}; recording the unfused decode step", RuntimeWarning,
                          stacklevel=3)
            self._fused = False
        else:
            warnings.warn(f"recording the decode step failed ({error}); decoding without it",
                          RuntimeWarning, stacklevel=3)
            self._recording = False
        pool.recordings = None

    def _direct_step(self, tokens: np.ndarray, caches: list, device_tokens: list) -> Any:
        """`step_logits` unrecorded: `decode` at the caches' positions, then the logits."""
        on_device = (None if any(d is None for d in device_tokens)
                     else stack_rows(self.xp, device_tokens).reshape(len(caches)))
        return self.device_logits(self.decode(tokens, caches, on_device))  # (N, n_vocab)

    def _recorded_step(self, tokens, slots, pos, keys: list, values: list,
                       logits: bool = True):
        """The decode step as `Backend.capture` records it: B tokens, each of the sequence
        in pool slot slots[b] at position pos[b] ((B,) int32 device buffers), over the
        pool's keys and values per layer ((n_slots, n_kv, max_len, hd)) -> (B, n_vocab),
        or with `logits` False the final-normed hidden states (B, D) (prompt tokens).
        Nothing here depends on a slot or a position as a Python value. The fused step
        where this model has it (`_fused_step`), else the layers' kernels one by one."""
        if self._fused:
            return self._fused_step(tokens, slots, pos, keys, values, logits)
        return self._unfused_step(tokens, slots, pos, keys, values, logits)

    def _unfused_step(self, tokens, slots, pos, keys: list, values: list,
                      logits: bool = True):
        """`_recorded_step` with each norm, product, RoPE and activation its own kernel."""
        cfg, be = self.config, self.backend
        x = self._embed(tokens)  # (B, D)
        h = self._stack(x, lambda i, layer, h: layer.attend_rows(
            be, cfg, h, keys[i], values[i], slots, pos))
        return self.device_logits(h) if logits else h  # (B, n_vocab) or (B, D)

    def _fused_step(self, tokens, slots, pos, keys: list, values: list, logits: bool = True):
        """`_recorded_step` in six launches a layer (`Backend.fused_rows`): the QKV product
        with the norm before it and the bias; the per-head norms, RoPE and the KV writes
        (`rope_store`); the attention; the output product added to the residual stream;
        gate and up with the norm before them and the activation after; down, added to the
        residual stream. Then the final norm with the output product (with `logits`
        False, the final norm alone)."""
        cfg, be, xp = self.config, self.backend, self.xp
        eps, b = cfg.norm_eps, tokens.shape[0]
        scale = 1.0 / float(np.sqrt(cfg.head_dim))
        x = self._embed(tokens)  # (B, D): the residual stream, added to in place
        for i, layer in enumerate(self.layers):
            qkv = xp.empty((b, layer.wqkv.shape[0]), dtype=xp.float32)
            layer.wqkv.step_matmul(x, qkv, layer.attn_norm, eps, layer.bqkv)
            q = be.rope_store(qkv, layer.q_norm, layer.k_norm, eps, layer.cos, layer.sin,
                              layer.rope_dim, layer.neox, keys[i], values[i], slots, pos,
                              cfg.n_head)  # (B, n_head, hd)
            a = be.attend_step(q, None, None, keys[i], values[i], slots, pos, layer.window,
                               scale)  # (B, n_head * hd)
            layer.wo.step_matmul(a, x, epilogue="add")
            layer.down.step_matmul(layer.gated_step(be, x, eps, self.gelu), x, epilogue="add")
        if not logits:
            return be.rms_norm(x, self.norm, eps)  # (B, D)
        out = xp.empty((b, self.output.shape[0]), dtype=xp.float32)
        self.output.step_matmul(x, out, self.norm, eps)
        return out

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
    """The recorded decode steps of one KV pool, one per number of rows: B sequences'
    tokens, slots and positions reach a recording through three (step_rows,) device
    buffers, written before each replay (device copies and fills: nothing crosses from
    the host but kernel arguments). N sequences run on the recording of the next power
    of two rows; the rows past N repeat the first sequence (the same token at the same
    place: they write what it writes)."""

    def __init__(self, model: DeviceLlamaModel, pool):
        xp, n = model.xp, model.step_rows
        self.model, self.keys, self.values = model, pool.keys, pool.values
        self.tokens = xp.zeros((n,), dtype=xp.int32)
        self.slots = xp.zeros((n,), dtype=xp.int32)
        self.pos = xp.zeros((n,), dtype=xp.int32)
        self.written = [(0, 0)] * n  # (slot, position) in each row of the buffers
        # (rows, logits) -> its recording: the decode step's (logits out), and the
        # prompts' (final-normed hidden states out)
        self.steps: dict[tuple[int, bool], Callable[[], Any]] = {}

    def __len__(self) -> int:
        return len(self.steps)

    def run(self, tokens: np.ndarray, device_tokens: list, caches: list) -> Any:
        """Logits (n, n_vocab) on the device of each cache's token at the cache's offset,
        for up to step_rows caches: `tokens[i]` on the host, `device_tokens[i]` the same
        id on the device (a (1,) array or a `BatchRow` of one), or None where it is only
        on the host (a prompt's tail read on the decode path)."""
        n = len(caches)
        rows = min(1 << (n - 1).bit_length(), self.tokens.shape[0])
        order = list(range(n)) + [0] * (rows - n)  # the sequence of each row
        self._place([(caches[i].slot, caches[i].offset) for i in order])
        if all(d is not None for d in device_tokens):
            if n == 1 and type(device_tokens[0]) is not BatchRow:
                self.tokens[:1] = device_tokens[0]
            else:  # the picked ids of a step come back whole (`stack_rows`)
                ids = stack_rows(self.model.xp, device_tokens)  # (n, 1)
                self.tokens[:n] = ids.reshape(n)
                if rows > n:
                    self.tokens[n:rows] = ids[0]
        else:
            for j, i in enumerate(order):
                if device_tokens[i] is None:
                    self.tokens[j : j + 1].fill(int(tokens[i]))
                else:
                    self.tokens[j : j + 1] = row_array(device_tokens[i])
        return self._replay(rows, True)[:n].copy()  # (the next replay overwrites it)

    def hidden(self, tokens: np.ndarray, slots: np.ndarray, pos: np.ndarray) -> Any:
        """Final-normed hidden states (n, D) on the device of n <= step_rows prompt tokens,
        row i token tokens[i] of the sequence in slot slots[i] at position pos[i] (host
        int32 arrays: one copy up each). The rows past n repeat the last token (the same
        key and value written at the same place)."""
        n = tokens.size
        rows = min(1 << (n - 1).bit_length(), self.tokens.shape[0])
        order = np.minimum(np.arange(rows), n - 1)  # the token of each row
        xp = self.model.xp
        for buffer, values in ((self.tokens, tokens), (self.slots, slots), (self.pos, pos)):
            buffer[:rows] = xp.asarray(values[order])
        self.written[:rows] = list(zip(slots[order].tolist(), pos[order].tolist()))
        return self._replay(rows, False)[:n].copy()

    def _replay(self, rows: int, logits: bool) -> Any:
        """The recording of `rows` rows (made on first use) run on the buffers as they are."""
        step = self.steps.get((rows, logits))
        if step is None:
            step = self._record(rows, logits)
        return step()

    def _place(self, want: list[tuple[int, int]]) -> None:
        """Write each row's slot and position into the buffers: one add where every row
        moved on by one position in its slot (a running batch), else a fill per change."""
        rows, was = len(want), self.written[: len(want)]
        if all(s == ws and p == wp + 1 for (s, p), (ws, wp) in zip(want, was)):
            self.pos += 1
            self.written = [(s, p + 1) for s, p in self.written]
            return
        for j, ((s, p), (ws, wp)) in enumerate(zip(want, was)):
            if s != ws:
                self.slots[j : j + 1].fill(s)
            if p != wp:
                self.pos[j : j + 1].fill(p)
        self.written[:rows] = want

    def _record(self, rows: int, logits: bool) -> Callable[[], Any]:
        """Run the step of `rows` rows directly (kernels compile before the capture),
        record it, and check the recording against it."""
        tokens, slots, pos = self.tokens[:rows], self.slots[:rows], self.pos[:rows]

        def unrecorded():
            return self.model._recorded_step(tokens, slots, pos, self.keys, self.values,
                                             logits)

        # the layers' kernels one by one first (they write the same keys and values at
        # the same places, which the fused step then overwrites)
        unfused = self.model._unfused_step(tokens, slots, pos, self.keys, self.values,
                                           logits) if self.model._fused else None
        direct = unrecorded()
        if unfused is not None:
            err, scale = self._difference(direct, unfused)
            if not err <= 1e-3 * scale:  # summation orders differ; NaN fails too
                raise _FusedStepMismatch(
                    f"the fused decode step disagrees with the layers' kernels (max "
                    f"|difference| {err:.3g}, values up to {scale:.3g})")
        recorded = self.model.backend.capture(unrecorded) or unrecorded
        if recorded is not unrecorded:
            err, scale = self._difference(recorded(), direct)
            if not err <= 1e-4 * scale:  # also catches NaN
                raise RuntimeError(f"the recorded decode step disagrees with the direct one "
                                   f"(max |difference| {err:.3g}, values up to {scale:.3g})")
        self.steps[rows, logits] = recorded
        return recorded

    def _difference(self, logits, reference) -> tuple[float, float]:
        """(max |logits - reference|, max |reference|): one copy of two floats to the
        host, once per recording (a recording replayed once must give the direct run's
        logits, the fused step the unfused one's; else `step_logits` stops recording, or
        fusing)."""
        xp = self.model.xp
        both = xp.stack([xp.abs(logits - reference).max(), xp.abs(reference).max()])
        err, scale = self.model.backend.to_host(both).tolist()
        return err, scale


class _FusedStepMismatch(RuntimeError):
    """The fused decode step's logits are not the unfused step's."""


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
        # what the fused decode step needs: every product a step kernel, no post-norms
        products = [self.wqkv, self.wo] + ([] if self.moe else [self.gate_up, self.down])
        self.fusable = (self.moe is None and self.post_attn_norm is None
                        and self.post_ffn_norm is None
                        and all(hasattr(p, "step_matmul") for w in products
                                for p in getattr(w, "parts", [w])))

    def gated_step(self, be, x, eps: float, gelu: bool):
        """The fused step's gate and up products of x (B, D) with the FFN norm before them
        -> act(gate) * up (B, n_ff): one launch where gate and up are one matrix, else
        both products then `Backend.glu`."""
        xp, b, n_ff = be.xp, x.shape[0], self.gate_up.shape[0] // 2
        if not hasattr(self.gate_up, "parts"):
            out = xp.empty((b, n_ff), dtype=xp.float32)
            self.gate_up.step_matmul(x, out, self.ffn_norm, eps,
                                     epilogue="gelu" if gelu else "silu")
            return out
        gu = xp.empty((b, 2 * n_ff), dtype=xp.float32)
        self.gate_up.step_matmul(x, gu, self.ffn_norm, eps)
        return be.glu(gu, gelu)

    def _rope(self, be, x, pos):
        """x (T, heads, head_dim), token t rotated to position pos[t] ((T,) int32)."""
        return be.rope(x, self.cos, self.sin, pos, self.rope_dim, self.neox)

    def _qkv(self, be, cfg: LlamaConfig, h):
        """h (T, D) normed input -> q (T, n_head, hd), k and v (T, n_kv, hd), before RoPE."""
        qkv = self.wqkv.matmul(h)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        q, k, v = split_heads(qkv, cfg, None, None, be.xp)
        if self.q_norm is not None:  # per head (Qwen3, Gemma 3)
            q = be.rms_norm(q, self.q_norm, cfg.norm_eps)
            k = be.rms_norm(k, self.k_norm, cfg.norm_eps)
        return q, k, v

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
        pos = xp.arange(start, end, dtype=xp.int32)
        q, k = self._rope(be, q, pos), self._rope(be, k, pos)
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

    def attend_rows(self, be, cfg: LlamaConfig, h, keys, values, slots, pos):
        """The recorded step's attention: row b of h (B, D) one token of the sequence in
        slot slots[b] at position pos[b] ((B,) int32 on the device), written into that
        slot of keys and values ((n_slots, n_kv, max_len, hd), this layer's) and attending
        over its positions up to pos[b] (in a sliding window, those not too far behind)
        -> (B, D). The kernels of `Backend.attend_step` write and attend (CUDA's
        cupy.matmul calls cuBLAS, which CuPy refuses while a CUDA graph is being
        captured)."""
        q, k, v = self._qkv(be, cfg, h)  # (B, n_head, hd), (B, n_kv, hd)
        q, k = self._rope(be, q, pos), self._rope(be, k, pos)
        out = be.attend_step(q, k, v, keys, values, slots, pos, self.window,
                             1.0 / float(np.sqrt(cfg.head_dim)))
        return self.wo.matmul(out)
