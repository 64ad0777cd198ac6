"""The decoding state of one sequence: from each step's logits to the next token and
the events it releases (sampling, logprobs, end tokens, stop strings, streamed UTF-8,
the grammar mask and its closer). `LLM`, `generate_batch`, `Branch` and the strategies
drive it; it never runs the model itself.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from workbench.engine.decoding.closing import Closer, Closing
from workbench.engine.decoding.grammar import Grammar, GrammarMatcher
from workbench.engine.decoding.sampling import DeviceSampler, Sampler, entropy, log_softmax
from workbench.engine.options import GenerationOptions
from workbench.engine.results import Alternative, TokenEvent
from workbench.engine.runtime.profiling import span
from workbench.engine.text.tokenizers.base import Tokenizer
from workbench.engine.text.tokenizers.stream import StreamDecoder

LogitsProcessor = Callable[[np.ndarray, np.ndarray], np.ndarray]  # fn(ids, logits) -> logits


class Decoding:
    """One sequence being generated: picks its tokens from logits and turns them into
    events (sampling, logprobs, end tokens, stop strings, streamed UTF-8 text)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], sampler: Sampler, *,
                 max_tokens: int, stop: list[str], end_ids: frozenset[int],
                 logprobs: int | None, matcher: GrammarMatcher | None = None,
                 processors: list[LogitsProcessor] | None = None,
                 closing: Closing | None = None, room: int | None = None):
        if any(not callable(fn) for fn in processors or ()):
            raise TypeError("logits_processors must be functions fn(ids, logits) -> logits")
        self.processors = processors or []
        self.tok = tokenizer
        self.sampler = sampler
        self.matcher = matcher
        self.max_tokens = max_tokens
        self.stop = stop
        self.end_ids = end_ids  # the tokens that end the sequence (not emitted)
        self._end_array = np.fromiter(self.end_ids, dtype=np.int64)
        self.closer = (Closer(matcher, closing, max_tokens, self._end_array, room)
                       if matcher is not None and closing is not None and max_tokens > 0
                       else None)
        self.logprobs = logprobs
        self.history = list(prompt_ids)
        self.decoder = StreamDecoder(tokenizer)
        self.held = ""  # released text that might still turn out to start a stop string
        self.n_generated = 0
        self.finish_reason: str | None = None
        self.device_token = None  # on a GPU backend: the last sampled id, still on the device
        if matcher is not None:  # the first mask is computed while the prompt is read
            matcher.prefetch()

    @classmethod
    def start(cls, tokenizer: Tokenizer, prompt_ids: list[int], options: GenerationOptions,
              n_vocab: int, *, backend: Any = None, grammar: Grammar | None = None,
              logits_processors: Sequence[LogitsProcessor] = (),
              closing: Closing | bool = True, room: int | None = None) -> Decoding:
        """The checked state of a sequence about to follow `prompt_ids`, sampled on
        `backend`'s device (None: the host) and constrained by `grammar`; `room`: the
        tokens its context can take after the prompt (a grammar's budget is the smaller
        of it and `max_tokens`)."""
        if options.stop_tokens is None:
            end_ids = tokenizer.eot_ids
        else:
            end_ids = frozenset(int(t) for t in options.stop_tokens)
            if any(not 0 <= t < n_vocab for t in end_ids):
                raise ValueError(f"stop_tokens must lie in [0, {n_vocab})")
            if not end_ids and grammar is not None:
                raise ValueError("stop_tokens=[] turns the end tokens off, but a grammar's "
                                 "output ends with one; leave stop_tokens unset")
        params = options.sampling()
        matcher = None
        if grammar is not None:
            with span("grammar", what="matcher"):
                matcher = grammar.matcher(tokenizer, n_vocab)
        sampler = (Sampler(params, n_vocab) if backend is None
                   else DeviceSampler(params, n_vocab, backend))
        return cls(tokenizer, prompt_ids, sampler, max_tokens=options.max_tokens,
                   stop=options.stop_strings(), end_ids=end_ids,
                   logprobs=options.logprobs, matcher=matcher,
                   processors=list(logits_processors), closing=Closing.of(closing),
                   room=room)

    def step(self, logits: np.ndarray, room: int, on_device: bool = False
             ) -> tuple[int | None, list[TokenEvent]]:
        """Choose the next token from `logits` (n_vocab,); `room`: how many more tokens
        the KV cache can take. Returns the token to feed back to the model, or None once
        the sequence is finished (`finish_reason` set), and the events to emit.

        `on_device`: `logits` is a GPU backend's array; the device sampler then picks the
        token there, unless log-probabilities or Python logits processors need every
        logit on the host."""
        logprobs, matcher, closer = self.logprobs, self.matcher, self.closer
        logp = ent = allowed = mask_ms = closed = closing_ms = None
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
            with span("grammar"):
                allowed = matcher.mask()
                mask_ms = matcher.mask_times[-1] * 1e3
                allowed[self._end_array] = matcher.is_accepting  # end only a complete output
        if closer is not None:  # tokens this sequence may still write, this one included
            remaining = min(self.max_tokens - self.n_generated, room + 1)
            with span("grammar", what="closer"):
                steered = closer.steer(allowed, remaining)
            closed = closer.reason if steered is not allowed else None
            allowed = steered
        with span("sample"):
            token = self._sample(logits, allowed, on_device)
        if closer is not None:
            if token not in self.end_ids and not closer.admits(token, remaining):
                allowed, closed = closer.forced(), closer.reason
                with span("sample"):
                    token = self._sample(logits, allowed, on_device)
            closing_ms = closer.times[-1] * 1e3
        return self._emit(token, room, logp, ent, mask_ms, closed, closing_ms)

    @property
    def mask_ready(self) -> bool:
        """Whether `step` would not wait for the grammar: no grammar, or its next mask
        (computed on a worker thread since the last token) is ready."""
        return self.matcher is None or self.matcher.ready

    @property
    def plain(self) -> bool:
        """Whether the next token depends on the (biased) logits alone: no grammar,
        penalties, logits processors or logprobs. The scheduler picks such sequences'
        tokens on a GPU together (`DeviceSampler.pick_rows`) and hands each its own with
        `take`."""
        return (self.matcher is None and not self.processors and self.logprobs is None
                and self.sampler.plain)

    def take(self, token: int, device_token: Any, room: int
             ) -> tuple[int | None, list[TokenEvent]]:
        """Record `token`, picked for this `plain` sequence outside `step`
        (`device_token`: the same id on the device, shape (1,)); returns what `step`
        does."""
        self.device_token = device_token
        return self._emit(int(token), room, None, None)

    def push(self, token: int, logits: np.ndarray, room: int
             ) -> tuple[int | None, list[TokenEvent]]:
        """Take `token`, chosen elsewhere from the model's `logits` (n_vocab,) at this
        position (speculative decoding draws it); returns what `step` does. The
        logprobs, when asked for, describe `logits`. Grammar matchers and logits
        processors are not applied: the caller refuses them."""
        logp = ent = None
        if self.logprobs is not None:
            logp = log_softmax(logits)
            ent = entropy(logp)
        return self._emit(int(token), room, logp, ent)

    def _emit(self, token: int, room: int, logp: np.ndarray | None, ent: float | None,
              mask_ms: float | None = None, closed: str | None = None,
              closing_ms: float | None = None) -> tuple[int | None, list[TokenEvent]]:
        """Record the chosen `token` (logprobs from `logp`, when asked for): the events it
        releases, and the token to feed back or None once the sequence is finished."""
        tok, logprobs, matcher, closer = self.tok, self.logprobs, self.matcher, self.closer
        lp = top = None
        if logprobs is not None:
            lp = float(logp[token])
            k = min(int(logprobs), len(logp))
            best = np.argpartition(-logp, k - 1)[:k] if k > 0 else np.empty(0, int)
            best = best[np.argsort(-logp[best], kind="stable")]
            top = tuple(Alternative(int(i), tok.decode([int(i)]), float(logp[i])) for i in best)
        if token in self.end_ids:
            return None, self._finish("stop")
        if matcher is not None:
            with span("grammar", what="advance"):
                matcher.consume(token)
                if closer is not None:
                    closer.advance(token)
        self.history.append(token)
        self.n_generated += 1
        with span("detokenize"):
            self.held += self.decoder.push(token)
            released, self.held, hit = split_stop(self.held, self.stop)
            piece = tok.decode([token])
        at_budget = self.n_generated >= self.max_tokens or room <= 0
        if at_budget and not hit and closed is None and matcher is not None \
                and matcher.is_accepting and not matcher.is_finished:
            closed = "budget"  # complete where the budget cut it: closed there, valid
        events = [TokenEvent(token, released, piece, lp, top, ent, mask_ms,
                             closed, closing_ms)]
        if hit:
            self.finish_reason = "stop"
            return None, events
        if matcher is not None and matcher.is_finished:  # nothing more can follow
            return None, events + self._finish("stop")
        if at_budget:
            return None, events + self._finish("length")
        if matcher is not None:  # the next mask is computed beside the forward pass
            matcher.prefetch()
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
        tail, _, _ = split_stop(self.held + self.decoder.flush(), self.stop, final=True)
        return [TokenEvent(None, tail, "")] if tail else []


def replay(events: list[TokenEvent], finish_reason: str) -> Generator[TokenEvent, None, str]:
    """The events of a finished generation, as `Completion` consumes them."""
    yield from events
    return finish_reason


def split_stop(text: str, stops: list[str], final: bool = False) -> tuple[str, str, bool]:
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
