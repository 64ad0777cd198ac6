"""`Encoder`: sentence embeddings from a BERT-style GGUF (MiniLM, BGE, E5 ...).

    >>> from workbench import Encoder
    >>> enc = Encoder.load("minilm-l6")
    >>> v = enc.embed("A man is eating food.")          # (384,) float32, unit length
    >>> m = enc.embed_batch(["a", "b", "c"])            # (3, 384)
    >>> enc.similarity("A man is eating.", "Someone eats.")

The vectors are sentence-transformers' vectors for the same model: the text is
tokenized with `[CLS]` and `[SEP]` and cut at the model's maximum length (with
a `TruncationWarning`), the last hidden states are pooled the way the model
was trained (mean over the tokens, the `[CLS]` state or the last token, as the
GGUF's `bert.pooling_type` says; `pool=` overrides it) and L2-normalized
unless `normalize=False`.

`LLM.embed` / `LLM.embed_batch` have the same signature, so the server and the
widgets take either (anything with `.embed`, see `Embedder`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from tqdm.auto import tqdm

from workbench.engine.cancel import CancelFlag, check_cancel
from workbench.engine.formats import sources
from workbench.engine.formats.gguf import GGUFFile, UnsupportedArchitectureError, open_gguf
from workbench.engine.local_engine import LocalEngine
from workbench.engine.models import bert, gemma3, llama
from workbench.engine.results import TooManyTokensError
from workbench.engine.runtime.backend import Backend
from workbench.engine.text.tokenizers import Tokenizer, load_tokenizer
from workbench.signals import Signal

DEFAULT_ENCODER = "minilm-l6"
POOLS = ("mean", "cls", "last")
# A long text is tokenized a growing head at a time, each cut at whitespace (where every
# tokenizer here ends a word), until the head alone has more tokens than are kept.
HEAD_CHARS_PER_TOKEN = 8  # the first head: this many characters per kept token
HEAD_MARGIN = 8  # tokens beyond the kept ones a head must have (the cut is far behind)
# Where no whitespace lies within half a head of its cut (a run of over a thousand
# characters without any: CJK, minified code, base64, "a" * 400000), the head is cut
# there hard, inside a word. Only that last word tokenizes differently from the whole
# text's: such a head must have HARD_CUT_MARGIN more tokens, more than one word can give
# (WordPiece: a word over 100 characters is one [UNK]; BPE and SentencePiece: pieces
# near the cut).
HARD_CUT_MARGIN = 128
# A head never grows past this many characters per kept token: there the text is cut
# whatever the head's tokens (so a 10 MB input costs what ~34,000 characters do). Real
# text has a few characters per token; only a text whose first max_length tokens span
# over 128 characters each (whitespace runs, or words of hundreds of characters that
# are one [UNK] each) is cut short of its first max_length tokens, without a warning.
HEAD_CHARS_LIMIT = 128
_WORD_ENDS = " \t\n\r"


class TruncationWarning(UserWarning):
    """A text was longer than the model's maximum length and was cut."""


@runtime_checkable
class Embedder(Protocol):
    """What the widgets and the server need of a model that embeds text."""

    busy: Signal[bool]
    device: Signal[str]

    def embed(self, text: str, *, normalize: bool = True) -> np.ndarray: ...

    def embed_batch(self, texts: Sequence[str], *, batch_size: int = 32,
                    normalize: bool = True) -> np.ndarray: ...


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of the rows of a (n, d) and b (m, d): (n, m) float32."""
    a = np.atleast_2d(np.asarray(a, dtype=np.float32))
    b = np.atleast_2d(np.asarray(b, dtype=np.float32))
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return a @ b.T


def _l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class Encoder(LocalEngine):
    """A BERT-style sentence encoder loaded from a GGUF file."""

    def __init__(self, gguf: GGUFFile, *, device: str = "auto", max_length: int | None = None,
                 backend: Backend | None = None, prepare_kernels: bool = True):
        """`device`: "auto" (metal, then cuda, then cpu), "cpu", "cuda", "metal" or "mlx".
        `backend`: a `workbench.engine.runtime.backend.Backend` to run on instead of the one
        `device` names. `max_length`, `prepare_kernels`: see `load`."""
        arch = gguf.architecture
        if arch not in bert.ARCHITECTURES:
            hint = (" (a decoder model: load it with workbench.LLM)"
                    if arch in llama.ARCHITECTURES + gemma3.ARCHITECTURES else "")
            raise UnsupportedArchitectureError(
                f"{gguf.path.name}: architecture {arch!r} is not an encoder this engine runs; "
                f"supported: {', '.join(bert.ARCHITECTURES)}{hint}")
        self._start_engine(gguf.path, device, backend)
        self.metadata = gguf.metadata
        self.model: bert.BertModel | bert.DeviceBertModel | None = self._place_model(
            bert.BertModel(gguf), bert.DeviceBertModel, prepare_kernels=prepare_kernels)
        self.tokenizer: Tokenizer = load_tokenizer(gguf.metadata)
        if self.config.pooling == "none":  # the file does not say: sentence-transformers' default
            self.pooling = "mean"
        else:
            self.pooling = self.config.pooling
        limit = self.config.n_ctx_train
        if max_length is not None and not 2 < max_length <= limit:
            raise ValueError(f"max_length must be in [3, {limit}] for this model, "
                             f"not {max_length}")
        # where inputs are cut: sentence-transformers' limit unless the caller sets one
        self.max_length: int = max_length or self.config.max_seq_length
        self._gguf = gguf
        self._start_warmup()

    @classmethod
    def load(cls, source: str | os.PathLike = DEFAULT_ENCODER, *, device: str = "auto",
             max_length: int | None = None, prepare_kernels: bool = True) -> Encoder:
        """Load an encoder from an alias (`minilm-l6`), a .gguf path or `hf://repo/file`.

        Aliases are downloaded (and converted) on first use. `max_length` is where
        inputs are cut, in tokens counting `[CLS]` and `[SEP]` (default: the
        sentence-transformers limit the file records, else the model's context).
        `prepare_kernels`: on the CPU, compile (or load from the disk cache) the kernels
        in a background thread right away, with progress in `warming` (`warmup.wait()`
        blocks until they are ready); False compiles each on first use.
        """
        return cls(open_gguf(sources.resolve(source)), device=device, max_length=max_length,
                   prepare_kernels=prepare_kernels)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the weights (the file's memory map goes with them)."""
        self.model = None
        self._gguf = None

    def __repr__(self) -> str:
        return (f"Encoder({self.path.name!r}, dim={self.dim}, pooling={self.pooling!r}, "
                f"max_length={self.max_length}, device={self.device.peek()!r})")

    @property
    def dim(self) -> int:
        """The embedding size."""
        return self.config.n_embd

    # -- tokens ------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` with `[CLS]` and `[SEP]`, cut at `max_length` (with a warning)."""
        ids, cut = self._ids(text)
        if cut:
            _warn_truncated([cut], self.max_length)
        return ids

    def _ids(self, text: str) -> tuple[list[int], int]:
        """(ids, the tokens seen when truncated else 0: the whole text's count, or that of
        a head long enough to be cut).

        A text is not tokenized past what is kept: heads of it cut at whitespace are
        tokenized, growing, until one has more tokens than `max_length` (the kept ids
        are the same as the whole text's first ones, since no token spans the cut). A
        head cut inside a long unspaced run must have HARD_CUT_MARGIN tokens more, and
        none grows past HEAD_CHARS_LIMIT characters per kept token (see there)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        enough = self.max_length + HEAD_MARGIN
        size = enough * HEAD_CHARS_PER_TOKEN
        limit = enough * HEAD_CHARS_LIMIT
        while True:
            end = _word_end(text, size)
            ids = self.tokenizer.encode(text[:end])
            hard = end < len(text) and text[end] not in _WORD_ENDS
            if (end == len(text) or len(ids) > enough + (HARD_CUT_MARGIN if hard else 0)
                    or size >= limit):
                break
            size = min(2 * max(size, end), limit)
        if len(ids) <= self.max_length:
            return ids, 0
        tok = self.tokenizer
        tail = [tok.eos_id] if tok.add_eos else []
        return ids[: self.max_length - len(tail)] + tail, len(ids)

    # -- embeddings --------------------------------------------------------------------------
    def token_embeddings(self, text: str) -> np.ndarray:
        """The last hidden state of every token of `text` (with `[CLS]` and `[SEP]`):
        float32 of shape (n_tokens, dim)."""
        ids = self.tokenize(text)
        return self._run([ids], pool=None)[0][: len(ids)].copy()

    def embed(self, text: str, *, pool: str | None = None, normalize: bool = True
              ) -> np.ndarray:
        """One vector for `text`: float32 of shape (dim,).

        pool: "mean", "cls" or "last" (default: the model's own pooling).
        normalize: scale to unit length (the default).
        """
        if not isinstance(text, str):
            raise TypeError(f"embed takes one text (str), not {type(text).__name__}; "
                            "use embed_batch for a list of texts")
        return self.embed_batch([text], batch_size=1, pool=pool, normalize=normalize)[0]

    def embed_batch(self, texts: Sequence[str], *, batch_size: int = 32,
                    pool: str | None = None, normalize: bool = True,
                    progress: bool = False, cancel: CancelFlag | None = None,
                    max_total_tokens: int | None = None) -> np.ndarray:
        """Vectors for many texts: float32 of shape (len(texts), dim), in input order.

        Texts are sorted by length and run `batch_size` at a time, each batch
        padded to its longest text. `progress=True` shows a progress bar.
        `cancel`: a flag (`threading.Event`) looked at while the texts are tokenized
        and before each batch; once it is set the call raises `Cancelled`.
        `max_total_tokens`: more tokens than this in all (each text counted as cut at
        `max_length`) raises `TooManyTokensError` before any forward pass.
        """
        if isinstance(texts, str):
            raise TypeError("embed_batch takes a list of texts; use embed for one text")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        pool = self._pool(pool)
        encoded = []
        for i, text in enumerate(texts):
            if i % batch_size == 0:
                check_cancel(cancel)
            encoded.append(self._ids(text))
        cut = [n for _, n in encoded if n]
        if cut:
            _warn_truncated(cut, self.max_length)
        ids = [i for i, _ in encoded]
        total = sum(map(len, ids))
        if max_total_tokens is not None and total > max_total_tokens:
            raise TooManyTokensError(total, max_total_tokens)
        out = np.empty((len(ids), self.dim), np.float32)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        starts = range(0, len(order), batch_size)
        with self._busy:
            for s in tqdm(starts, desc="embed", unit="batch", disable=not progress):
                check_cancel(cancel)
                chunk = order[s : s + batch_size]
                batch = [ids[i] for i in chunk]
                out[chunk] = self._run(batch, pool)
        return _l2_normalize(out) if normalize else out

    def similarity(self, a: Any, b: Any) -> float | np.ndarray:
        """Cosine similarity of `a` and `b`: each a text, a list of texts, a vector or a
        (n, dim) matrix. A float for two single items, else an (n, m) array."""
        single = _is_single(a) and _is_single(b)
        sims = cosine_similarity(self._vectors(a), self._vectors(b))
        return float(sims[0, 0]) if single else sims

    # -- internals ---------------------------------------------------------------------------
    def _pool(self, pool: str | None) -> str:
        pool = self.pooling if pool is None else pool
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {', '.join(POOLS)}, not {pool!r}")
        return pool

    def _vectors(self, x: Any) -> np.ndarray:
        if isinstance(x, str):
            return self.embed(x)[None]
        if isinstance(x, np.ndarray):
            return np.atleast_2d(x)
        items = list(x)
        if items and all(isinstance(t, str) for t in items):
            return self.embed_batch(items)
        return np.atleast_2d(np.asarray(items, dtype=np.float32))

    def _run(self, batch: list[list[int]], pool: str | None) -> np.ndarray:
        """A batch of id lists, padded to the longest, through the model: the pooled
        vectors (B, dim), or with `pool=None` the last hidden states (B, T, dim).

        On a GPU backend the pooling runs on the device, so only the vectors come back.
        """
        model = self.model
        if model is None:
            raise RuntimeError("this Encoder has been closed")
        lengths = np.array([len(b) for b in batch], dtype=np.int64)
        ids = np.zeros((len(batch), int(lengths.max())), dtype=np.int64)  # padding: never attended
        for row, b in zip(ids, batch):
            row[: len(b)] = b
        with self._busy, self._forward_lock:
            hidden = model.hidden(ids, lengths)
            if self.backend is None:
                return hidden if pool is None else _pool(np, hidden, lengths, pool)
            be = self.backend
            out = hidden if pool is None else _pool(be.xp, hidden, be.asarray(lengths), pool)
            return be.to_host(out)


def _pool(xp: Any, hidden: Any, lengths: Any, pool: str) -> Any:
    """One vector per sequence of hidden (B, T, D), whose rows hold `lengths` (B,) real
    tokens: (B, D). `xp` is the array module of both (NumPy, CuPy or mlx.core)."""
    if pool == "cls":
        return hidden[:, 0]
    if pool == "last":
        return hidden[xp.arange(hidden.shape[0]), lengths - 1]
    mask = (xp.arange(hidden.shape[1])[None, :] < lengths[:, None]).astype(xp.float32)  # (B, T)
    summed = (mask[:, :, None] * hidden).sum(axis=1)  # (B, D)
    return summed / lengths[:, None].astype(xp.float32)


def _is_single(x: Any) -> bool:
    return isinstance(x, str) or (isinstance(x, np.ndarray) and x.ndim == 1)


def _word_end(text: str, size: int) -> int:
    """Where to cut a head of about `size` characters from `text`: at its last
    whitespace in the second half of the head, else at the first one within half a
    head after it, else (a long run without whitespace) at `size` itself."""
    if size >= len(text):
        return len(text)
    back = max(text.rfind(c, size // 2, size) for c in _WORD_ENDS)
    if back > 0:
        return back
    ahead = [i for i in (text.find(c, size, size + size // 2) for c in _WORD_ENDS) if i >= 0]
    return min(ahead, default=size)


def _warn_truncated(lengths: list[int], limit: int) -> None:
    n = len(lengths)
    what = f"a text of more than {limit} tokens was" if n == 1 else \
        f"{n} texts of more than {limit} tokens were"
    warnings.warn(f"{what} cut to the model's maximum of {limit} tokens", TruncationWarning,
                  stacklevel=3)
