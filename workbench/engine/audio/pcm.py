"""Audio in: files, encoded bytes and arrays to 16 kHz mono float32 PCM in [-1, 1].

- arrays are taken as they are (float in [-1, 1] at 16 kHz; integer PCM is
  scaled), stereo is averaged to mono, NaN or infinite samples are an error;
- files and bytes must be one of the audio containers in `CONTAINERS`, told from
  their first bytes (anything else is refused before any decoder sees it); they go
  through `soundfile` (WAV, FLAC, OGG/Vorbis and Opus, MP3 ...) and are resampled
  with `soxr` (high quality) when their rate is not 16 kHz;
- what libsndfile cannot read (WebM/Opus and MP4/AAC, what browsers record), or
  whose length its header does not tell (a streamed WAV, a FLAC from a pipe), is
  decoded with PyAV (FFmpeg) when it is installed (`pip install av`, part of the
  `serve` and `notebook` extras). FFmpeg gets the bytes through memory only, its
  demuxer forced to the one container found and no protocol allowed, so an upload
  cannot make it open files or sockets (a concat list, an SDP or HLS playlist).

`open_audio` reads a source in pieces: its header is checked first (sample rate,
channels, and the duration against `max_seconds`) and `AudioSource.blocks()` then
decodes and resamples it block by block, so that a long file never sits whole in
memory; `load_audio` is the whole array, for notebooks.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from workbench.engine.cancel import CancelFlag, check_cancel

SAMPLE_RATE = 16_000
MIN_SOURCE_RATE = 1_000  # sample rates outside these bounds are a broken or hostile header
MAX_SOURCE_RATE = 384_000
MAX_CHANNELS = 64
BLOCK_SAMPLES = 1 << 18  # samples (frames x channels) decoded at a time: 1 MiB of float32


class AudioError(ValueError):
    """Audio that cannot be read or used (unknown format, NaN samples, wrong shape,
    an implausible header, longer than allowed)."""


# The audio containers read, as FFmpeg's demuxers: WAV, AIFF, FLAC, OGG (Vorbis, Opus),
# MP3, AAC (ADTS), MP4/M4A and WebM/Matroska. None of them opens other files or URLs
# (the MP4 demuxer would follow data references, but only with `enable_drefs`, off by
# default); the concat, playlist, SDP/RTP and image-sequence demuxers would.
CONTAINERS = ("wav", "aiff", "flac", "ogg", "mp3", "aac", "mov", "matroska")
NOT_AUDIO = ("not a supported audio file: send WAV, FLAC, OGG (Vorbis or Opus), MP3, "
             "MP4/M4A, AAC, WebM or AIFF")
# no protocol for FFmpeg: the input is PyAV's in-memory I/O, which needs none, and what
# a demuxer might try to open besides (a file, a URL) is refused
FFMPEG_OPTIONS = {"protocol_whitelist": "none"}
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide")  # an MP4's first box


def audio_container(f: BinaryIO) -> str | None:
    """FFmpeg's demuxer name (one of `CONTAINERS`) for the audio container the seekable
    binary file `f` holds, told from its first bytes; None for anything else."""
    offset, head = 0, f.read(12)
    for _ in range(4):  # ID3v2 tags, before MP3 (or FLAC, AAC) data
        if not (head[:3] == b"ID3" and len(head) >= 10 and all(b < 0x80 for b in head[6:10])):
            break
        size = int.from_bytes(bytes(head[6:10]), "big")
        size = (size & 0x7F) | (size >> 8 & 0x7F) << 7 | (size >> 16 & 0x7F) << 14 \
            | (size >> 24 & 0x7F) << 21  # "syncsafe": 7 bits a byte
        offset += 10 + size + (10 if head[5] & 0x10 else 0)  # header, tag, footer
        f.seek(offset)
        head = f.read(12)
    if head[:4] in (b"RIFF", b"RIFX", b"RF64", b"BW64") and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "aiff"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML
        return "matroska"
    if head[4:8] in _MP4_BOXES:
        return "mov"
    if len(head) >= 3 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:  # MPEG frame sync
        if head[1] & 0xF6 == 0xF0:  # MPEG-4 (or 2) audio, layer "0": ADTS
            return "aac"
        version, layer = head[1] >> 3 & 3, head[1] >> 1 & 3
        if version != 1 and layer and head[2] >> 4 != 15 and head[2] >> 2 & 3 != 3:
            return "mp3"
    return None


def format_duration(seconds: float) -> str:
    """`seconds` as H:MM:SS (whole seconds, rounded down): 36000 -> "10:00:00"."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class AudioSource:
    """Audio opened for reading in pieces, its header already checked.

    `duration`: seconds, as the header or container says (None when it does not say);
    `sample_rate` and `channels`: the source's own. `blocks()` decodes it from the
    start (again on every call) as 16 kHz mono float32 blocks of at most about
    `BLOCK_SAMPLES` samples, and raises `AudioError` for NaN or infinite samples and
    as soon as the audio runs past `max_seconds`, whatever the header said.
    """

    def __init__(self, blocks: Callable[[], Iterator[np.ndarray]], *, duration: float | None,
                 sample_rate: int, channels: int, max_seconds: float | None):
        self._blocks = blocks
        self.duration = duration
        self.sample_rate = sample_rate
        self.channels = channels
        self.max_seconds = max_seconds

    def blocks(self, cancel: CancelFlag | None = None) -> Iterator[np.ndarray]:
        """16 kHz mono float32 blocks, in order; `cancel` is looked at between blocks."""
        limit = None if self.max_seconds is None else self.max_seconds * SAMPLE_RATE
        n = 0
        for block in self._blocks():
            check_cancel(cancel)
            _checked(block, offset=n)
            n += len(block)
            if limit is not None and n > limit + 1:  # + 1: a resampler's rounding
                raise AudioError(f"the audio is longer than {format_duration(self.max_seconds)}"
                                 f", the most this call allows (max_seconds)")
            yield block


def open_audio(source: str | os.PathLike | bytes | np.ndarray, *,
               sample_rate: int | None = None, max_seconds: float | None = None
               ) -> AudioSource:
    """Open `source` (a file path, encoded bytes, or an array) for reading in pieces.

    The header is checked before any decoding: a sample rate outside
    [MIN_SOURCE_RATE, MAX_SOURCE_RATE], more than MAX_CHANNELS channels, or a
    duration over `max_seconds` (None: no limit) raise `AudioError`. For an array,
    `sample_rate` says its rate (default 16 kHz); (n,) is mono, (n, channels) is
    averaged to mono, integer arrays are scaled from their full range to [-1, 1].
    """
    _check_max_seconds(max_seconds)
    if isinstance(source, np.ndarray):
        return _array_source(source, sample_rate or SAMPLE_RATE, max_seconds)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            return AudioSource(lambda: iter(()), duration=0.0, sample_rate=SAMPLE_RATE,
                               channels=1, max_seconds=max_seconds)
        container = audio_container(io.BytesIO(data))
        if container is None:
            raise AudioError(f"the data: {NOT_AUDIO}")
        return _open_encoded(lambda: io.BytesIO(data), "the data", container, max_seconds)
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"audio file not found: {path}")
    with open(path, "rb") as f:
        container = audio_container(f)
    if container is None:
        raise AudioError(f"{path}: {NOT_AUDIO}")
    return _open_encoded(lambda: str(path), str(path), container, max_seconds)


def load_audio(source: str | os.PathLike | bytes | np.ndarray, *,
               sample_rate: int | None = None, max_seconds: float | None = None) -> np.ndarray:
    """16 kHz mono float32 samples of `source`: a file path, encoded bytes, or an array.

    The whole audio as one array (for notebooks; `open_audio` reads it in pieces).
    `sample_rate` and `max_seconds` as for `open_audio`: audio longer than
    `max_seconds` is refused from its header when it tells the duration, else
    while decoding.
    """
    if isinstance(source, np.ndarray):
        _check_array_duration(source, sample_rate or SAMPLE_RATE, max_seconds)
        return _from_array(source, sample_rate or SAMPLE_RATE)
    blocks = list(open_audio(source, max_seconds=max_seconds).blocks())
    return np.concatenate(blocks) if blocks else np.zeros(0, np.float32)


def decode_audio(data: bytes, *, max_seconds: float | None = None) -> np.ndarray:
    """Decode encoded audio bytes (WebM/Opus, OGG, MP4/AAC, WAV ...) to 16 kHz mono float32."""
    return load_audio(bytes(data), max_seconds=max_seconds)


# -- sources --------------------------------------------------------------------------------

def _check_header(where: str, rate: int, channels: int, duration: float | None,
                  max_seconds: float | None) -> None:
    if not MIN_SOURCE_RATE <= rate <= MAX_SOURCE_RATE:
        raise AudioError(f"{where}: a sample rate of {rate} Hz is outside "
                         f"{MIN_SOURCE_RATE}..{MAX_SOURCE_RATE} Hz (a broken header?)")
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioError(f"{where}: {channels} channels is outside 1..{MAX_CHANNELS}")
    if max_seconds is not None and duration is not None and duration > max_seconds:
        raise AudioError(f"the audio is {format_duration(duration)} long; this call allows "
                         f"at most {format_duration(max_seconds)} (max_seconds)")


class _Unreadable(AudioError):
    """PyAV is not installed, or FFmpeg cannot open the data (not: a checked header)."""


PROBE_SAMPLES = 4096  # samples read when a file is opened: some open, then fail to read


def _open_encoded(opener: Callable[[], str | io.BytesIO], where: str, container: str,
                  max_seconds: float | None) -> AudioSource:
    """libsndfile when it reads the format and knows its length, else PyAV (FFmpeg's
    `container` demuxer)."""
    import soundfile

    try:
        with soundfile.SoundFile(opener()) as f:
            rate, channels, frames = f.samplerate, f.channels, f.frames
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        return _pyav_instead(opener, where, container, max_seconds, exc)
    if 0 < frames < 1 << 62 and rate > 0:
        duration = frames / rate
    else:
        # The header does not tell the length. libsndfile says 0 frames for a streamed
        # WAV (data size 0, as browsers and FFmpeg pipes write it) and reads nothing, and
        # 2**63 - 1 for a FLAC whose STREAMINFO says total_samples=0 (`ffmpeg -f flac
        # pipe:`), whose reading then fails at its end on a seek; FFmpeg reads both to
        # their end, max_seconds checked while decoding. Without PyAV (or where FFmpeg
        # cannot open it) libsndfile it is, as before.
        try:
            return _open_pyav(opener, where, container, max_seconds)
        except _Unreadable:
            duration = None
    _check_header(where, rate, channels, duration, max_seconds)
    try:  # a first read, small whatever the channel count
        with soundfile.SoundFile(opener()) as f:
            f.read(max(1, PROBE_SAMPLES // channels), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError) as exc:
        source = _pyav_instead(opener, where, container, max_seconds, exc)
        decoded, failure = source._blocks, f"{where}: could not decode the audio ({exc})"

        def pyav_blocks() -> Iterator[np.ndarray]:  # no audio at all: libsndfile's error
            n = 0
            for block in decoded():
                n += len(block)
                yield block
            if not n:
                raise AudioError(failure)

        source._blocks = pyav_blocks
        return source

    def blocks() -> Iterator[np.ndarray]:
        per_block = max(1, BLOCK_SAMPLES // channels)
        stream = _Resampler(rate)
        try:
            with soundfile.SoundFile(opener()) as f:
                while True:
                    data = f.read(per_block, dtype="float32", always_2d=True)
                    if not len(data):
                        break
                    pcm = data[:, 0] if channels == 1 else data.mean(axis=1)
                    out = stream(np.ascontiguousarray(pcm, dtype=np.float32))
                    if len(out):
                        yield out
        except (soundfile.LibsndfileError, RuntimeError) as exc:
            raise AudioError(f"{where}: could not decode the audio ({exc})") from None
        tail = stream.flush()
        if len(tail):
            yield tail

    return AudioSource(blocks, duration=duration, sample_rate=rate, channels=channels,
                       max_seconds=max_seconds)


def _pyav_instead(opener: Callable[[], str | io.BytesIO], where: str, container: str,
                  max_seconds: float | None, exc: Exception) -> AudioSource:
    """PyAV for what libsndfile cannot open or read (`exc`); header checks raise as they are."""
    try:
        return _open_pyav(opener, where, container, max_seconds)
    except _Unreadable as inner:
        reason = getattr(exc, "error_string", None) or exc  # without the file object
        raise AudioError(f"{where}: not audio that soundfile or FFmpeg can read "
                         f"({reason}; {inner})") from None


@contextlib.contextmanager
def _ffmpeg_input(opener: Callable[[], str | io.BytesIO], container: str):
    """The PyAV container of `opener()`'s bytes, read by FFmpeg's `container` demuxer
    through PyAV's Python I/O (a path is opened here, not by FFmpeg), no protocol
    allowed: nothing in the data can make FFmpeg open a file or a socket."""
    import av

    source = opener()
    with (open(source, "rb") if isinstance(source, str) else source) as f, \
            av.open(f, mode="r", format=container, container_options=FFMPEG_OPTIONS) as opened:
        yield opened


def _open_pyav(opener: Callable[[], str | io.BytesIO], where: str, container: str,
               max_seconds: float | None) -> AudioSource:
    """Compressed audio (WebM, MP4 ...) decoded packet by packet with PyAV, by FFmpeg's
    `container` demuxer."""
    try:
        import av
    except ImportError:
        raise _Unreadable("decoding compressed audio needs PyAV: pip install av") from None
    try:
        with _ffmpeg_input(opener, container) as input_:
            if not input_.streams.audio:
                raise _Unreadable("the data holds no audio stream")
            stream = input_.streams.audio[0]
            rate = int(stream.codec_context.sample_rate or 0)
            # FFmpeg reads a count past its own limit (65535) as 0: report the header's
            channels = int(stream.codec_context.channels or 0) or _claimed_channels(
                opener, container)
            if stream.duration and stream.time_base:
                duration = float(stream.duration * stream.time_base)
            elif input_.duration:
                duration = input_.duration / av.time_base
            else:
                duration = None  # MediaRecorder's WebM: checked while decoding
    except AudioError:
        raise
    except Exception as exc:  # av.error.InvalidDataError and friends
        raise _Unreadable(f"could not decode the audio ({type(exc).__name__}: {exc})"
                          ) from None
    _check_header(where, rate, channels, duration, max_seconds)

    def blocks() -> Iterator[np.ndarray]:
        try:
            with _ffmpeg_input(opener, container) as input_:
                resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
                for frame in input_.decode(audio=0):
                    if not MIN_SOURCE_RATE <= frame.sample_rate <= MAX_SOURCE_RATE:
                        raise AudioError(f"{where}: a frame at {frame.sample_rate} Hz")
                    for out in resampler.resample(frame):
                        yield out.to_ndarray().reshape(-1).astype(np.float32, copy=False)
                for out in resampler.resample(None):  # flush
                    yield out.to_ndarray().reshape(-1).astype(np.float32, copy=False)
        except AudioError:
            raise
        except Exception as exc:
            raise AudioError(f"could not decode the audio ({type(exc).__name__}: {exc})"
                             ) from None

    return AudioSource(blocks, duration=duration, sample_rate=rate, channels=channels,
                       max_seconds=max_seconds)


def _claimed_channels(opener: Callable[[], str | io.BytesIO], container: str) -> int:
    """The channel count a WAV or AIFF header writes (its `fmt ` or `COMM` chunk, within
    the first 64 KiB); 0 for another container or where there is none."""
    if container not in ("wav", "aiff"):
        return 0
    source = opener()
    with (open(source, "rb") if isinstance(source, str) else source) as f:
        head = f.read(1 << 16)
    if head[:4] not in (b"RIFF", b"RIFX", b"RF64", b"BW64", b"FORM"):
        return 0
    order = "big" if head[:4] in (b"RIFX", b"FORM") else "little"
    # the 16-bit count: a WAV's `fmt ` data has the format tag first, AIFF's `COMM` not
    chunk, at = (b"COMM", 0) if head[:4] == b"FORM" else (b"fmt ", 2)
    pos = 12
    while pos + 12 <= len(head):  # chunks: a 4-byte name, a 4-byte size, the data
        size = int.from_bytes(head[pos + 4 : pos + 8], order)
        if head[pos : pos + 4] == chunk:
            return int.from_bytes(head[pos + 8 + at : pos + 10 + at], order)
        pos += 8 + size + (size & 1)
    return 0


def _array_source(data: np.ndarray, rate: int, max_seconds: float | None) -> AudioSource:
    _check_array_duration(data, rate, max_seconds)
    pcm = _from_array(data, rate)

    def blocks() -> Iterator[np.ndarray]:
        for start in range(0, len(pcm), BLOCK_SAMPLES):
            yield pcm[start : start + BLOCK_SAMPLES]

    return AudioSource(blocks, duration=len(pcm) / SAMPLE_RATE, sample_rate=rate, channels=1,
                       max_seconds=max_seconds)


def _check_max_seconds(max_seconds: float | None) -> None:
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"max_seconds must be positive or None, not {max_seconds!r}")


def _check_array_duration(data: np.ndarray, rate: int, max_seconds: float | None) -> None:
    _check_max_seconds(max_seconds)
    if not MIN_SOURCE_RATE <= rate <= MAX_SOURCE_RATE:
        raise AudioError(f"sample_rate={rate} is outside {MIN_SOURCE_RATE}..{MAX_SOURCE_RATE} Hz")
    shape = np.shape(data)
    n = shape[1] if len(shape) == 2 and shape[1] > 8 else (shape[0] if shape else 0)
    _check_header("the array", rate, 1, n / rate, max_seconds)


class _Resampler:
    """Streaming `soxr` resampling of mono float32 blocks to 16 kHz (the same samples as
    `soxr.resample` on the whole)."""

    def __init__(self, rate: int):
        import soxr

        self._stream = None if rate == SAMPLE_RATE else soxr.ResampleStream(
            rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        if self._stream is None:
            return pcm
        return self._stream.resample_chunk(pcm, last=False)

    def flush(self) -> np.ndarray:
        if self._stream is None:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)


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


def _checked(pcm: np.ndarray, offset: int = 0) -> np.ndarray:
    if not np.isfinite(pcm).all():
        bad = offset + int(np.flatnonzero(~np.isfinite(pcm))[0])
        raise AudioError(f"the audio has NaN or infinite samples (the first at sample {bad})")
    return pcm


__all__ = ["CONTAINERS", "SAMPLE_RATE", "AudioError", "AudioSource", "audio_container",
           "decode_audio", "format_duration", "load_audio", "open_audio"]
