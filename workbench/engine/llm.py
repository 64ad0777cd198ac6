"""`LLM`: load a GGUF decoder model and chat with it, complete text, embed, tokenize.

    >>> from workbench import LLM
    >>> m = LLM.load("smollm2-135m")
    >>> for piece in m.chat([{"role": "user", "content": "Hi!"}], temperature=0):
    ...     print(piece, end="")

`chat` and `generate` return a `Completion`: iterate it for text pieces as they
are produced, or read `.text`, `.token_ids`, `.usage` and `.finish_reason`
(reading them runs the generation to its end). `iter_events()` yields one
`TokenEvent` per generated token with its log-probability, top alternatives and
the entropy of the distribution it was drawn from (with `logprobs=k`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Generator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import numpy as np

from workbench import registry
from workbench.engine.cancel import CancelFlag, check_cancel
from workbench.engine.decoding import speculative
from workbench.engine.decoding.closing import Closing
from workbench.engine.decoding.grammar import Grammar, resolve_grammar
from workbench.engine.decoding.scheduler import (  # noqa: F401  (PREFILL_CHUNK: importable from here)
    DEFAULT_MAX_BATCH,
    PREFILL_CHUNK,
    Request,
    Scheduler,
)
from workbench.engine.decoding.sequence import Decoding, LogitsProcessor, replay
from workbench.engine.decoding.structured import answer_json, with_schema_instruction  # noqa: F401
from workbench.engine.formats import sources
from workbench.engine.formats.gguf import GGUFFile, UnsupportedArchitectureError, open_gguf
from workbench.engine.local_engine import LocalEngine
from workbench.engine.models import llama, llama_device
from workbench.engine.models.families import DECODERS
from workbench.engine.options import GenerationOptions, publishes_options
from workbench.engine.results import (  # noqa: F401  (importable from here, as before)
    Alternative,
    Completion,
    DraftCounts,
    IncompleteOutputError,
    MemoryUse,
    TokenEvent,
    TooManyTokensError,
    Usage,
)
from workbench.engine.runtime.backend import Backend
from workbench.engine.runtime.kv_cache import KVCache, KVPool
from workbench.engine.runtime.prefix_cache import PrefixCache
from workbench.engine.runtime.profiling import span
from workbench.engine.runtime.warmup import helper_command
from workbench.engine.text import chat_template
from workbench.engine.text.prompting import Prompting
from workbench.engine.text.tokenizers import Tokenizer, load_tokenizer

_MODEL_CLASSES = DECODERS  # (the name the docs and older code use)
SUPPORTED_ARCHITECTURES = tuple(DECODERS)


class LLM(Prompting, LocalEngine):
    """A GGUF decoder model (llama, qwen2, qwen3, their MoE variants, phi3, gemma3) ready to
    chat, complete and embed."""

    def __init__(self, gguf: GGUFFile, *, device: str = "auto", kv_cache_size: int = 4096,
                 max_batch: int = DEFAULT_MAX_BATCH, backend: Backend | None = None,
                 prepare_kernels: bool = True, dtype: str | None = None):
        """`device`: "auto" (metal, then cuda, then cpu), "cpu", "cuda", "metal" or "mlx"
        (MLX on any platform). `max_batch`: how many generations (from any threads, the
        server's included) decode together in one forward pass per token; more wait
        for a free place (`workbench.engine.decoding.scheduler`). `backend`: a
        `workbench.engine.runtime.backend.Backend` to run on instead of the one `device`
        names (the tests run the CuPy backend's code with NumPy standing in for CuPy).
        `prepare_kernels`: on the CPU, compile (or load from the disk cache) the kernels
        this model runs in a background thread right away, with progress in the
        `warming` signal; False compiles each on first use. `dtype`: on a device,
        "f16" or "bf16" uploads every matrix widened to that format (for the device's
        matrix units, at two bytes a weight); None (the default) keeps the file's
        formats. The CPU runs the file's formats only (`ValueError`)."""
        arch = gguf.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{gguf.path.name}: architecture {arch!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if kv_cache_size < 1:
            raise ValueError("kv_cache_size must be >= 1")
        self._start_engine(gguf.path, device, backend, dtype)
        self.metadata = gguf.metadata
        self.tokenizer: Tokenizer = load_tokenizer(gguf.metadata)
        self.model = self._place_model(DECODERS[arch](gguf, kv_cache_size),
                                       llama_device.DeviceLlamaModel,
                                       prepare_kernels=prepare_kernels)
        self.chat_template: str = (gguf.get("tokenizer.chat_template")
                                   or chat_template.fallback_template(self.tokenizer.tokens))
        chat_template.check_template_limits(self.chat_template)  # a hostile one fails here
        self.kv_cache_size = kv_cache_size
        self._gguf = gguf
        # every generation runs through it; its slots keep prompts for prefix reuse
        self._scheduler = Scheduler(self, max_batch)
        self._file_sha256: str | None = None
        self.prefilled_tokens = 0  # prompt tokens run through the model so far (all calls)
        self._start_warmup(helper_command("llm", str(self.path), kv_cache_size))

    @classmethod
    def load(cls, source: str | os.PathLike = registry.DEFAULT_MODEL, *, device: str = "auto",
             kv_cache_size: int = 4096, max_batch: int = DEFAULT_MAX_BATCH,
             prepare_kernels: bool = True, dtype: str | None = None) -> LLM:
        """Load a model from an alias (see `workbench list`), a .gguf path or `hf://repo/file`.

        Aliases are downloaded on first use. `kv_cache_size` is the context length
        (prompt plus output) in tokens; `max_batch` how many generations decode
        together (see `__init__`). The CPU kernels the model needs start compiling
        in the background at once (`prepare_kernels`; progress in `m.warming`,
        `m.warmup.wait()` blocks until they are ready). `dtype` ("f16", "bf16"):
        the device weights' format (see `__init__`).
        """
        path = sources.resolve(source)
        with span("load", model=path.name):
            return cls(open_gguf(path), device=device, kv_cache_size=kv_cache_size,
                       max_batch=max_batch, prepare_kernels=prepare_kernels, dtype=dtype)

    @property
    def max_batch(self) -> int:
        """How many generations decode together (the others wait for a place)."""
        return self._scheduler.max_batch

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the weights and caches (the file's memory map goes with them); generations
        still running get `RuntimeError`."""
        self._scheduler.close()
        self.model = None
        self._gguf = None

    def __repr__(self) -> str:
        return (f"LLM({self.path.name!r}, arch={self.config.arch!r}, "
                f"device={self.device.peek()!r})")

    # -- low level ---------------------------------------------------------------------------
    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty KV cache for `forward` (default length: `kv_cache_size`)."""
        return self._require_model().new_cache(max_len)

    def forward(self, ids: Sequence[int], cache: KVCache) -> np.ndarray:
        """Logits (T, n_vocab) float32 at every position of `ids`, which are appended to
        `cache` at its next positions."""
        with self._busy, self._forward_lock:
            return self._require_model().forward(np.asarray(ids), cache)

    def kv_remove(self, start: int, end: int, *, recompute: bool = True) -> None:
        """Forget positions start .. end - 1 of the kept sequence (the cached prompt and
        answer of the last call); the next call that continues the remaining tokens
        reuses the cache.

        The tokens after the range move back to close the gap. With `recompute` (the
        default) they are run again at their new positions, so the cache equals a fresh
        run on the remaining tokens (the part before the range is kept as it is). With
        `recompute=False` their keys are only re-rotated to the new positions
        (llama.cpp's context shift: cheap, but what they took from the removed tokens
        stays in them).
        """
        with self._scheduler.paused(), self._busy:
            model, cache = self._require_model(), self._kept()
            start, end = int(start), int(end)
            cache.check_span(start, end)
            self._scheduler.free_readers(cache, start)  # others' copies stay as they were
            if not recompute or end == cache.offset:
                model.kv_remove(cache, start, end)
                return
            self._prefill(cache.cut(start, end), cache)

    def reset(self) -> None:
        """Forget the prompts kept in the KV cache: the next call prefills from scratch.

        (Each call reuses the longest prefix it shares with an earlier one.)"""
        self._require_model()
        with self._scheduler.paused():
            self._scheduler.forget()

    @property
    def _cache(self) -> KVCache | None:
        """The cache of the last generation that finished (None before the first)."""
        return self._scheduler.kept

    def _kept(self) -> KVCache:
        cache = self._scheduler.kept
        if cache is None or cache.offset == 0:
            raise ValueError("no sequence is kept: generate first")
        return cache

    def memory(self) -> MemoryUse:
        """What the model's memory holds now: KV-cache positions running, cached and free
        (tokens and bytes) and the weights' bytes (see `MemoryUse`; `print` it for a
        line). Branches' stores (`BranchStore`) have pools of their own, not counted."""
        cfg = self.config
        slots, running, cached = self._scheduler.kv_positions()
        per_token = 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * 4  # K and V, float32
        weights = sum(t.data.nbytes for t in self._gguf.tensors.values()) \
            if self._gguf is not None else 0
        return MemoryUse(kv_slots=slots, kv_cache_size=self.kv_cache_size,
                         kv_tokens_running=running, kv_tokens_cached=cached,
                         kv_tokens_free=slots * self.kv_cache_size - running - cached,
                         kv_bytes_per_token=per_token, weights_bytes=weights)

    # -- prefix caches -----------------------------------------------------------------------
    @property
    def file_sha256(self) -> str:
        """SHA-256 of the model file (computed once), which saved prefix caches bind to."""
        if self._file_sha256 is None:
            self._file_sha256 = registry.file_sha256(self.path)
        return self._file_sha256

    def prefix(self, text: str | Sequence[int], *, add_bos: bool | None = None) -> PrefixCache:
        """Run `text` (or token ids) once and keep its keys and values: `generate(...,
        prefix=pc)` then skips the prefill of every prompt that starts with it."""
        ids, _ = self._prompt_ids(text, add_bos, False)
        return self._snapshot(ids)

    def prefix_chat(self, messages: Sequence[Mapping[str, Any]]) -> PrefixCache:
        """`prefix` for the start of conversations, e.g. a long system message: the chat
        template renders `messages` without the assistant's turn."""
        return self._snapshot(self._chat_ids(messages, None, add_generation_prompt=False))

    def load_prefix(self, path: str | os.PathLike) -> PrefixCache:
        """A prefix cache saved with `PrefixCache.save`, checked to belong to this file."""
        return PrefixCache.load(path, self)

    def _snapshot(self, ids: list[int]) -> PrefixCache:
        cache = self._require_model().new_cache(len(ids))
        with self._busy:
            self._prefill(ids, cache)
        return cache.snapshot(self.file_sha256)

    def _check_prefix(self, prefix: PrefixCache | None) -> None:
        if prefix is not None and (not isinstance(prefix, PrefixCache)
                                   or prefix.model_sha256 != self.file_sha256):
            raise ValueError("prefix must be a PrefixCache made by this model "
                             "(LLM.prefix / prefix_chat / load_prefix)")

    # -- generation --------------------------------------------------------------------------
    @publishes_options
    def generate(self, prompt: str | Sequence[int], *, options: GenerationOptions | None = None,
                 include_prompt: bool = False, add_bos: bool | None = None,
                 grammar: Grammar | str | None = None, schema: Any = None,
                 closing: Closing | bool = True, prefix: PrefixCache | None = None,
                 logits_processors: Sequence[LogitsProcessor] = (),
                 cancel: CancelFlag | None = None, draft: LLM | str | None = None,
                 draft_tokens: int = speculative.DRAFT_TOKENS, **overrides: Any) -> Completion:
        """Continue `prompt` (text, or token ids) without a chat template.

        `options` (a `GenerationOptions`) and keywords naming its fields
        (`max_tokens`, `temperature`, `top_k`, `top_p`, `min_p`, the penalties,
        `seed`, `logit_bias`, `stop`, `stop_tokens`, `logprobs`; keywords win) say
        how tokens are sampled and when to stop: at the model's end-of-generation
        tokens, any of `stop_tokens`, any string in `stop` (not included in the
        output), or after `max_tokens`. `logprobs=k` records each token's
        log-probability, its k best alternatives and the entropy in the events.
        `include_prompt` puts the prompt text in front of the output.

        `grammar` (a `Grammar`, or GBNF text) or `schema` (a JSON Schema dict or
        pydantic model class) constrains the output: before every token the
        grammar's mask removes what cannot follow, end tokens are allowed only
        once the output is complete, and generation stops when nothing more can
        be added. `closing` (on by default; a `Closing` to tune it, False for
        off) makes the constrained output end valid: closed within `max_tokens`
        (then `finish_reason` is "length" and `Completion.closed_early` says
        "budget"), with long free text and loops closed early; a grammar whose
        shortest output does not fit `max_tokens` raises `GrammarBudgetError`.

        `prefix` (from `prefix` / `prefix_chat`) holds the keys and values of
        the prompt's first tokens: as many as the prompt shares with it are
        copied into the cache instead of being run through the model.

        `logits_processors`: functions `fn(ids, logits) -> logits` called in
        order before every token (ids: int32 array of the prompt and the output
        so far; logits: a float32 (n_vocab,) copy they may change), before the
        bias, penalties, grammar mask and sampling; the events' logprobs stay
        the model's own.

        `cancel`: a flag (`threading.Event`) looked at between prefill chunks
        and before each token; once it is set, iterating raises `Cancelled`.

        `draft`: a smaller `LLM` with the same vocabulary for speculative
        decoding (`workbench.engine.decoding.speculative`): each round it proposes up to
        `draft_tokens` tokens, this model checks them in one forward pass and
        keeps what its own sampler would have drawn, so the output follows this
        model's distribution exactly (greedy: its very tokens); `usage` then
        reports `drafted_tokens`, `accepted_tokens` and `acceptance_rate`.
        `draft="ngram"` drafts without a second model (prompt lookup): the
        proposals are what followed the latest earlier occurrence of the last
        few tokens in the prompt and output, which pays where the answer copies
        the prompt (editing code, extracting). The sequence runs in this model's
        batch like any other; `draft` refuses `grammar`, `schema` and
        `logits_processors` (ValueError).
        """
        opts = GenerationOptions.of(options, **overrides)
        ids, prompt_text = self._prompt_ids(prompt, add_bos, include_prompt)
        self._check_prefix(prefix)
        constraint = resolve_grammar(grammar, schema)
        if draft is not None:
            speculative.check_draft(self, draft, draft_tokens, ids, grammar=constraint,
                                    logits_processors=logits_processors)
        seq = self._decoding(ids, constraint, opts,
                             logits_processors=logits_processors, closing=closing)
        drafting = None if draft is None else speculative.Drafting(self, draft, draft_tokens,
                                                                    seq, len(ids))
        request = Request(ids, seq, prefix, cancel, drafting=drafting)
        return Completion(self._generate_events(request), ids, prompt_text,
                          draft_counts=None if drafting is None else drafting.counts)

    @publishes_options
    def chat(self, messages: Sequence[Mapping[str, Any]], *, tools: list | None = None,
             chat_template: str | None = None, continue_final_message: bool = False,
             cancel: CancelFlag | None = None, **generate_args: Any) -> Completion:
        """Answer a conversation rendered with the model's chat template (or
        `chat_template`, Jinja text, rendered in the same sandbox; check one with
        `validate_chat_template`).

        `messages` are dicts with `role` and `content`. With `continue_final_message`
        the conversation ends with an assistant message and the model continues that
        text (an answer cut at `max_tokens`, or a start you wrote) instead of starting
        a new turn; the completion holds the continuation only. The other arguments
        are those of `generate` (`options`, `max_tokens`, `temperature`, `stop`,
        `logprobs`, `seed`, `grammar`, `draft` ...); `include_prompt` puts the
        rendered prompt (the template's text) in front of the answer.
        """
        ids = self._chat_ids(messages, tools, chat_template=chat_template,
                             continue_final_message=continue_final_message)
        return self.generate(ids, cancel=cancel, **generate_args)

    @publishes_options
    def chat_json(self, messages: Sequence[Mapping[str, Any]], schema: Any = None, *,
                  grammar: Grammar | str | None = None, schema_in_prompt: bool = True,
                  return_completion: bool = False, **chat_args: Any) -> Any:
        """Answer with JSON that validates against `schema` and return it parsed.

        `schema` is a JSON Schema (dict or text), a `Grammar` from one, or a
        pydantic model class (then the answer is an instance of it). The
        grammar guarantees the form; with `schema_in_prompt` the model is also
        shown the schema (in the system message, as OpenAI's structured outputs
        do), which keeps small models from rambling inside free-form fields.
        Instead of a schema, `grammar` (GBNF text or a `Grammar`) constrains the
        answer; it is parsed where it is JSON and returned as text where not.

        The other arguments are those of `chat`. The answer always completes within
        `max_tokens`: where the model would run on, the output is closed at the
        budget (or a loop or an overlong string is closed early), and a
        `ClosedEarlyWarning` says so. `return_completion=True` returns
        `(value, completion)`, whose `closed_early` tells the same. Raises
        `GrammarBudgetError` when even the shortest valid answer does not fit
        `max_tokens`, and `IncompleteOutputError` when a stop string cut it short.
        """
        return answer_json(self, messages, schema, grammar=grammar,
                           schema_in_prompt=schema_in_prompt,
                           return_completion=return_completion, **chat_args)

    @publishes_options
    def generate_batch(self, prompts: Sequence[str | Sequence[int]], *,
                       options: GenerationOptions | None = None, include_prompt: bool = False,
                       add_bos: bool | None = None, grammar: Grammar | str | None = None,
                       schema: Any = None, closing: Closing | bool = True,
                       prefix: PrefixCache | None = None,
                       logits_processors: Sequence[LogitsProcessor] = (),
                       cancel: CancelFlag | None = None, draft: LLM | str | None = None,
                       draft_tokens: int = speculative.DRAFT_TOKENS,
                       **overrides: Any) -> list[Completion]:
        """Continue several prompts at once; returns their finished `Completion`s, in order.

        The prompts join the model's batch (`workbench.engine.decoding.scheduler`, up to
        `max_batch` at once, the rest as places come free): every step runs one
        forward pass for all unfinished sequences together (one row per sequence
        in each matmul: on 2 CPU cores 8 rows cost about 3.6 times one), each
        with its own sampler, grammar matcher and stop conditions; prompts that
        share a beginning of `MIN_SHARED` (64) tokens or more read it once.
        Options are those of `generate`. With `seed=s`, sequence i samples with
        seed s + i (pass a list for explicit seeds); greedy results equal
        `generate`'s.

        `cancel`: a flag (`threading.Event`) looked at before each prompt's prefill
        and each decode step; once it is set the call raises `Cancelled`.

        `draft` / `draft_tokens`: speculative decoding as in `generate`, for every
        sequence: each drafts its own proposals and the batch's proposals are
        checked together, in one pass per step; each `Completion` reports its own
        drafted and accepted tokens.
        """
        opts = GenerationOptions.of(options, **overrides)
        if isinstance(prompts, (str, bytes)):
            raise TypeError("generate_batch takes a list of prompts; for one prompt use "
                            "generate")
        prompts = list(prompts)
        if not prompts:
            return []
        seed = opts.seed
        if seed is None or not isinstance(seed, Sequence):
            seeds = [None if seed is None else int(seed) + i for i in range(len(prompts))]
        else:
            seeds = [int(x) for x in seed]
            if len(seeds) != len(prompts):
                raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        prompt_texts = []
        for p in prompts:
            check_cancel(cancel)
            prompt_texts.append(self._prompt_ids(p, add_bos, include_prompt))
        self._check_prefix(prefix)
        constraint = resolve_grammar(grammar, schema)
        if draft is not None:
            for ids, _ in prompt_texts:
                speculative.check_draft(self, draft, draft_tokens, ids, grammar=constraint,
                                        logits_processors=logits_processors)
        requests = []
        for (ids, _), sd in zip(prompt_texts, seeds):
            seq = self._decoding(ids, constraint, replace(opts, seed=sd),
                                 logits_processors=logits_processors, closing=closing)
            drafting = None if draft is None else speculative.Drafting(
                self, draft, draft_tokens, seq, len(ids))
            requests.append(Request(ids, seq, prefix, cancel, drafting=drafting))
        if opts.max_tokens > 0:
            with self._busy, self._draft_busy(draft):
                self._scheduler.run_all(requests)
        return [Completion(replay(r.events, r.seq.finish_reason or "length"), r.ids, text,
                           draft_counts=None if r.drafting is None else r.drafting.counts)
                for r, (_, text) in zip(requests, prompt_texts)]

    @publishes_options
    def chat_batch(self, conversations: Sequence[Sequence[Mapping[str, Any]]], *,
                   tools: list | None = None, chat_template: str | None = None,
                   continue_final_message: bool = False, cancel: CancelFlag | None = None,
                   **generate_args: Any) -> list[Completion]:
        """Answer several conversations at once (see `chat` and `generate_batch`;
        `cancel=` is looked at between conversations too)."""
        prompts = []
        for messages in conversations:
            check_cancel(cancel)
            prompts.append(self._chat_ids(messages, tools, chat_template=chat_template,
                                          continue_final_message=continue_final_message))
        return self.generate_batch(prompts, cancel=cancel, **generate_args)

    def embed(self, text: str | Sequence[int], *, pool: str = "last", normalize: bool = False,
              cancel: CancelFlag | None = None) -> np.ndarray:
        """One vector for `text`: float32 of shape (n_embd,), from the final hidden states
        (after the output norm).

        pool: "last" (the last token's state, the default) or "mean" (the average over
        all tokens). normalize: scale to unit length; off by default, so the vector is
        the model's own hidden state (parabun's `embed`; an `Encoder`, made for
        sentence embeddings, normalizes by default). The same signature as
        `Encoder.embed`, so either model can feed the similarity cell and the server,
        which ask for unit vectors. The text runs through the model PREFILL_CHUNK
        tokens at a time, as a prompt does: `cancel` (a flag) is looked at before each
        chunk, and other requests' forward passes take turns with them.
        """
        if pool not in ("last", "mean"):
            raise ValueError(f"pool must be 'last' or 'mean' for a decoder, not {pool!r}")
        ids = self._embedding_ids(text)
        model = self._require_model()
        cache = model.new_cache(len(ids))
        pooled = np.zeros(self.config.n_embd, np.float32)  # the last state, or their sum
        with self._busy:
            for start in range(0, len(ids), PREFILL_CHUNK):
                check_cancel(cancel)
                chunk = ids[start : start + PREFILL_CHUNK]
                with self._forward_lock:
                    states = model.hidden(np.asarray(chunk), cache)  # (T, n_embd)
                if self.backend is not None:
                    states = self.backend.to_host(states)
                pooled = states[-1] if pool == "last" else pooled + states.sum(axis=0)
        h = pooled if pool == "last" else pooled / len(ids)
        if normalize:
            h = h / max(float(np.linalg.norm(h)), 1e-12)
        return h.astype(np.float32)

    def embed_batch(self, texts: Sequence[str], *, batch_size: int = 32, pool: str = "last",
                    normalize: bool = False, cancel: CancelFlag | None = None,
                    max_total_tokens: int | None = None) -> np.ndarray:
        """`embed` for each text: float32 of shape (len(texts), n_embd), in input order.

        (`batch_size` is accepted for the `Encoder` signature; a decoder embeds one text
        per forward pass.) `cancel`: a flag looked at while the texts are tokenized and
        between forward passes; once it is set the call raises `Cancelled`.
        `max_total_tokens`: more tokens than this in all raises `TooManyTokensError`
        (a ValueError) before any forward pass (the server's per-request bound)."""
        if isinstance(texts, str):
            raise TypeError("embed_batch takes a list of texts; use embed for one text")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        ids, total = [], 0
        for text in texts:  # all of them checked before the first forward pass
            check_cancel(cancel)
            ids.append(self._embedding_ids(text))
            total += len(ids[-1])
            if max_total_tokens is not None and total > max_total_tokens:
                raise TooManyTokensError(total, max_total_tokens)
        out = np.empty((len(texts), self.config.n_embd), np.float32)
        with self._busy:
            for i, text_ids in enumerate(ids):
                out[i] = self.embed(text_ids, pool=pool, normalize=normalize, cancel=cancel)
        return out

    def _embedding_ids(self, text: str | Sequence[int]) -> list[int]:
        """The checked token ids of a text to embed (the whole text: no more than the
        context holds)."""
        if isinstance(text, str):
            self._refuse_overlong(text, self.kv_cache_size + 1, "text to embed")
        ids = self.tokenize(text) if isinstance(text, str) else [int(i) for i in text]
        if not ids:
            raise ValueError("cannot embed an empty text")
        if len(ids) > self.kv_cache_size:
            raise ValueError(f"{len(ids)} tokens exceed the context of {self.kv_cache_size}")
        return ids

    def trace(self, prompt: str | Sequence[int] | Sequence[Mapping[str, Any]], *,
              layers: Sequence[int] | None = None, attention: bool | Sequence[int] = False,
              heads: Sequence[int] | None = None, top_k: int = 10,
              add_bos: bool | None = None, max_bytes: int | None = None) -> Any:
        """Look inside the model on `prompt` (text, token ids, or chat messages): a
        `workbench.engine.models.trace.Trace` with the residual stream after each of `layers`
        (default all), the logit lens at every position (`top_k` ids, probabilities,
        entropy) and, with `attention` (True, or a list of layers), the attention weights
        of `heads` (default all). Runs the host forward pass on any device; a request
        over `max_bytes` (default 512 MiB) raises `TraceTooLargeError` with the size it
        would need, before anything runs."""
        from workbench.engine.models import trace as tracing

        limit = tracing.DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
        return tracing.trace(self, prompt, layers=layers, attention=attention, heads=heads,
                             top_k=top_k, add_bos=add_bos, max_bytes=limit)

    # -- the scheduler's and speculative decoding's interface (`GenerationModel`) -------------
    @property
    def forward_lock(self) -> threading.Lock:
        """Held around every forward pass (one at a time per model)."""
        return self._forward_lock

    def new_pool(self, n_slots: int) -> KVPool:
        """KV room for `n_slots` sequences of `kv_cache_size` positions."""
        return self._require_model().new_pool(n_slots, self.kv_cache_size)

    def hidden(self, ids: np.ndarray, cache: KVCache) -> Any:
        """Hidden states (T, D) of a chunk `ids` of one prompt, appended to `cache` (the
        caller holds `forward_lock`)."""
        return self._require_model().hidden(ids, cache)

    def hidden_batch(self, chunks: Sequence[tuple[np.ndarray, KVCache]]) -> list[Any]:
        """Several prompts' chunks in one pass (the caller holds `forward_lock`)."""
        return self._require_model().hidden_batch(chunks)

    def decode_step(self, tokens: np.ndarray, caches: Sequence[KVCache],
                    device_tokens: Sequence[Any]) -> Any:
        """Logits rows (N, n_vocab) after one token of each of N sequences: NumPy on the
        CPU, on the device on a GPU, one recorded launch per `DeviceLlamaModel.step_rows`
        sequences where it records (the caller holds `forward_lock`)."""
        model = self._require_model()
        if self.backend is None:
            return model.logits(model.decode(tokens, caches))
        return model.step_logits(tokens, caches, device_tokens)

    def logits_out(self, hidden: Any, on_device: bool) -> Any:
        """`_logits`: logits of hidden states (the caller holds `forward_lock`)."""
        return self._logits(hidden, on_device)

    def prefill(self, ids: Sequence[int], cache: KVCache, on_device: bool = False,
                cancel: CancelFlag | None = None) -> Any:
        """`_prefill`: `ids` through the model in chunks; the logits after the last."""
        return self._prefill(list(ids), cache, on_device, cancel)

    # -- internals ---------------------------------------------------------------------------
    def _require_model(self) -> llama.LlamaModel:
        if self.model is None:
            raise RuntimeError("this LLM has been closed")
        return self.model

    def _prefill(self, ids: list[int], cache: KVCache, on_device: bool = False,
                 cancel: CancelFlag | None = None) -> np.ndarray:
        """Feed `ids` in chunks of PREFILL_CHUNK (bounding the attention scores' memory;
        `cancel` is looked at between them); return the logits (n_vocab,) after the
        last one."""
        model = self._require_model()
        for start in range(0, len(ids), PREFILL_CHUNK):
            check_cancel(cancel)
            chunk = ids[start : start + PREFILL_CHUNK]
            with self._forward_lock, span("prefill", tokens=len(chunk)):
                hidden = model.hidden(np.asarray(chunk), cache)
        with self._forward_lock:
            return self._logits(hidden[-1:], on_device)[0]

    def _logits(self, hidden: Any, on_device: bool) -> Any:
        """Logits of hidden states: NumPy, or a device array with `on_device` on a GPU
        backend (the decode loop samples there and copies back only the token id)."""
        model = self._require_model()
        if on_device and self.backend is not None:
            return model.device_logits(hidden)
        return model.logits(hidden)

    def _decoding(self, prompt_ids: list[int], grammar: Grammar | None,
                  options: GenerationOptions, *,
                  logits_processors: Sequence[LogitsProcessor] = (),
                  closing: Closing | bool = True) -> Decoding:
        """The checked state of one sequence about to be generated. It can write one
        token more than the context has positions left: the last is never read back."""
        return Decoding.start(self.tokenizer, prompt_ids, options, self.config.n_vocab,
                              backend=self.backend, grammar=grammar,
                              logits_processors=logits_processors, closing=closing,
                              room=self.kv_cache_size - len(prompt_ids) + 1)

    def _generate_events(self, request: Request) -> Generator[TokenEvent, None, str]:
        """Yield the events of one generation (run by the scheduler, batched with whatever
        else is generating); return its finish reason."""
        if request.seq.max_tokens == 0:
            return "length"
        draft = None if request.drafting is None else request.drafting.draft
        with self._busy, self._draft_busy(draft):
            return (yield from self._scheduler.events(request))

    @staticmethod
    def _draft_busy(draft: LLM | str | None) -> AbstractContextManager:
        """A draft model's busy signal, held while it drafts for this model."""
        return draft.marked_busy() if isinstance(draft, LLM) else contextlib.nullcontext()
