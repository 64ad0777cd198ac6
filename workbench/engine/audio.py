"""Audio in: files, encoded bytes and arrays to 16 kHz mono float32 PCM in [-1, 1].

- arrays are taken as they are (float in [-1, 1] at 16 kHz; integer PCM is
  scaled), stereo is averaged to mono, NaN or infinite samples are an error;
- files go through `soundfile` (WAV, FLAC, OGG/Vorbis and Opus, MP3 ...) and
  are resampled with `soxr` (high quality) when their rate is not 16 kHz;
- encoded bytes, or files libsndfile cannot read (WebM/Opus and MP4/AAC, what
  browsers record), are decoded with PyAV (FFmpeg) when it is installed
  (`pip install av`, part of the `notebook` extra).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000


class AudioError(ValueError):
    """Audio that cannot be read or used (unknown format, NaN samples, wrong shape)."""


def load_audio(source: str | os.PathLike | bytes | np.ndarray, *,
               sample_rate: int | None = None) -> np.ndarray:
    """16 kHz mono float32 samples of `source`: a file path, encoded bytes, or an array.

    For an array, `sample_rate` says its rate (default 16 kHz); (n,) is mono,
    (n, channels) is averaged to mono. Integer arrays are scaled from their
    full range to [-1, 1].
    """
    if isinstance(source, np.ndarray):
        return _from_array(source, sample_rate or SAMPLE_RATE)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_audio(bytes(source))
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"audio file not found: {path}")
    import soundfile

    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        try:
            return decode_audio(path.read_bytes())
        except AudioError as inner:
            raise AudioError(f"{path}: not an audio file soundfile or FFmpeg can read "
                             f"({exc}; {inner})") from None
    return _from_array(data, rate)


def decode_audio(data: bytes) -> np.ndarray:
    """Decode encoded audio bytes (WebM/Opus, OGG, MP4/AAC, WAV ...) with PyAV to 16 kHz
    mono float32."""
    if not data:
        return np.zeros(0, np.float32)
    try:
        import av
    except ImportError:
        raise AudioError("decoding compressed audio needs PyAV: pip install av") from None
    chunks = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise AudioError("the data holds no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
            for out in resampler.resample(None):  # flush
                chunks.append(out.to_ndarray().reshape(-1))
    except AudioError:
        raise
    except Exception as exc:  # av.error.InvalidDataError and friends
        raise AudioError(f"could not decode the audio ({type(exc).__name__}: {exc})") from None
    pcm = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    return _checked(pcm)


def _from_array(data: np.ndarray, rate: int) -> np.ndarray:
    data = np.asarray(data)
    if data.ndim == 2:
        data = data.mean(axis=1) if data.shape[1] <= 8 else data.mean(axis=0)
    if data.ndim != 1:
        raise AudioError(f"audio must be (samples,) or (samples, channels), not {data.shape}")
    if np.issubdtype(data.dtype, np.integer):
        data = data.astype(np.float32) / float(np.iinfo(data.dtype).max)
    elif not np.issubdtype(data.dtype, np.floating):
        raise AudioError(f"audio samples must be numbers, not {data.dtype}")
    pcm = _checked(np.ascontiguousarray(data, dtype=np.float32))
    if rate != SAMPLE_RATE and len(pcm):
        import soxr

        pcm = soxr.resample(pcm, rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    return pcm


def _checked(pcm: np.ndarray) -> np.ndarray:
    if not np.isfinite(pcm).all():
        bad = int(np.flatnonzero(~np.isfinite(pcm))[0])
        raise AudioError(f"the audio has NaN or infinite samples (the first at sample {bad})")
    return pcm
