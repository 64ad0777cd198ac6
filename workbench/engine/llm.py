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

import asyncio
import functools
import json
import os
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workbench import registry
from workbench.engine import chat_template
from workbench.engine.backend import Backend, select_backend
from workbench.engine.cancel import CancelFlag, check_cancel
from workbench.engine.chat_template import render as render_chat
from workbench.engine.closing import ClosedEarlyWarning, Closer, Closing
from workbench.engine.gguf import GGUFFile, UnsupportedArchitectureError, open_gguf
from workbench.engine.grammar import Grammar, GrammarMatcher, resolve_grammar
from workbench.engine.kv_cache import KVCache, PrefixCache
from workbench.engine.models import gemma3, llama
from workbench.engine.sampling import DeviceSampler, Sampler, SamplingParams, entropy, log_softmax
from workbench.engine.tokenizers import Tokenizer, load_tokenizer
from workbench.engine.tokenizers.stream import StreamDecoder
from workbench.engine.warmup import KernelWarmup, Warming, helper_command
from workbench.signals import BusyCounter, Signal

_MODEL_CLASSES = {**dict.fromkeys(llama.ARCHITECTURES, llama.LlamaModel),
                  **dict.fromkeys(gemma3.ARCHITECTURES, gemma3.Gemma3Model)}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_CLASSES)
LogitsProcessor = Callable[[np.ndarray, np.ndarray], np.ndarray]  # fn(ids, logits) -> logits
PREFILL_CHUNK = 512  # prompt tokens per forward pass
# After a prefix cache, tails up to this long run token by token on the decode path, which
# beats one small prefill chunk (16 tokens after a 995-token prefix: 0.19 s against 0.40 s)
STEPWISE_TAIL = 16


@dataclass(frozen=True)
class Alternative:
    """One candidate for a generated position."""

    id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenEvent:
    """One generated token.

    `text` is the output released at this step: it may be empty while a UTF-8
    character or a possible stop string is incomplete, and a later event then
    carries it. `piece` is the token's own text. The last event of a
    generation may have `id=None`: it carries text held back until the end
    and stands for no token. `logprob`, `top` and `entropy`
    (nats) describe the model's distribution at this position before sampling
    filters and the grammar mask; they are None unless the call asked for
    `logprobs`. `mask_ms` is set when a grammar constrained the step;
    `closed` when the grammar's closer chose this token to make the output end
    valid: "budget" (max_tokens or the context was near), "free_text" (a
    string ran past its token limit) or "repetition" (a loop); see
    `workbench.engine.closing`.
    """

    id: int | None
    text: str
    piece: str
    logprob: float | None = None
    top: tuple[Alternative, ...] | None = None
    entropy: float | None = None
    mask_ms: float | None = None  # time the grammar took to compute this step's mask
    closed: str | None = None  # why the closer chose this token, if it did
    closing_ms: float | None = None  # time the closer took at this step


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Completion:
    """A running or finished generation; iterate it for text pieces."""

    def __init__(self, events: Iterator[TokenEvent], prompt_ids: list[int], prefix_text: str = ""):
        self.prompt_ids = prompt_ids
        self._events: list[TokenEvent] = []
        self._finish_reason: str | None = None
        self._source = events
        self._prefix_text = prefix_text
        self._text: list[str] = [prefix_text] if prefix_text else []
        self._prefix_pending = bool(prefix_text)
        self._done = False

    @property
    def prompt_text(self) -> str:
        """The prompt's text when the call asked for `include_prompt`, else ""."""
        return self._prefix_text

    def iter_events(self) -> Iterator[TokenEvent]:
        """Yield each generated token's event as it is produced.

        Abandoning the iteration early (closing it, or dropping it) stops the
        generation and frees the model.
        """
        try:
            while True:
                try:
                    ev = next(self._source)
                except StopIteration as stop:  # the generator returns its finish reason
                    self._finish_reason = stop.value or self._finish_reason
                    break
                self._events.append(ev)
                if ev.text:
                    self._text.append(ev.text)
                yield ev
        finally:
            self.close()

    def __iter__(self) -> Iterator[str]:
        if self._prefix_pending:
            self._prefix_pending = False
            yield self._prefix_text
        for ev in self.iter_events():
            if ev.text:
                yield ev.text

    def __aiter__(self) -> AsyncIterator[str]:
        return _aiter(iter(self))

    def wait(self) -> Completion:
        """Run the generation to its end; return self."""
        for _ in self.iter_events():
            pass
        return self

    @property
    def text(self) -> str:
        """The whole output text (generation runs to its end first)."""
        self.wait()
        return "".join(self._text)

    @property
    def events(self) -> list[TokenEvent]:
        """Every event of the generation (which runs to its end first)."""
        self.wait()
        return list(self._events)

    @property
    def token_ids(self) -> list[int]:
        """Generated token ids (without the prompt and without the stop token)."""
        self.wait()
        return [ev.id for ev in self._events if ev.id is not None]

    @property
    def finish_reason(self) -> str:
        """"stop" (end of turn, a stop token or string, or `close()`) or "length"
        (max_tokens or the context is full)."""
        self.wait()
        return self._finish_reason or "stop"

    @property
    def closed_early(self) -> str | None:
        """Why a constrained output was closed before the model ended it ("budget",
        "free_text" or "repetition"), or None if the model wrote it all. An output
        closed at the budget finishes with "length", complete and valid."""
        self.wait()
        return next((ev.closed for ev in self._events if ev.closed), None)

    @property
    def usage(self) -> Usage:
        self.wait()
        return Usage(len(self.prompt_ids), len(self.token_ids))

    def close(self) -> None:
        """Stop the generation early (frees the model for other calls)."""
        self._source.close()
        self._done = True

    def __repr__(self) -> str:
        state = (self._finish_reason or "stopped") if self._done else "running"
        n = sum(ev.id is not None for ev in self._events)
        return f"<Completion {state}: {n} tokens {''.join(self._text)[:60]!r}>"


async def _aiter(it: Iterator[str]) -> AsyncIterator[str]:
    done = object()
    while True:
        piece = await asyncio.to_thread(next, it, done)
        if piece is done:
            return
        yield piece


def with_schema_instruction(messages: Sequence[Mapping[str, Any]], schema: Any
                            ) -> list[dict[str, Any]]:
    """A copy of `messages` whose system message (added when there is none) asks for JSON
    following `schema`, as OpenAI's structured outputs show the schema to the model."""
    messages = [dict(m) for m in messages]
    instruction = ("Answer with a JSON object that follows this JSON Schema:\n"
                   + json.dumps(schema, ensure_ascii=False))
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0].get('content') or ''}\n\n{instruction}"
    else:
        messages.insert(0, {"role": "system", "content": instruction})
    return messages


class IncompleteOutputError(RuntimeError):
    """Generation ended (max_tokens, a stop string, a full context) before the constrained
    output was complete."""


class LLM:
    """A GGUF decoder model (llama, qwen2, qwen3, their MoE variants, phi3, gemma3) ready to
    chat, complete and embed."""

    def __init__(self, gguf: GGUFFile, *, device: str = "auto", kv_cache_size: int = 4096,
                 backend: Backend | None = None, prepare_kernels: bool = True):
        """`device`: "auto" (metal, then cuda, then cpu), "cpu", "cuda", "metal" or "mlx"
        (MLX on any platform). `backend`: a `workbench.engine.backend.Backend` to run on
        instead of the one `device` names (the tests run the CuPy backend's code with
        NumPy standing in for CuPy). `prepare_kernels`: on the CPU, compile (or load from
        the disk cache) the kernels this model runs in a background thread right away,
        with progress in the `warming` signal; False compiles each on first use."""
        arch = gguf.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{gguf.path.name}: architecture {arch!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if kv_cache_size < 1:
            raise ValueError("kv_cache_size must be >= 1")
        name, self.backend = select_backend(device, backend)  # no backend: the cpu
        self.device: Signal[str] = Signal(name, name="device")
        self.busy: Signal[bool] = Signal(False, name="busy")  # True while any call runs
        self._busy = BusyCounter(self.busy)
        # kernels being compiled: progress, or None (see workbench.engine.warmup)
        self.warming: Signal[Warming | None] = Signal(None, name="warming")
        self.path: Path = gguf.path
        self.metadata = gguf.metadata
        self.tokenizer: Tokenizer = load_tokenizer(gguf.metadata)
        self.model = _MODEL_CLASSES[arch](gguf, kv_cache_size)
        if self.backend is not None:  # weights uploaded once, the host copies dropped
            self.model = llama.DeviceLlamaModel(self.model, self.backend)
        self.config = self.model.config
        self.chat_template: str = (gguf.get("tokenizer.chat_template")
                                   or chat_template.fallback_template(self.tokenizer.tokens))
        chat_template.check_template_limits(self.chat_template)  # a hostile one fails here
        self.kv_cache_size = kv_cache_size
        self._gguf = gguf
        self._forward_lock = threading.Lock()  # one forward pass at a time per model
        self._cache = self.model.new_cache()  # kept between calls for prompt prefix reuse
        self._cache_lock = threading.Lock()
        self._file_sha256: str | None = None
        self.prefilled_tokens = 0  # prompt tokens run through the model so far (all calls)
        tasks = self.model.kernel_tasks() if prepare_kernels and self.backend is None else []
        helper = helper_command("llm", str(self.path), kv_cache_size)
        self.warmup = KernelWarmup(tasks, self.warming, self._forward_lock, helper).start()

    @classmethod
    def load(cls, source: str | os.PathLike = registry.DEFAULT_MODEL, *, device: str = "auto",
             kv_cache_size: int = 4096, prepare_kernels: bool = True) -> LLM:
        """Load a model from an alias (see `workbench list`), a .gguf path or `hf://repo/file`.

        Aliases are downloaded on first use. `kv_cache_size` is the context length
        (prompt plus output) in tokens. The CPU kernels the model needs start compiling
        in the background at once (`prepare_kernels`; progress in `m.warming`,
        `m.warmup.wait()` blocks until they are ready).
        """
        return cls(open_gguf(registry.resolve(source)), device=device,
                   kv_cache_size=kv_cache_size, prepare_kernels=prepare_kernels)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the weights and caches (the file's memory map goes with them)."""
        self.model = None
        self._cache = None
        self._gguf = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"LLM({self.path.name!r}, arch={self.config.arch!r}, "
                f"device={self.device.peek()!r})")

    # -- tokens ------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool | None = None, special: bool = True
                 ) -> list[int]:
        """Token ids of `text`. BOS only when the model adds one (or `add_bos=True`);
        special tokens such as `<|im_start|>` are parsed unless `special=False`."""
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(list(ids), skip_special=skip_special)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, chat_template: str | None = None,
                            **variables) -> str:
        """The prompt text the model's own chat template (or `chat_template`, Jinja text)
        makes of `messages`."""
        tok = self.tokenizer
        return render_chat(
            chat_template or self.chat_template, list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=tok.decode([tok.bos_id]) if tok.bos_id is not None else "",
            eos_token=tok.decode([tok.eos_id]) if tok.eos_id is not None else "",
            **variables,
        )

    # -- low level ---------------------------------------------------------------------------
    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty KV cache for `forward` (default length: `kv_cache_size`)."""
        return self._require_model().new_cache(max_len)

    def forward(self, ids: Sequence[int], cache: KVCache) -> np.ndarray:
        """Logits (T, n_vocab) float32 at every position of `ids`, which are appended to
        `cache` at its next positions."""
        with self._busy, self._forward_lock:
            return self._require_model().forward(np.asarray(ids), cache)

    def is_stop_token(self, token: int) -> bool:
        """True for the model's end-of-generation tokens (end of turn, EOS)."""
        return int(token) in self.tokenizer.eot_ids

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
        with self._cache_lock, self._busy:
            model, cache = self._require_model(), self._cache
            start, end = int(start), int(end)
            if not recompute or end == cache.offset:
                model.kv_remove(cache, start, end)
                return
            self._prefill(cache.cut(start, end), cache)

    def reset(self) -> None:
        """Forget the prompt kept in the KV cache: the next call prefills from scratch.

        (Each call reuses the longest prefix it shares with the previous one.)"""
        with self._cache_lock:
            self._require_model()
            self._cache.reset()

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
    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 512,
                 stop: str | Sequence[str] | None = None, stop_tokens: Sequence[int] = (),
                 include_prompt: bool = False, add_bos: bool | None = None,
                 logprobs: int | None = None, temperature: float = 0.8, top_k: int = 40,
                 top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 repeat_last_n: int = 64, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, seed: int | None = None,
                 logit_bias: Mapping[int, float] | None = None,
                 grammar: Grammar | str | None = None, schema: Any = None,
                 closing: Closing | bool = True, prefix: PrefixCache | None = None,
                 logits_processors: Sequence[LogitsProcessor] = (),
                 cancel: CancelFlag | None = None) -> Completion:
        """Continue `prompt` (text, or token ids) without a chat template.

        Stops at the model's end-of-generation tokens, any of `stop_tokens`, any
        string in `stop` (not included in the output), or after `max_tokens`.
        `logprobs=k` records each token's log-probability, its k best
        alternatives and the entropy in the events. `include_prompt` puts the
        prompt text in front of the output.

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
        """
        ids, prompt_text = self._prompt_ids(prompt, add_bos, include_prompt)
        self._check_prefix(prefix)
        options = dict(max_tokens=max_tokens, stop=stop, stop_tokens=stop_tokens,
                       logprobs=logprobs, temperature=temperature, top_k=top_k, top_p=top_p,
                       min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                       presence_penalty=presence_penalty,
                       frequency_penalty=frequency_penalty, logit_bias=logit_bias,
                       logits_processors=logits_processors, closing=closing)
        seq = self._decoding(ids, resolve_grammar(grammar, schema), seed, **options)
        return Completion(self._generate_events(ids, seq, prefix, cancel), ids, prompt_text)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, tools: list | None = None,
             chat_template: str | None = None, cancel: CancelFlag | None = None,
             **options) -> Completion:
        """Answer a conversation rendered with the model's chat template (or
        `chat_template`, Jinja text, rendered in the same sandbox; check one with
        `validate_chat_template`).

        `messages` are dicts with `role` and `content`. Options are those of
        `generate` (`max_tokens`, `temperature`, `stop`, `logprobs`, `seed`,
        `cancel` ...).
        """
        options.pop("include_prompt", None)
        ids = self._chat_ids(messages, tools, chat_template=chat_template)
        return self.generate(ids, cancel=cancel, **options)

    def chat_json(self, messages: Sequence[Mapping[str, Any]], schema: Any = None, *,
                  grammar: Grammar | str | None = None, schema_in_prompt: bool = True,
                  return_completion: bool = False, **options) -> Any:
        """Answer with JSON that validates against `schema` and return it parsed.

        `schema` is a JSON Schema (dict or text), a `Grammar` from one, or a
        pydantic model class (then the answer is an instance of it). The
        grammar guarantees the form; with `schema_in_prompt` the model is also
        shown the schema (in the system message, as OpenAI's structured outputs
        do), which keeps small models from rambling inside free-form fields.
        Instead of a schema, `grammar` (GBNF text or a `Grammar`) constrains the
        answer; it is parsed where it is JSON and returned as text where not.

        Options are those of `chat`. The answer always completes within
        `max_tokens`: where the model would run on, the output is closed at the
        budget (or a loop or an overlong string is closed early), and a
        `ClosedEarlyWarning` says so. `return_completion=True` returns
        `(value, completion)`, whose `closed_early` tells the same. Raises
        `GrammarBudgetError` when even the shortest valid answer does not fit
        `max_tokens`, and `IncompleteOutputError` when a stop string cut it short.
        """
        if (schema is None) == (grammar is None):
            raise ValueError("chat_json needs a schema= or a grammar= (one of them)")
        if isinstance(schema, Grammar) and schema.kind != "json_schema":
            raise ValueError(f"chat_json's schema= takes a JSON Schema, got a {schema.kind} "
                             f"grammar (pass it as grammar=)")
        constraint = resolve_grammar(grammar, schema)
        if schema_in_prompt and constraint.schema is not None:
            messages = with_schema_instruction(messages, constraint.schema)
        completion = self.chat(messages, grammar=constraint, **options)
        text = completion.text
        if completion.finish_reason != "stop" and completion.closed_early != "budget":
            raise IncompleteOutputError(
                f"generation ended ({completion.finish_reason}) after "
                f"{completion.usage.completion_tokens} tokens, before the output was "
                f"complete: {text[:200]!r}; raise max_tokens")
        if completion.closed_early:
            warnings.warn(ClosedEarlyWarning(completion.closed_early, text), stacklevel=2)
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            if constraint.kind == "json_schema":  # a stop string cut it short
                raise IncompleteOutputError(f"the output is not complete JSON ({e}): "
                                            f"{text[:200]!r}") from None
            value = text
        if constraint.model is not None:
            value = constraint.model.model_validate(value)
        return (value, completion) if return_completion else value

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], *, max_tokens: int = 512,
                       stop: str | Sequence[str] | None = None,
                       stop_tokens: Sequence[int] = (), include_prompt: bool = False,
                       add_bos: bool | None = None, logprobs: int | None = None,
                       temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                       min_p: float = 0.05, repeat_penalty: float = 1.0,
                       repeat_last_n: int = 64, presence_penalty: float = 0.0,
                       frequency_penalty: float = 0.0,
                       seed: int | Sequence[int] | None = None,
                       logit_bias: Mapping[int, float] | None = None,
                       grammar: Grammar | str | None = None, schema: Any = None,
                       closing: Closing | bool = True, prefix: PrefixCache | None = None,
                       logits_processors: Sequence[LogitsProcessor] = (),
                       cancel: CancelFlag | None = None) -> list[Completion]:
        """Continue several prompts at once; returns their finished `Completion`s, in order.

        Each prompt is prefilled into its own rows of one KV pool; then every
        step runs one forward pass for all unfinished sequences together
        (matmuls with one row per sequence, which costs little more than one
        sequence's), each with its own sampler, grammar matcher and stop
        conditions. Options are those of `generate`. With `seed=s`, sequence i
        samples with seed s + i (pass a list for explicit seeds); greedy results
        equal `generate`'s.

        `cancel`: a flag (`threading.Event`) looked at before each prompt's prefill
        and each decode step; once it is set the call raises `Cancelled`.
        """
        prompts = list(prompts)
        if not prompts:
            return []
        if seed is None or isinstance(seed, int):
            seeds = [None if seed is None else seed + i for i in range(len(prompts))]
        else:
            seeds = [int(x) for x in seed]
            if len(seeds) != len(prompts):
                raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        requests = []
        for p in prompts:
            check_cancel(cancel)
            requests.append(self._prompt_ids(p, add_bos, include_prompt))
        self._check_prefix(prefix)
        options = dict(max_tokens=max_tokens, stop=stop, stop_tokens=stop_tokens,
                       logprobs=logprobs, temperature=temperature, top_k=top_k, top_p=top_p,
                       min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                       presence_penalty=presence_penalty,
                       frequency_penalty=frequency_penalty, logit_bias=logit_bias,
                       logits_processors=logits_processors, closing=closing)
        constraint = resolve_grammar(grammar, schema)
        seqs = [self._decoding(ids, constraint, sd, **options)
                for (ids, _), sd in zip(requests, seeds)]
        events: list[list[TokenEvent]] = [[] for _ in prompts]
        if max_tokens > 0:
            with self._busy:
                self._run_batch([ids for ids, _ in requests], seqs, events, max_tokens,
                                prefix, cancel)
        return [Completion(_replay(ev, seq.finish_reason or "length"), ids, text)
                for ev, seq, (ids, text) in zip(events, seqs, requests)]

    def chat_batch(self, conversations: Sequence[Sequence[Mapping[str, Any]]], **options
                   ) -> list[Completion]:
        """Answer several conversations at once (see `chat` and `generate_batch`;
        `cancel=` is looked at between conversations too)."""
        tools = options.pop("tools", None)
        template = options.pop("chat_template", None)
        options.pop("include_prompt", None)
        cancel = options.get("cancel")
        prompts = []
        for messages in conversations:
            check_cancel(cancel)
            prompts.append(self._chat_ids(messages, tools, chat_template=template))
        return self.generate_batch(prompts, **options)

    def _run_batch(self, prompt_ids: list[list[int]], seqs: list[_Decoding],
                   events: list[list[TokenEvent]], max_tokens: int,
                   prefix: PrefixCache | None = None, cancel: CancelFlag | None = None
                   ) -> None:
        """Prefill each prompt into its slot of a new KV pool, then decode all unfinished
        sequences together, one forward pass per step, until each is finished (or
        `cancel` is set: `Cancelled`)."""
        model = self._require_model()
        longest = max(len(ids) for ids in prompt_ids)
        caches = model.new_pool(len(prompt_ids), min(self.kv_cache_size,
                                                     longest + max_tokens)).caches()
        # one logits row per active sequence; on a GPU backend they stay on the device,
        # where each sequence's sampler picks its token
        rows = []
        for ids, c in zip(prompt_ids, caches):
            check_cancel(cancel)
            rows.append(self._fill(c, ids, prefix, on_device=True, cancel=cancel))
        active = list(range(len(seqs)))
        while active:
            check_cancel(cancel)
            feed, still = [], []
            for i, row in zip(active, rows):
                token, evs = seqs[i].step(row, room=caches[i].max_len - caches[i].offset,
                                          on_device=self.backend is not None)
                events[i].extend(evs)
                if token is not None:
                    feed.append(token)
                    still.append(i)
            active = still
            if not active:
                break
            with self._forward_lock:
                live = [caches[i] for i in active]
                if self.backend is None:
                    rows = list(model.logits(model.decode(np.asarray(feed), live)))
                    continue
                on_device = [seqs[i].device_token for i in active]
                device_ids = (None if any(t is None for t in on_device)
                              else self.backend.xp.concatenate(on_device))
                logits = model.device_logits(model.decode(np.asarray(feed), live, device_ids))
                rows = [logits[j] for j in range(len(active))]

    def embed(self, text: str | Sequence[int], *, pool: str = "last", normalize: bool = True
              ) -> np.ndarray:
        """One vector for `text`: float32 of shape (n_embd,), from the final hidden states
        (after the output norm).

        pool: "last" (the last token's state, the default) or "mean" (the average over
        all tokens). normalize: scale to unit length (the default). The same signature
        as `Encoder.embed`, so either model can feed the similarity cell and the server.
        """
        if pool not in ("last", "mean"):
            raise ValueError(f"pool must be 'last' or 'mean' for a decoder, not {pool!r}")
        if isinstance(text, str):
            self._refuse_overlong(text, self.kv_cache_size + 1, "text to embed")
        ids = self.tokenize(text) if isinstance(text, str) else [int(i) for i in text]
        if not ids:
            raise ValueError("cannot embed an empty text")
        if len(ids) > self.kv_cache_size:
            raise ValueError(f"{len(ids)} tokens exceed the context of {self.kv_cache_size}")
        model = self._require_model()
        cache = model.new_cache(len(ids))
        with self._busy, self._forward_lock:
            states = model.hidden(np.asarray(ids), cache)  # (T, n_embd)
        if self.backend is not None:
            states = self.backend.to_host(states)
        h = states[-1] if pool == "last" else states.mean(axis=0)
        if normalize:
            h = h / max(float(np.linalg.norm(h)), 1e-12)
        return h.astype(np.float32)

    def embed_batch(self, texts: Sequence[str], *, batch_size: int = 32, pool: str = "last",
                    normalize: bool = True, cancel: CancelFlag | None = None) -> np.ndarray:
        """`embed` for each text: float32 of shape (len(texts), n_embd), in input order.

        (`batch_size` is accepted for the `Encoder` signature; a decoder embeds one text
        per forward pass.) `cancel`: a flag looked at before each text; once it is set
        the call raises `Cancelled`."""
        if isinstance(texts, str):
            raise TypeError("embed_batch takes a list of texts; use embed for one text")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        out = np.empty((len(texts), self.config.n_embd), np.float32)
        with self._busy:
            for i, text in enumerate(texts):
                check_cancel(cancel)
                out[i] = self.embed(text, pool=pool, normalize=normalize)
        return out

    # -- internals ---------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int], add_bos: bool | None,
                    include_prompt: bool) -> tuple[list[int], str]:
        """A prompt's checked token ids, and its text when `include_prompt` (else "")."""
        if isinstance(prompt, str):
            self._refuse_overlong(prompt, self.kv_cache_size, "prompt")
            ids = self.tokenize(prompt, add_bos=add_bos)
            text = prompt
        else:
            ids = [int(i) for i in prompt]
            text = self.detokenize(ids) if include_prompt else ""
        if not ids:
            raise ValueError("the prompt is empty (no tokens); pass text or token ids")
        if max(ids) >= self.config.n_vocab or min(ids) < 0:
            raise ValueError(f"prompt token ids must lie in [0, {self.config.n_vocab})")
        if len(ids) >= self.kv_cache_size:
            raise ValueError(f"the prompt has {len(ids)} tokens and the context holds "
                             f"{self.kv_cache_size}; load with a larger kv_cache_size")
        return ids, text if include_prompt else ""

    def _chat_ids(self, messages: Sequence[Mapping[str, Any]], tools: list | None, *,
                  add_generation_prompt: bool = True, chat_template: str | None = None
                  ) -> list[int]:
        """Token ids of a conversation rendered with the chat template (BOS as the model wants)."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        variables = {"tools": tools} if tools else {}
        prompt = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                          chat_template=chat_template, **variables)
        self._refuse_overlong(prompt, self.kv_cache_size, "conversation")
        ids = self.tokenize(prompt, add_bos=False)
        tok = self.tokenizer
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids.insert(0, tok.bos_id)
        return ids

    @functools.cached_property
    def _longest_token(self) -> int:
        """The most characters one token of the vocabulary stands for."""
        return max(map(len, self.tokenizer.tokens), default=1)

    def _refuse_overlong(self, text: str, limit: int, what: str) -> None:
        """Refuse `text` that cannot tokenize to fewer than `limit` tokens, before
        tokenizing it: no token covers more characters than the vocabulary's longest
        token, so a text longer than `limit` times that needs at least `limit` tokens
        (this bounds the tokenizer's work to a few hundred kB per prompt)."""
        if len(text) > limit * self._longest_token:
            raise ValueError(f"the {what} has {len(text)} characters, far more than the "
                             f"{self.kv_cache_size} tokens the context holds; shorten it or "
                             "load with a larger kv_cache_size")

    def _require_model(self) -> llama.LlamaModel:
        if self.model is None:
            raise RuntimeError("this LLM has been closed")
        return self.model

    def _fill(self, cache: KVCache, ids: list[int], prefix: PrefixCache | None,
              on_device: bool = False, cancel: CancelFlag | None = None) -> np.ndarray:
        """Bring `cache` to hold `ids`, reusing what it already holds and what `prefix`
        holds (copied, whichever covers more), prefilling the rest; return the logits
        after the last token (at least one token always runs, for them; with `on_device`,
        a device array when the model runs on a GPU backend)."""
        reuse = cache.common_prefix(ids)
        restored = False
        if prefix is not None:
            n = min(prefix.common_prefix(ids), len(ids) - 1)
            if n > reuse:
                cache.restore(prefix, n)
                restored = cache.offset == n  # (not when a sliding window would lack keys)
                reuse = cache.offset
        cache.trim(min(reuse, len(ids) - 1))
        reuse = cache.offset  # a rotating sliding-window cache may have had to start over
        self.prefilled_tokens += len(ids) - reuse
        tail = ids[reuse:]
        if restored and len(tail) <= STEPWISE_TAIL:  # the question after a cached prompt
            return self._prefill_stepwise(tail, cache, on_device)
        return self._prefill(tail, cache, on_device, cancel)

    def _prefill_stepwise(self, ids: list[int], cache: KVCache, on_device: bool = False
                          ) -> np.ndarray:
        """Feed a few tokens one at a time through the decode path (fused kernels, no
        per-layer BLAS hand-off): measured 2x faster than one chunk for 16 tokens."""
        model = self._require_model()
        for token in ids:
            with self._forward_lock:
                hidden = model.hidden(np.asarray([token]), cache)
        with self._forward_lock:
            return self._logits(hidden[-1:], on_device)[0]

    def _prefill(self, ids: list[int], cache: KVCache, on_device: bool = False,
                 cancel: CancelFlag | None = None) -> np.ndarray:
        """Feed `ids` in chunks of PREFILL_CHUNK (bounding the attention scores' memory;
        `cancel` is looked at between them); return the logits (n_vocab,) after the
        last one."""
        model = self._require_model()
        for start in range(0, len(ids), PREFILL_CHUNK):
            check_cancel(cancel)
            with self._forward_lock:
                hidden = model.hidden(np.asarray(ids[start : start + PREFILL_CHUNK]), cache)
        with self._forward_lock:
            return self._logits(hidden[-1:], on_device)[0]

    def _logits(self, hidden: Any, on_device: bool) -> Any:
        """Logits of hidden states: NumPy, or a device array with `on_device` on a GPU
        backend (the decode loop samples there and copies back only the token id)."""
        model = self._require_model()
        if on_device and self.backend is not None:
            return model.device_logits(hidden)
        return model.logits(hidden)

    def _decoding(self, prompt_ids: list[int], grammar: Grammar | None, seed: int | None, *,
                  max_tokens: int, stop: str | Sequence[str] | None = None,
                  stop_tokens: Sequence[int] = (), logprobs: int | None = None,
                  logit_bias: Mapping[int, float] | None = None,
                  logits_processors: Sequence[LogitsProcessor] = (),
                  closing: Closing | bool = True, **sampling) -> _Decoding:
        """The checked state of one sequence about to be generated."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        n_vocab = self.config.n_vocab
        stop_ids = frozenset(int(t) for t in stop_tokens)
        if any(not 0 <= t < n_vocab for t in stop_ids):
            raise ValueError(f"stop_tokens must lie in [0, {n_vocab})")
        params = SamplingParams(seed=seed, logit_bias=dict(logit_bias or {}), **sampling)
        matcher = grammar.matcher(self.tokenizer, n_vocab) if grammar is not None else None
        sampler = (Sampler(params, n_vocab) if self.backend is None
                   else DeviceSampler(params, n_vocab, self.backend))
        return _Decoding(self.tokenizer, prompt_ids, sampler,
                         max_tokens=max_tokens,
                         stop=[s for s in ([stop] if isinstance(stop, str) else stop or []) if s],
                         stop_tokens=stop_ids, logprobs=logprobs, matcher=matcher,
                         processors=list(logits_processors), closing=Closing.of(closing))

    def _generate_events(self, prompt_ids: list[int], seq: _Decoding,
                         prefix: PrefixCache | None = None, cancel: CancelFlag | None = None
                         ) -> Generator[TokenEvent, None, str]:
        """Yield the events of one generation; return its finish reason."""
        model = self._require_model()
        # The shared cache keeps the last conversation so that a prompt sharing its
        # beginning skips that part of the prefill; a concurrent call gets its own cache.
        owns_shared = self._cache_lock.acquire(blocking=False)
        cache = self._cache if owns_shared else model.new_cache()
        self._busy.__enter__()
        try:
            if seq.max_tokens == 0:
                return "length"
            logits = self._fill(cache, prompt_ids, prefix, on_device=True, cancel=cancel)
            while True:
                check_cancel(cancel)
                token, events = seq.step(logits, room=cache.max_len - cache.offset,
                                         on_device=self.backend is not None)
                yield from events
                if token is None:
                    return seq.finish_reason
                with self._forward_lock:
                    if self.backend is None:
                        logits = model.logits(model.hidden(np.asarray([token]), cache))[0]
                    else:  # the sampled id is already on the device: nothing to upload
                        logits = model.step_logits(token, cache, seq.device_token)
        finally:
            self._busy.__exit__()
            if owns_shared:
                self._cache_lock.release()


class _Decoding:
    """One sequence being generated: picks its tokens from logits and turns them into
    events (sampling, logprobs, end tokens, stop strings, streamed UTF-8 text)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], sampler: Sampler, *,
                 max_tokens: int, stop: list[str], stop_tokens: frozenset[int],
                 logprobs: int | None, matcher: GrammarMatcher | None = None,
                 processors: list[LogitsProcessor] | None = None,
                 closing: Closing | None = None):
        if any(not callable(fn) for fn in processors or ()):
            raise TypeError("logits_processors must be functions fn(ids, logits) -> logits")
        self.processors = processors or []
        self.tok = tokenizer
        self.sampler = sampler
        self.matcher = matcher
        self.max_tokens = max_tokens
        self.stop = stop
        self.end_ids = tokenizer.eot_ids | stop_tokens
        self._end_array = np.fromiter(self.end_ids, dtype=np.int64)
        self.closer = (Closer(matcher, closing, max_tokens, self._end_array)
                       if matcher is not None and closing is not None and max_tokens > 0
                       else None)
        self.logprobs = logprobs
        self.history = list(prompt_ids)
        self.decoder = StreamDecoder(tokenizer)
        self.held = ""  # released text that might still turn out to start a stop string
        self.n_generated = 0
        self.finish_reason: str | None = None
        self.device_token = None  # on a GPU backend: the last sampled id, still on the device

    def step(self, logits: np.ndarray, room: int, on_device: bool = False
             ) -> tuple[int | None, list[TokenEvent]]:
        """Choose the next token from `logits` (n_vocab,); `room`: how many more tokens
        the KV cache can take. Returns the token to feed back to the model, or None once
        the sequence is finished (`finish_reason` set), and the events to emit.

        `on_device`: `logits` is a GPU backend's array; the device sampler then picks the
        token there, unless log-probabilities or Python logits processors need every
        logit on the host."""
        tok, logprobs, matcher, closer = self.tok, self.logprobs, self.matcher, self.closer
        lp = top = ent = allowed = mask_ms = closed = closing_ms = None
        self.device_token = None
        if on_device and (logprobs is not None or self.processors):
            logits, on_device = self.sampler.backend.to_host(logits), False
        if logprobs is not None:
            logp = log_softmax(logits)
            ent = entropy(logp)
        for fn in self.processors:
            out = np.asarray(fn(np.asarray(self.history, dtype=np.intc),
                                np.array(logits, np.float32)), dtype=np.float32)
            if out.shape != logits.shape:
                raise ValueError(f"a logits processor returned shape {out.shape}, not "
                                 f"{logits.shape}")
            logits = out
        if matcher is not None:
            allowed = matcher.mask()
            mask_ms = matcher.mask_times[-1] * 1e3
            allowed[self._end_array] = matcher.is_accepting  # end only a complete output
        if closer is not None:  # tokens this sequence may still write, this one included
            remaining = min(self.max_tokens - self.n_generated, room + 1)
            steered = closer.steer(allowed, remaining)
            closed = closer.reason if steered is not allowed else None
            allowed = steered
        token = self._sample(logits, allowed, on_device)
        if closer is not None:
            if token not in self.end_ids and not closer.admits(token, remaining):
                allowed, closed = closer.forced(), closer.reason
                token = self._sample(logits, allowed, on_device)
            closing_ms = closer.times[-1] * 1e3
        if logprobs is not None:
            lp = float(logp[token])
            k = min(int(logprobs), len(logp))
            best = np.argpartition(-logp, k - 1)[:k] if k > 0 else np.empty(0, int)
            best = best[np.argsort(-logp[best], kind="stable")]
            top = tuple(Alternative(int(i), tok.decode([int(i)]), float(logp[i])) for i in best)
        if token in self.end_ids:
            return None, self._finish("stop")
        if matcher is not None:
            matcher.consume(token)
        if closer is not None:
            closer.advance(token)
        self.history.append(token)
        self.n_generated += 1
        self.held += self.decoder.push(token)
        released, self.held, hit = _split_stop(self.held, self.stop)
        events = [TokenEvent(token, released, tok.decode([token]), lp, top, ent, mask_ms,
                             closed, closing_ms)]
        if hit:
            self.finish_reason = "stop"
            return None, events
        if matcher is not None and matcher.is_finished:  # nothing more can follow
            return None, events + self._finish("stop")
        if self.n_generated >= self.max_tokens or room <= 0:
            return None, events + self._finish("length")
        return token, events

    def _sample(self, logits: Any, allowed: np.ndarray | None, on_device: bool) -> int:
        if on_device:
            token, self.device_token = self.sampler.sample_device(logits, self.history,
                                                                  allowed)
            return token
        return self.sampler.sample(logits, self.history, allowed)

    def _finish(self, reason: str) -> list[TokenEvent]:
        """End the sequence; text held back until the end goes out in a token-less event.
        An output the closer ended at the budget finishes with "length"."""
        if self.closer is not None and self.closer.reason == "budget":
            reason = "length"
        self.finish_reason = reason
        tail, _, _ = _split_stop(self.held + self.decoder.flush(), self.stop, final=True)
        return [TokenEvent(None, tail, "")] if tail else []


def _replay(events: list[TokenEvent], finish_reason: str) -> Generator[TokenEvent, None, str]:
    """The events of a finished generation, as `Completion` consumes them."""
    yield from events
    return finish_reason


def _split_stop(text: str, stops: list[str], final: bool = False) -> tuple[str, str, bool]:
    """Split `text` into (releasable, held back, stop string found).

    Text up to a stop string is released and the rest dropped; otherwise the
    longest tail that could begin a stop string is held back (unless `final`).
    """
    if not stops:
        return text, "", False
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut], "", True
    if final:
        return text, "", False
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:n]):
                keep = n
                break
    cut = len(text) - keep
    return text[:cut], text[cut:], False
