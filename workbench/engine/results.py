"""What the engines return: a generation's `Completion` and its `TokenEvent`s, and
Whisper's `Transcript`.

These types import nothing of the engine (no NumPy kernels, no Numba), so a client of
a server (`workbench.server.remote.RemoteEngine`) builds the same results as the local
engines without loading them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass


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
    `workbench.engine.decoding.closing`.
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
class MemoryUse:
    """What an `LLM`'s memory holds (`m.memory()`): its KV cache in positions (tokens)
    and bytes, and its weights.

    The KV pool has `kv_slots` sequences of `kv_cache_size` positions each: the running
    generations' slots and the spares that keep recent prompts for reuse.
    `kv_tokens_running` are the positions running generations hold, `kv_tokens_cached`
    those idle slots keep, `kv_tokens_free` the rest of the pool. The byte counts are
    those positions' keys and values (`kv_bytes_per_token` each); `weights_bytes` the
    model's weights as loaded (the file's tensors)."""

    kv_slots: int
    kv_cache_size: int
    kv_tokens_running: int
    kv_tokens_cached: int
    kv_tokens_free: int
    kv_bytes_per_token: int
    weights_bytes: int

    @property
    def kv_tokens_used(self) -> int:
        """Positions held: running and cached."""
        return self.kv_tokens_running + self.kv_tokens_cached

    @property
    def kv_bytes(self) -> int:
        """Bytes of the positions held."""
        return self.kv_tokens_used * self.kv_bytes_per_token

    @property
    def kv_capacity_bytes(self) -> int:
        """Bytes of the whole pool, were every position written."""
        return self.kv_slots * self.kv_cache_size * self.kv_bytes_per_token

    def __str__(self) -> str:
        mib = 2 ** 20
        return (f"KV {self.kv_tokens_used:,} of {self.kv_slots * self.kv_cache_size:,} "
                f"tokens ({self.kv_tokens_running:,} running, {self.kv_tokens_cached:,} "
                f"cached; {self.kv_bytes / mib:.1f} MiB), weights "
                f"{self.weights_bytes / mib:.0f} MiB")


@dataclass(frozen=True)
class Usage:
    """Token counts of a generation. With a draft model (`generate(..., draft=)`),
    `drafted_tokens` is how many tokens the draft proposed and `accepted_tokens` how many
    of them the target kept; both are None otherwise."""

    prompt_tokens: int
    completion_tokens: int
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __repr__(self) -> str:
        """The counts that apply: the draft's only with a draft model."""
        shown = f"prompt_tokens={self.prompt_tokens}, completion_tokens={self.completion_tokens}"
        if self.drafted_tokens is not None:
            shown += (f", drafted_tokens={self.drafted_tokens}, "
                      f"accepted_tokens={self.accepted_tokens}")
        return f"Usage({shown})"

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted tokens (None without a draft, or before it proposed any)."""
        if not self.drafted_tokens:
            return None
        return self.accepted_tokens / self.drafted_tokens


@dataclass
class DraftCounts:
    """What a speculative generation's draft did so far (updated as it runs)."""

    drafted: int = 0  # tokens the draft proposed
    accepted: int = 0  # of those, the ones the target kept
    target_passes: int = 0  # forward passes of the target after the prompt


class Completion:
    """A running or finished generation; iterate it for text pieces."""

    def __init__(self, events: Iterator[TokenEvent], prompt_ids: list[int], prefix_text: str = "",
                 draft_counts: DraftCounts | None = None):
        self.prompt_ids = prompt_ids
        self.draft_counts = draft_counts  # set when a draft model drafted (speculative)
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
        """Prompt and completion tokens; with a draft model, also the drafted and accepted
        tokens (`Usage.acceptance_rate`)."""
        self.wait()
        d = self.draft_counts
        if d is None:
            return Usage(len(self.prompt_ids), len(self.token_ids))
        return Usage(len(self.prompt_ids), len(self.token_ids), d.drafted, d.accepted)

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


class IncompleteOutputError(RuntimeError):
    """Generation ended (max_tokens, a stop string, a full context) before the constrained
    output was complete."""


class TooManyTokensError(ValueError):
    """The texts of one `embed_batch` call hold more tokens than its `max_total_tokens`
    allows (`counted`: the tokens counted when the call stopped counting, over `limit`)."""

    def __init__(self, counted: int, limit: int):
        super().__init__(f"the texts hold more than {limit} tokens in all (at least "
                         f"{counted}); embed at most {limit} in one call (max_total_tokens)")
        self.counted, self.limit = counted, limit


@dataclass(frozen=True)
class Segment:
    """A stretch of the transcript: seconds from the start of the audio, and its text."""

    start: float
    end: float
    text: str
    tokens: tuple[int, ...] = ()


class Transcript(str):
    """The transcribed text, with `.language`, `.language_probability`, `.segments`
    (`Segment` list), `.tokens` (all decoded token ids, specials included) and
    `.duration` (seconds of audio)."""

    language: str
    language_probability: float
    segments: list[Segment]
    tokens: list[int]
    duration: float

    def __new__(cls, text: str, *, language: str, language_probability: float = 1.0,
                segments: Sequence[Segment] = (), tokens: Sequence[int] = (),
                duration: float = 0.0) -> Transcript:
        obj = super().__new__(cls, text)
        obj.language = language
        obj.language_probability = language_probability
        obj.segments = list(segments)
        obj.tokens = list(tokens)
        obj.duration = duration
        return obj
