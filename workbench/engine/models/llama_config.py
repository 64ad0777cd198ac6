"""The settings of a llama-family decoder (`LlamaConfig`) read from a GGUF file's
metadata, and the checks that the file's tensors fit them.

Each family's differences are flags here, set from the architecture name and the
metadata: NEOX RoPE (qwen2, qwen3, their MoE variants, phi3, gemma3), per-head Q/K
norms (qwen3, qwen3moe, gemma3), sliding windows (`sliding_window` with a layer
pattern: Mistral, phi3, Gemma 3), LongRoPE's original context (phi3) and the
mixture-of-experts routing (Mixtral, qwen2moe, qwen3moe). The models that use
them are in `workbench.engine.models.llama` and `workbench.engine.models.gemma3`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from workbench.engine.formats.gguf import GGUFError, GGUFFile
from workbench.engine.models.sizes import TransformerSizes

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3")
_NEOX = ("qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma3")
_QK_NORM = ("qwen3", "qwen3moe", "gemma3")
# whether the chosen experts' weights are rescaled to sum to 1, when the file does not say
_EXPERT_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True}

MAX_NORM_EPS = 1.0  # an RMS-norm epsilon past this (real ones are ~1e-6) would flatten every norm


@dataclass(frozen=True)
class LlamaConfig(TransformerSizes):
    """A llama-family decoder's settings (`from_gguf`: from its `{arch}.*` metadata)."""

    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int  # context length the model was trained for
    norm_eps: float
    rope_base: float
    rope_dim: int  # leading dims of each head that RoPE rotates
    rope_neox: bool  # rotate (x[i], x[i + d/2]) pairs instead of (x[2i], x[2i+1])
    rope_linear_factor: float  # positions are divided by this (1.0: no scaling)
    qk_norm: bool
    rope_attn_factor: float = 1.0  # cos and sin are multiplied by this (LongRoPE)
    rope_orig_ctx: int = 0  # LongRoPE: contexts longer than this use the long factors
    sliding_window: int = 0  # local layers see this many positions, themselves included
    # with a window: every `swa_pattern`-th layer is global, the others local (0: all local),
    # unless `swa_layers` flags each layer (True: local)
    swa_pattern: int = 0
    swa_layers: tuple[bool, ...] = ()
    n_expert: int = 0  # mixture of experts: experts per layer (0: a dense feed-forward)
    n_expert_used: int = 0  # experts each token is routed to
    expert_weights_norm: bool = True  # the chosen experts' weights are rescaled to sum to 1

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        if not self.sliding_window:
            return False
        if self.swa_layers:
            return self.swa_layers[layer]
        return not self.swa_pattern or (layer + 1) % self.swa_pattern != 0

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> LlamaConfig:
        """The settings in `{arch}.*` metadata, each checked to be of the right type, finite
        and in range, and consistent with the others (a `GGUFError` naming the key)."""
        arch = g.architecture
        if arch not in ARCHITECTURES + ("gemma3",):
            raise GGUFError(f"{arch!r} is not a llama-family architecture")
        name = g.path.name

        def get_int(key: str, default: int | None = None, lo: int = 1) -> int:
            return g.get_int(f"{arch}.{key}", default, lo=lo)

        def get_float(key: str, default: float | None = None, hi: float = math.inf) -> float:
            return g.get_float(f"{arch}.{key}", default, hi=hi)

        n_embd = get_int("embedding_length")
        n_head = get_int("attention.head_count")
        n_head_kv = get_int("attention.head_count_kv", n_head)
        if n_head % n_head_kv:
            raise GGUFError(f"{name}: {n_head} query heads do not share {n_head_kv} KV heads "
                            f"evenly ({arch}.attention.head_count_kv must divide head_count)")
        if f"{arch}.attention.key_length" not in g.metadata and n_embd % n_head:
            raise GGUFError(f"{name}: embedding_length {n_embd} does not split into {n_head} "
                            f"heads and the file gives no {arch}.attention.key_length")
        head_dim = get_int("attention.key_length", n_embd // n_head)
        if get_int("attention.value_length", head_dim) != head_dim:
            raise GGUFError("different key and value head sizes are not supported")
        rope_dim = get_int("rope.dimension_count", head_dim)
        if rope_dim > head_dim or rope_dim % 2:
            raise GGUFError(f"{name}: {arch}.rope.dimension_count {rope_dim} must be even and "
                            f"at most the head size {head_dim}")

        def unset(key: str) -> bool:  # absent, or 0 (some converters write 0 for "none")
            value = g.get(f"{arch}.{key}")
            return value is None or (isinstance(value, (int, float)) and value == 0)

        scaling = g.get(f"{arch}.rope.scaling.type", "none")
        if not isinstance(scaling, str):
            raise GGUFError(f"{name}: {arch}.rope.scaling.type must be a string")
        factor = 1.0 if unset("rope.scaling.factor") else get_float("rope.scaling.factor")
        if scaling not in ("none", "linear") and factor != 1.0:
            raise GGUFError(f"RoPE scaling {scaling!r} is not supported (none, linear and "
                            "Llama 3 frequency factors are)")
        n_vocab = _vocab_size(g, arch)
        n_layer = g.layer_count(f"{arch}.block_count")  # checked against the blk.N tensors
        n_expert = get_int("expert_count", 0, lo=0)
        pattern = g.get(f"{arch}.attention.sliding_window_pattern", 0)
        if np.isscalar(pattern):
            swa_pattern, swa_layers = get_int("attention.sliding_window_pattern", 0, lo=0), ()
        elif len(pattern) == n_layer:
            swa_pattern, swa_layers = 0, tuple(bool(v) for v in pattern)
        else:
            raise GGUFError(f"{name}: {arch}.attention.sliding_window_pattern flags "
                            f"{len(pattern)} layers of {n_layer}")
        if arch in ("qwen2moe", "qwen3moe") and not n_expert:
            raise GGUFError(f"{name} lacks the metadata key {arch}.expert_count")
        n_expert_used = get_int("expert_used_count", None, lo=1) if n_expert else 0
        if n_expert_used > n_expert:
            raise GGUFError(f"{name}: {arch}.expert_used_count {n_expert_used} is more than "
                            f"the {n_expert} experts")
        norm_experts = g.get(f"{arch}.expert_weights_norm", _EXPERT_NORM.get(arch, True))
        if not isinstance(norm_experts, (bool, int)):
            raise GGUFError(f"{name}: {arch}.expert_weights_norm must be a boolean")
        return cls(
            arch=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_ff=get_int("feed_forward_length"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=get_int("context_length"),
            norm_eps=get_float("attention.layer_norm_rms_epsilon", hi=MAX_NORM_EPS),
            rope_base=get_float("rope.freq_base", 10000.0),
            rope_dim=rope_dim,
            rope_neox=arch in _NEOX,
            rope_linear_factor=factor if scaling == "linear" else 1.0,
            qk_norm=arch in _QK_NORM,
            rope_attn_factor=(1.0 if unset("rope.scaling.attn_factor")
                              else get_float("rope.scaling.attn_factor")),
            rope_orig_ctx=get_int("rope.scaling.original_context_length", 0, lo=0),
            sliding_window=get_int("attention.sliding_window", 0, lo=0),
            swa_pattern=swa_pattern,
            swa_layers=swa_layers,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            expert_weights_norm=bool(norm_experts),
        )


def _vocab_size(g: GGUFFile, arch: str) -> int:
    """The number of tokens: the tokenizer's, which `{arch}.vocab_size` (when given) and the
    rows of `token_embd.weight` must match, so that every token id has an embedding."""
    tokens = g.require("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{g.path.name}: tokenizer.ggml.tokens must be a non-empty list of "
                        "strings")
    n_vocab = g.get_int(f"{arch}.vocab_size", len(tokens))
    rows = g.tensor("token_embd.weight").shape[0]
    if not n_vocab == len(tokens) == rows:
        raise GGUFError(f"{g.path.name}: the vocabulary does not add up: {len(tokens)} tokens, "
                        f"{arch}.vocab_size {n_vocab}, {rows} rows in token_embd.weight")
    return n_vocab


def check_tensor_shapes(g: GGUFFile, cfg: LlamaConfig) -> None:
    """A `GGUFError` naming the first tensor whose shape does not fit `cfg` (the kernels
    index the weights by the config's sizes, so a mismatch must stop the load)."""
    D, hd, F = cfg.n_embd, cfg.head_dim, cfg.n_ff
    q, kv = cfg.n_head * hd, cfg.n_head_kv * hd
    # the query projection (or phi3's fused one) must be there to check the head sizes
    # against, before the RoPE tables are sized by them
    if "blk.0.attn_qkv.weight" not in g.tensors:
        g.tensor("blk.0.attn_q.weight")
    expected: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.n_vocab, D), "output.weight": (cfg.n_vocab, D),
        "output_norm.weight": (D,)}
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        expected.update({
            p + "attn_norm.weight": (D,), p + "ffn_norm.weight": (D,),
            p + "post_attention_norm.weight": (D,), p + "post_ffw_norm.weight": (D,),
            p + "attn_q.weight": (q, D), p + "attn_k.weight": (kv, D),
            p + "attn_v.weight": (kv, D), p + "attn_qkv.weight": (q + 2 * kv, D),
            p + "attn_output.weight": (D, q), p + "attn_q.bias": (q,),
            p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,),
            p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
        if not cfg.n_expert:
            gated = p + "ffn_gate.weight" in g.tensors  # phi3: gate and up in one ffn_up
            expected.update({p + "ffn_gate.weight": (F, D),
                             p + "ffn_up.weight": (F, D) if gated else (2 * F, D),
                             p + "ffn_down.weight": (D, F)})
            continue
        E = cfg.n_expert
        down = g.tensors.get(p + "ffn_down_exps.weight")
        F_e = down.shape[-1] if down is not None else 0
        expected.update({
            p + "ffn_gate_inp.weight": (E, D), p + "ffn_down_exps.weight": (E, D, F_e),
            p + "ffn_gate_exps.weight": (E, F_e, D), p + "ffn_up_exps.weight": (E, F_e, D),
            p + "ffn_gate_up_exps.weight": (E, 2 * F_e, D)})
        shared = g.tensors.get(p + "ffn_down_shexp.weight")
        F_s = shared.shape[-1] if shared is not None else 0
        expected.update({
            p + "ffn_gate_shexp.weight": (F_s, D), p + "ffn_up_shexp.weight": (F_s, D),
            p + "ffn_down_shexp.weight": (D, F_s), p + "ffn_gate_inp_shexp.weight": (D,)})
    for name, shape in expected.items():
        t = g.tensors.get(name)
        if t is not None and t.shape != shape:
            raise GGUFError(f"{g.path.name}: tensor {name!r} has shape {t.shape}, but the "
                            f"metadata makes it {shape}; the file is damaged or its "
                            "metadata does not belong to its weights")
