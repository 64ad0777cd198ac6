"""`WhisperModel`: speech to text with whisper.cpp `ggml-*.bin` models.

    >>> from workbench import WhisperModel
    >>> w = WhisperModel.load("whisper-tiny.en")
    >>> t = w.transcribe("jfk.wav")                  # a Transcript: a str with extras
    >>> print(t, t.language, t.segments)
    >>> w.transcribe(pcm, beam_size=5, timestamps=True)
    >>> w.detect_language("speech.wav")             # ("fr", 0.97) on multilingual models

Audio is decoded and resampled to 16 kHz mono (`workbench.engine.audio.pcm`) and turned
into a log-mel spectrogram (`workbench.engine.audio.mel`) in 30 s chunks, streamed: never
the whole audio nor its whole spectrogram in memory. Whisper's log-mel is clamped to
8 below its maximum over the whole audio, so audio longer than one chunk is decoded
twice: once for that maximum, once to transcribe (the chunks are exactly those of
the whole spectrogram).
Chunks whose RMS is below 1e-4 (silence) are skipped. Each chunk is encoded once and
decoded greedily (`beam_size=1`) or with beam search, under whisper.cpp's token rules: special
and language tokens never sampled, no blank or end at the start, timestamps in
increasing pairs (`timestamps=True`) that begin each segment within its first
second. Whisper's non-speech annotations (`[BLANK_AUDIO]`, `[silent]`,
`[music]`, `[inaudible]` ...) are removed from the text.

`device` picks where the network runs, as for `LLM`: "auto" (metal, then cuda, then
cpu), "cpu" (NumPy), "cuda" (CuPy), "metal" or "mlx". On a GPU the encoder, the
decoder and its caches stay on the device; the spectrogram goes up once per chunk and
one row of logits per sequence comes back per step, for the search, which runs on the
host whatever the device.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workbench.engine.audio.mel import (
    HOP_LENGTH,
    LOG_MEL_FLOOR,
    N_FRAMES,
    N_SAMPLES,
    WINDOW_AFTER,
    WINDOW_BEFORE,
    log_mel_spectrogram,
    mel_windows,
    scale_log_mel,
    window_log10_mel,
    window_log10_mel_max,
)
from workbench.engine.audio.pcm import SAMPLE_RATE, AudioError, AudioSource, open_audio
from workbench.engine.cancel import CancelFlag, check_cancel
from workbench.engine.decoding.sampling import log_softmax
from workbench.engine.formats import sources
from workbench.engine.formats.whisper_file import WhisperFile
from workbench.engine.local_engine import LocalEngine
from workbench.engine.models import whisper as arch
from workbench.engine.results import Segment, Transcript
from workbench.engine.runtime.backend import Backend
from workbench.engine.runtime.profiling import span
from workbench.engine.text.tokenizers.whisper import WhisperTokenizer

DEFAULT_WHISPER = "whisper-tiny.en"
SILENCE_RMS = 1e-4  # chunks quieter than this are not decoded
MAX_INITIAL_TIMESTAMP = 1.0  # seconds: a chunk's first segment starts within it
_ANNOTATION = re.compile(
    r"\s*[\[(]\s*(?:blank_audio|silen(?:t|ce)|music|inaudible|no speech|"
    r"background noise|applause|laughter|noise)\s*[\])]", re.IGNORECASE)


@dataclass
class _Hypothesis:
    tokens: list[int]
    logprob: float = 0.0


def clean_text(text: str) -> str:
    """`text` without Whisper's non-speech annotations, whitespace collapsed."""
    return re.sub(r"\s+", " ", _ANNOTATION.sub("", text)).strip()


class WhisperModel(LocalEngine):
    """A Whisper speech recognizer loaded from a whisper.cpp `.bin` file."""

    def __init__(self, f: WhisperFile, *, device: str = "auto", backend: Backend | None = None,
                 prepare_kernels: bool = True):
        """`device`: "auto" (metal, then cuda, then cpu), "cpu", "cuda", "metal" or "mlx"
        (MLX on any platform). `backend`: a `workbench.engine.runtime.backend.Backend` to run on
        instead of the one `device` names (the tests run the CuPy backend's code with
        NumPy standing in for CuPy). `prepare_kernels`: see `load`."""
        self._start_engine(f.path, device, backend)
        self.net: arch.Whisper | arch.DeviceWhisper | None = self._place_model(
            arch.Whisper(f), arch.DeviceWhisper, prepare_kernels=prepare_kernels)
        self.tokenizer = WhisperTokenizer(f.tokens, f.hparams.n_vocab)
        self._start_warmup()

    @classmethod
    def load(cls, source: str | os.PathLike = DEFAULT_WHISPER, *, device: str = "auto",
             prepare_kernels: bool = True) -> WhisperModel:
        """Load a model from an alias (`whisper-tiny.en`, `whisper-base`) or a `.bin` path.

        Aliases are downloaded (and converted) on first use. `prepare_kernels`: on the
        CPU, compile (or load from the disk cache) the kernels in a background thread
        right away, with progress in `warming` (`warmup.wait()` blocks until they are
        ready); False compiles each on first use.
        """
        path = sources.resolve(source)
        with span("load", model=Path(path).name):
            return cls(WhisperFile(path), device=device, prepare_kernels=prepare_kernels)

    @property
    def multilingual(self) -> bool:
        """True when the model knows languages other than English."""
        return self.tokenizer.multilingual

    def close(self) -> None:
        """Drop the weights."""
        self.net = None

    def __repr__(self) -> str:
        kind = "multilingual" if self.multilingual else "English-only"
        return (f"WhisperModel({self.path.name!r}, {kind}, layers={self.config.n_audio_layer}, "
                f"width={self.config.n_audio_state}, device={self.device.peek()!r})")

    # -- public API ------------------------------------------------------------------------
    def transcribe(self, audio: str | os.PathLike | bytes | np.ndarray, *,
                   language: str | None = "en", task: str = "transcribe", beam_size: int = 1,
                   max_tokens: int = 224, timestamps: bool = False,
                   max_seconds: float | None = None,
                   cancel: CancelFlag | None = None) -> Transcript:
        """Transcribe `audio`: a file path, encoded bytes, or 16 kHz mono float32 samples.

        language: a code such as "en" or "fr", or "auto" (None) to detect it on
            the first chunk (English-only models always use "en").
        task: "transcribe" or "translate" (to English; multilingual models).
        beam_size: 1 is greedy decoding; more runs beam search.
        max_tokens: the most tokens decoded per 30 s chunk.
        timestamps: decode Whisper's timestamp tokens and split each chunk into
            timed segments (otherwise a chunk is one segment).
        max_seconds: refuse longer audio with `AudioError`: from the header, before
            any decoding, when it tells the duration, else as soon as decoding passes
            it. None (the default) is no limit; the server passes its
            `max_audio_seconds` (`workbench.server.limits.MAX_AUDIO_SECONDS`).
        cancel: a flag (`threading.Event`) looked at between blocks of decoded audio,
            30 s chunks and tokens; once it is set the call raises `Cancelled`.

        The audio is read in 30 s windows and never held whole (see the module's
        docstring); the transcript's `.duration` is its length in seconds.
        """
        self._check_options(language, task, beam_size, max_tokens)
        source = open_audio(audio, max_seconds=max_seconds)
        with self._busy:
            filters = self._net().mel_filters
            with span("mel", what="first pass"):
                first, n_samples, log_max, n_windows = _first_pass(source, filters, cancel)
            if first is None and n_windows:
                windows = mel_windows(source.blocks(cancel))
            else:  # one window, kept, or nothing but silence
                windows = first or []
            n_frames = n_samples // HOP_LENGTH
            chunks = _mel_chunks(windows, n_frames, n_windows, filters, log_max)
            return self._transcribe(chunks,
                                    n_frames, n_samples / SAMPLE_RATE, language, task,
                                    beam_size, max_tokens, timestamps, cancel)

    def transcribe_mel(self, mel: np.ndarray, n_frames: int | None = None, *,
                       language: str | None = "en", task: str = "transcribe",
                       beam_size: int = 1, max_tokens: int = 224,
                       timestamps: bool = False, cancel: CancelFlag | None = None
                       ) -> Transcript:
        """Transcribe a log-mel spectrogram (n_mels, frames), as `log_mel_spectrogram`
        makes it; `n_frames` of its frames hold audio (default: all)."""
        mel = np.asarray(mel, dtype=np.float32)
        if mel.ndim != 2 or mel.shape[0] != self.config.n_mels:
            raise ValueError(f"mel must be ({self.config.n_mels}, frames), not {mel.shape}")
        n_frames = mel.shape[1] if n_frames is None else int(n_frames)
        self._check_options(language, task, beam_size, max_tokens)
        chunks = ((seek, _chunk(mel, seek)) for seek in range(0, n_frames, N_FRAMES))
        with self._busy:
            return self._transcribe(chunks, n_frames, n_frames * HOP_LENGTH / SAMPLE_RATE,
                                    language, task, beam_size, max_tokens, timestamps, cancel)

    def detect_language(self, audio: str | os.PathLike | bytes | np.ndarray
                        ) -> tuple[str, float]:
        """The spoken language of the first 30 s of `audio` (samples, a path, encoded
        bytes, or a log-mel spectrogram of shape (n_mels, frames)) and its probability.

        Only the first 30 s are decoded (their spectrogram clamped to its own maximum).
        English-only models answer ("en", 1.0).
        """
        if not self.multilingual:
            return "en", 1.0
        return self.detect_language_from_encoder(self.encode(audio))

    def encode(self, audio: str | os.PathLike | bytes | np.ndarray) -> Any:
        """The audio encoder's output for the first 30 s of `audio` (as `detect_language`
        takes it): (n_audio_ctx, n_audio_state) float32, on the model's device. Pass it to
        `detect_language_from_encoder`."""
        if isinstance(audio, np.ndarray) and audio.ndim == 2 \
                and audio.shape[0] == self.config.n_mels:
            mel = _chunk(audio, 0)
        else:
            filters = self._net().mel_filters
            blocks = open_audio(audio).blocks()
            try:
                window = next(mel_windows(blocks), None)
            finally:
                blocks.close()  # the rest is never decoded
            x = window[1] if window is not None else np.zeros(
                WINDOW_BEFORE + N_SAMPLES + WINDOW_AFTER, np.float32)
            log10 = window_log10_mel(x, filters)
            mel = scale_log_mel(log10[:, : N_FRAMES], max(LOG_MEL_FLOOR, float(log10.max())))
        with self._busy, self._forward_lock:
            return self._net().encode(mel)

    def detect_language_from_encoder(self, features: Any) -> tuple[str, float]:
        """`detect_language` from the encoder's output (`encode`): one decoder step from
        `<|startoftranscript|>`, the most likely language token and its probability
        among the language tokens (whisper's detectLanguageFromEncoder)."""
        if not self.multilingual:
            return "en", 1.0
        shape = tuple(getattr(features, "shape", ()))
        want = (self.config.n_audio_ctx, self.config.n_audio_state)
        if shape != want:
            raise ValueError(f"the encoder's output has shape {want}, got {shape}")
        with self._busy, self._forward_lock:
            probs = self._language_probs(features)
        best = int(np.argmax(probs))
        return self.tokenizer.languages[best], float(probs[best])

    def log_mel(self, pcm: np.ndarray, padding: int = N_SAMPLES) -> np.ndarray:
        """The log-mel spectrogram of 16 kHz samples, with a chunk of silence appended
        (the whole spectrogram at once: `transcribe` computes it chunk by chunk)."""
        return log_mel_spectrogram(pcm, self._net().mel_filters, padding=padding)

    # -- internals -------------------------------------------------------------------------
    def _net(self) -> arch.Whisper | arch.DeviceWhisper:
        if self.net is None:
            raise RuntimeError("this WhisperModel has been closed")
        return self.net

    def _check_options(self, language: str | None, task: str, beam_size: int,
                       max_tokens: int) -> None:
        """ValueError for bad options, before any work."""
        if beam_size < 1:
            raise ValueError("beam_size must be >= 1")
        if not 1 <= max_tokens <= self.config.n_text_ctx // 2:
            raise ValueError(f"max_tokens must be in [1, {self.config.n_text_ctx // 2}]")
        if task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', not {task!r}")
        if not self.multilingual:
            if task == "translate":
                raise ValueError(f"{self.path.name} is an English-only model; it cannot "
                                 "translate (use a multilingual model such as whisper-base)")
            if language not in (None, "auto", "en"):
                raise ValueError(f"{self.path.name} is an English-only model; it cannot "
                                 f"transcribe language {language!r} (use whisper-base)")
        elif language not in (None, "auto"):
            self.tokenizer.language_token(language)  # ValueError for an unknown code

    def _transcribe(self, chunks: Iterable[tuple[int, np.ndarray]], n_frames: int,
                    duration: float, language: str | None, task: str, beam_size: int,
                    max_tokens: int, timestamps: bool, cancel: CancelFlag | None) -> Transcript:
        """Decode each `(seek, mel chunk (n_mels, 3000))` of `chunks` (the silent ones
        left out) of audio `n_frames` mel frames (`duration` seconds) long."""
        tok = self.tokenizer
        auto = language in (None, "auto")
        if not self.multilingual:
            language, auto = "en", False
        segments: list[Segment] = []
        all_tokens: list[int] = []
        language_probability = 1.0
        frames_per_second = SAMPLE_RATE / HOP_LENGTH
        with self._forward_lock:
            net = self._net()
            for seek, mel in chunks:
                check_cancel(cancel)
                with span("encode", seek=seek):
                    features = net.encode(mel, cancel)
                if auto:
                    probs = self._language_probs(features)
                    best = int(np.argmax(probs))
                    language, language_probability = tok.languages[best], float(probs[best])
                    auto = False
                prompt = tok.sot_sequence(language, task, timestamps)
                with span("decode", seek=seek) as args:
                    tokens = self._decode(features, prompt, beam_size, max_tokens, timestamps,
                                          cancel)
                    args["tokens"] = len(tokens)
                all_tokens.extend(prompt + tokens)
                start = seek / frames_per_second
                end = min(seek + N_FRAMES, n_frames) / frames_per_second
                with span("detokenize"):
                    segments.extend(self._segments(tokens, start, end, timestamps))
        text = " ".join(s.text for s in segments if s.text)
        return Transcript(text, language=language or "en",
                          language_probability=language_probability,
                          segments=[s for s in segments if s.text], tokens=all_tokens,
                          duration=duration)

    def _language_probs(self, features) -> np.ndarray:
        """Probabilities of the language tokens after `<|startoftranscript|>`."""
        tok = self.tokenizer
        cache = self._net().new_cache(features)
        logits = self._net().decode(np.array([[tok.sot]]), cache)[0]
        lang = logits[tok.language_ids].astype(np.float64)
        e = np.exp(lang - lang.max())
        return e / e.sum()

    def _segments(self, tokens: list[int], start: float, end: float, timestamps: bool
                  ) -> list[Segment]:
        tok = self.tokenizer
        text_ids = [t for t in tokens if t < tok.eot]
        if not timestamps:
            return [Segment(start, end, clean_text(tok.decode(text_ids)), tuple(text_ids))]
        out: list[Segment] = []
        begin: float | None = None
        current: list[int] = []
        for t in tokens:
            if tok.is_timestamp(t):  # clamped: Whisper may place one past the audio's end
                seconds = min(start + tok.timestamp_seconds(t), end)
                if begin is None:
                    begin = seconds
                elif current:
                    out.append(Segment(begin, seconds, clean_text(tok.decode(current)),
                                       tuple(current)))
                    current, begin = [], None
                else:
                    begin = seconds
            elif t < tok.eot:
                current.append(t)
        if current:  # text after the last timestamp runs to the chunk's end
            out.append(Segment(begin if begin is not None else start, end,
                               clean_text(tok.decode(current)), tuple(current)))
        return out

    # -- decoding --------------------------------------------------------------------------
    def _decode(self, features, prompt: list[int], beam_size: int, max_tokens: int,
                timestamps: bool, cancel: CancelFlag | None = None) -> list[int]:
        """The tokens decoded after `prompt` from one chunk's encoder output `features`
        (NumPy, or a device array on a GPU backend)."""
        net = self._net()
        cache = net.new_cache(features)
        logits = net.decode(np.array([prompt]), cache)  # (1, V)
        if beam_size == 1:
            return self._greedy(cache, logits, max_tokens, timestamps, cancel)
        return self._beam(cache, logits, beam_size, max_tokens, timestamps, cancel)

    def _greedy(self, cache: arch.DecoderCache | arch.DeviceDecoderCache, logits: np.ndarray,
                max_tokens: int, timestamps: bool, cancel: CancelFlag | None = None
                ) -> list[int]:
        eot = self.tokenizer.eot
        out: list[int] = []
        for _ in range(max_tokens):
            check_cancel(cancel)
            row = self._filtered(logits[0], out, timestamps)
            token = int(np.argmax(row))
            out.append(token)
            if token == eot or cache.length >= self.config.n_text_ctx:
                break
            logits = self._net().decode(np.array([[token]]), cache)
        return out

    def _beam(self, cache: arch.DecoderCache | arch.DeviceDecoderCache, logits: np.ndarray,
              beam_size: int, max_tokens: int, timestamps: bool,
              cancel: CancelFlag | None = None) -> list[int]:
        """Beam search: each beam's best `beam_size + 1` continuations compete on
        cumulative log-probability; going down that ranking until `beam_size` continue,
        those that end in EOT are set aside as finished. The search stops once
        `beam_size` are finished; the winner has the best log-probability per token."""
        eot = self.tokenizer.eot
        beams = [_Hypothesis([])]
        finished: list[_Hypothesis] = []
        for _ in range(max_tokens):
            check_cancel(cancel)
            candidates = []
            for b, hyp in enumerate(beams):
                logprobs = log_softmax(self._filtered(logits[b], hyp.tokens, timestamps))
                top = np.argpartition(-logprobs, beam_size)[: beam_size + 1]
                for token in top:
                    if np.isfinite(logprobs[token]):
                        candidates.append((hyp.logprob + float(logprobs[token]), b, int(token)))
            candidates.sort(key=lambda c: -c[0])
            kept: list[tuple[float, int, int]] = []
            for score, b, token in candidates:  # best first, until the beam is full
                if token == eot:
                    finished.append(_Hypothesis(beams[b].tokens + [token], score))
                else:
                    kept.append((score, b, token))
                    if len(kept) == beam_size:
                        break
            if len(finished) >= beam_size or not kept \
                    or cache.length >= self.config.n_text_ctx:
                break
            cache.reorder([b for _, b, _ in kept])
            beams = [_Hypothesis(beams[b].tokens + [token], score) for score, b, token in kept]
            logits = self._net().decode(np.array([[t] for _, _, t in kept]), cache)
        pool = finished or beams
        # log-probability per token, EOT not counted (Whisper's maximum-likelihood ranking)
        best = max(pool, key=lambda h: h.logprob / max(1, len([t for t in h.tokens
                                                                 if t != eot])))
        return best.tokens

    def _filtered(self, logits: np.ndarray, sampled: list[int], timestamps: bool) -> np.ndarray:
        """The logits of one step with whisper.cpp's rules applied (a new array)."""
        tok = self.tokenizer
        x = logits.astype(np.float32, copy=True)
        ts = tok.timestamp_begin
        x[tok.sot : ts] = -np.inf  # sot, languages, task, lm, prev, nospeech, notimestamps
        if not sampled:  # no blank and no end as the first token
            x[tok.eot] = -np.inf
            if tok.space is not None:
                x[tok.space] = -np.inf
        if not timestamps:
            x[ts:] = -np.inf
            return x
        last_ts = bool(sampled) and sampled[-1] >= ts
        penultimate_ts = len(sampled) < 2 or sampled[-2] >= ts
        if last_ts:
            if penultimate_ts:  # a pair just closed: text (or the end) comes next
                x[ts:] = -np.inf
            else:  # an open timestamp: another one (closing it) or the end
                x[: tok.eot] = -np.inf
        stamps = [t for t in sampled if t >= ts]
        if stamps:  # timestamps never go back
            floor = stamps[-1] if last_ts and not penultimate_ts else stamps[-1] + 1
            x[ts:floor] = -np.inf
        if not sampled:  # a chunk starts with a timestamp within its first second
            x[:ts] = -np.inf
            x[ts + int(round(MAX_INITIAL_TIMESTAMP / 0.02)) + 1 :] = -np.inf
        logprobs = log_softmax(x)
        stamp_mass = np.logaddexp.reduce(logprobs[ts:])
        if stamp_mass > logprobs[: tok.eot].max(initial=-np.inf):
            x[: tok.eot] = -np.inf  # a timestamp is likelier than any text token
        return x


def _chunk(mel: np.ndarray, seek: int) -> np.ndarray:
    """3000 frames of `mel` from `seek`, zero-padded (in log-mel units) when short."""
    part = mel[:, seek : seek + N_FRAMES]
    if part.shape[1] < N_FRAMES:
        pad = np.full((mel.shape[0], N_FRAMES - part.shape[1]), part.min(initial=-1.5),
                      np.float32)
        part = np.concatenate([part, pad], axis=1)
    return np.ascontiguousarray(part, dtype=np.float32)


def _first_pass(source: AudioSource, filters: np.ndarray, cancel: CancelFlag | None
                ) -> tuple[list[tuple[np.ndarray, np.ndarray]] | None, int, float, int]:
    """Decode `source` once for its length in 16 kHz samples, the maximum of its log10
    mel spectrogram (Whisper clamps to 8 below it) and the number of windows up to the
    last one with sound (the rest need not be decoded again). Audio of at most one 30 s
    window comes back as that window `[(samples, x)]` (`mel_windows`), not to be
    decoded again; longer audio as None."""
    log_max, n, n_windows = LOG_MEL_FLOOR, 0, 0
    kept: list[tuple[np.ndarray, np.ndarray]] | None = []
    for k, (samples, x) in enumerate(mel_windows(source.blocks(cancel))):
        n += len(samples)
        log_max = window_log10_mel_max(x, filters, log_max)
        if not _silent(samples):
            n_windows = k + 1
        kept = [(samples, x)] if kept == [] else None
    return kept, n, log_max, n_windows


def _silent(samples: np.ndarray) -> bool:
    """True for a window not worth decoding: empty, or its RMS below SILENCE_RMS."""
    return not len(samples) or float(np.sqrt(np.mean(samples * samples))) < SILENCE_RMS


def _mel_chunks(windows: Iterable[tuple[np.ndarray, np.ndarray]], n_frames: int,
                n_windows: int, filters: np.ndarray, log_max: float
                ) -> Iterator[tuple[int, np.ndarray]]:
    """`(seek, mel chunk (n_mels, 3000))` of the first `n_windows` windows that start
    within `n_frames` and are not silent."""
    for k, (samples, x) in enumerate(windows):
        seek = k * N_FRAMES
        if k >= n_windows or seek >= n_frames:  # (under 10 ms past the last chunk: skipped)
            break
        if _silent(samples):
            continue
        with span("mel", seek=seek):
            mel = scale_log_mel(window_log10_mel(x, filters)[:, : N_FRAMES], log_max)
        yield seek, mel


__all__ = ["AudioError", "Segment", "Transcript", "WhisperModel", "clean_text"]
