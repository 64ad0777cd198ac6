"""Generation options: how tokens are picked (`SamplingParams`) and when a generation
stops (`GenerationOptions`), each default written once, here.

    >>> from workbench.engine.options import GenerationOptions
    >>> greedy = GenerationOptions(temperature=0, max_tokens=64)
    >>> m.generate("Once upon a time", options=greedy, stop="\\n")   # overrides win

`LLM.generate`, `chat`, `generate_batch` and `chat_batch` take `options=` and any
field as a keyword; the CLI's flags, the server's request schema and the notebook
cells read their defaults and names from these classes. This module imports nothing
heavy (no NumPy, no Numba), so HTTP clients and the CLI can read it cheaply.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Greedy by default (parabun's `temperature: 0`: the same call
    gives the same text); with `temperature` > 0 the model's own distribution is sampled,
    the filters off unless given (parabun's topK/topP, binfer's `--top-k 0 --top-p 1.0`)."""

    temperature: float = 0.0  # 0 means greedy argmax; > 0 samples
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set whose probability reaches p; 1.0 keeps all
    min_p: float = 0.0  # drop tokens below min_p times the best token's probability; 0 keeps all
    repeat_penalty: float = 1.0  # > 1 discourages tokens seen in the last repeat_last_n
    repeat_last_n: int = 64
    presence_penalty: float = 0.0  # subtracted from the logit of every token seen in the window
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the window
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added logit
    seed: int | None = None  # same seed, same text; -1 (llama.cpp's "random") is None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty"):
            _check_real(name, getattr(self, name))
        for name in ("top_k", "repeat_last_n"):
            _check_integer(name, getattr(self, name))
        self._check_seed()
        object.__setattr__(self, "logit_bias", parse_logit_bias(self.logit_bias))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1 (-1: the whole history), got "
                             f"{self.repeat_last_n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    def _check_seed(self) -> None:
        object.__setattr__(self, "seed", _checked_seed(self.seed))


@dataclass(frozen=True)
class GenerationOptions(SamplingParams):
    """Sampling plus the limits and stops of one generation.

    `max_tokens`: the most tokens to generate. `stop`: strings that end the output
    (not included in it). `stop_tokens`: the token ids that end it; None (the default)
    means the model's end-of-generation tokens (EOS and the chat template's end of
    turn), a list replaces them, and `[]` turns them off. `logprobs=k`: record each
    token's log-probability, its k best alternatives and the entropy in the events.
    `seed`: for `generate_batch`, also a list of one seed per prompt.
    """

    max_tokens: int = 512
    stop: str | Sequence[str] | None = None
    stop_tokens: Sequence[int] | None = None
    logprobs: int | None = None

    def __post_init__(self):
        super().__post_init__()
        _check_integer("max_tokens", self.max_tokens)
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.logprobs is not None:
            _check_integer("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be >= 0 (alternatives per token), got "
                                 f"{self.logprobs}")

    def _check_seed(self) -> None:
        if isinstance(self.seed, Sequence) and not isinstance(self.seed, str):
            for seed in self.seed:  # one per prompt of a batch
                _checked_seed(seed)
        else:
            super()._check_seed()

    @classmethod
    def of(cls, options: GenerationOptions | None = None, **overrides: Any
           ) -> GenerationOptions:
        """`options` (default: the defaults) with `overrides` (field names) applied; an
        unknown name is a TypeError, a value out of range a ValueError."""
        base = DEFAULTS if options is None else options
        if not isinstance(base, GenerationOptions):
            raise TypeError(f"options must be a GenerationOptions, not {type(base).__name__}")
        return dataclasses.replace(base, **overrides) if overrides else base

    def sampling(self, seed: int | None = None) -> SamplingParams:
        """The sampling part alone (`seed` given: that seed instead of `self.seed`)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingParams)}
        values["logit_bias"] = dict(self.logit_bias or {})
        values["seed"] = self.seed if seed is None else seed
        if isinstance(values["seed"], Sequence):
            raise TypeError("a list of seeds is for generate_batch and chat_batch (one per "
                            "prompt); one generation takes one integer")
        return SamplingParams(**values)

    def changed(self) -> dict[str, Any]:
        """The fields whose values differ from the defaults, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(DEFAULTS, f.name)}

    def stop_strings(self) -> list[str]:
        """`stop` as a list, without empty strings (which would stop before any text)."""
        stop = self.stop
        return [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]


def _check_real(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _check_integer(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, not {type(value).__name__}")


def parse_logit_bias(bias: Mapping[Any, Any] | None) -> dict[int, float]:
    """`bias` as {token id: added logit}: the one reading of `logit_bias` for the Python
    API, the server and `workbench batch` (JSON keys are strings). A key is a
    non-negative integer or its plain ASCII decimal digits ("1234"); `int()` would also
    take "1_000", " 12 " and other scripts' digits ("١٢"), which name no token id in
    OpenAI's API. A value is a number (±inf allowed, NaN not). None is no bias."""
    if bias is None:
        return {}
    if not isinstance(bias, Mapping):
        raise TypeError(f"logit_bias must map token ids to numbers, not "
                        f"{type(bias).__name__}")
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        # (at most 18 digits: past that no vocabulary, and int() refuses 4300 digits)
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18:
            token = int(key)
        elif isinstance(key, numbers.Integral) and not isinstance(key, bool) and key >= 0:
            token = int(key)
        else:
            raise ValueError(f"logit_bias keys are token ids (non-negative integers, or their "
                             f"plain decimal digits such as \"1234\"), not {_shown(key)}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or math.isnan(value):
            raise ValueError(f"logit_bias values are numbers (the logit added to the token), "
                             f"not {_shown(value)} for token {token}")
        parsed[token] = float(value)
    return parsed


def _shown(value: Any) -> str:
    """`value`'s repr for an error message, cut short (it may come from a request)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:36] + "...'"


def _checked_seed(seed: Any) -> int | None:
    """`seed` checked; None (a random one) for None and -1 (llama.cpp's spelling)."""
    if seed is None:
        return None
    _check_integer("seed", seed)
    if seed < -1:
        raise ValueError(f"seed must be >= 0, or -1 / None for a random one, got {seed}")
    return None if seed == -1 else seed


DEFAULTS = GenerationOptions()
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(GenerationOptions))

F = TypeVar("F", bound=Callable[..., Any])


def publishes_options(fn: F) -> F:
    """Show every `GenerationOptions` field, with its default, in `fn`'s signature.

    The generation methods take `options=None, **overrides` so that each default is
    written only in the dataclass, yet `help()`, notebook tooltips and tab completion
    should still list `temperature=0.0` and its siblings: this sets `__signature__`
    to the written parameters plus `options` and one keyword-only parameter per field
    (the values are read from `DEFAULTS`, not written again). A catch-all
    named `overrides` is replaced by the fields; another (such as `chat`'s
    `**generate_args`, passed on to `generate`) stays last.
    """
    sig = inspect.signature(fn)
    written = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    rest = [p for p in sig.parameters.values()
            if p.kind is p.VAR_KEYWORD and p.name != "overrides"]
    fields = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                default=getattr(DEFAULTS, f.name), annotation=f.type)
              for f in dataclasses.fields(GenerationOptions)
              if f.name not in sig.parameters]
    if "options" not in sig.parameters:  # passed on in the catch-all
        fields.insert(0, inspect.Parameter("options", inspect.Parameter.KEYWORD_ONLY,
                                           default=None, annotation="GenerationOptions | None"))
    fn.__signature__ = sig.replace(parameters=written + fields + rest)  # type: ignore[attr-defined]
    return fn
