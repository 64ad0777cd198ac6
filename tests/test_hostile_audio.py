"""Hostile audio: one upload must not take gigabytes or minutes.

- The log-mel spectrogram computed 30 s window by window (what `transcribe` does) is
  the whole-audio spectrogram, clamp included, on JFK and a synthetic 95 s signal.
- 10 hours of silence as a 1.9 MB FLAC (path and bytes) is refused from its header by
  `max_seconds` at once; without a limit it is transcribed streaming, in a subprocess
  under RLIMIT_AS, its peak memory bounded.
- A WAV whose header says 1 Hz, 65 channels, a FLAC that hides its length past
  `max_seconds`, truncated and garbage files: a clear `AudioError`, fast.
- A streamed WAV (data size 0 or 0xFFFFFFFF) and a FLAC without total_samples (as
  pipes write them) decode to the whole file's samples (PyAV, a dev dependency).
- `cancel=` stops a transcription soon after the flag is set.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import wave

import numpy as np
import pytest

from tests.support.shared import shared_file

TEN_HOURS = 10 * 3600


def windowed_mel(pcm: np.ndarray, filters: np.ndarray, block: int) -> np.ndarray:
    """The spectrogram as `transcribe` computes it: blocks -> 30 s windows, a first pass
    for the maximum, then each window's 3000 frames."""
    from workbench.engine.audio import mel

    blocks = [pcm[i : i + block] for i in range(0, len(pcm), block)]
    log_max = mel.LOG_MEL_FLOOR
    for _, x in mel.mel_windows(blocks):
        log_max = mel.window_log10_mel_max(x, filters, log_max)
    chunks = [mel.scale_log_mel(mel.window_log10_mel(x, filters)[:, : mel.N_FRAMES],
                                 log_max) for _, x in mel.mel_windows(blocks)]
    return np.concatenate(chunks, axis=1) if chunks else np.zeros((len(filters), 0))


def synthetic_95s() -> np.ndarray:
    """Tones and noise, an all-but-silent window (its transform skipped for the maximum),
    digital silence, a click right at a window's end: 95 s at 16 kHz."""
    rng = np.random.default_rng(0)
    t = np.arange(95 * 16000) / 16000
    pcm = 0.3 * np.sin(2 * np.pi * 440 * t) * (t % 7 < 3) + 0.01 * rng.standard_normal(len(t))
    pcm[30 * 16000 : 60 * 16000] = 1e-6 * rng.standard_normal(30 * 16000)
    pcm[62 * 16000 : 70 * 16000] = 0
    pcm[90 * 16000 - 30 : 90 * 16000] = 0.9
    return pcm.astype(np.float32)


@pytest.mark.parametrize("name", ["jfk", "synthetic-95s", "short", "one-window-and-a-bit",
                                  "empty"])
def test_windowed_log_mel_is_the_whole_log_mel(name):
    from workbench.engine.audio.mel import N_SAMPLES, log_mel_spectrogram
    from workbench.engine.audio.pcm import load_audio
    from workbench.engine.formats.convert import mel_filters

    pcm = {"jfk": lambda: load_audio(shared_file("data", "whisper", "jfk.wav")),
           "synthetic-95s": synthetic_95s, "short": lambda: synthetic_95s()[:150],
           "one-window-and-a-bit": lambda: synthetic_95s()[: N_SAMPLES + 100],
           "empty": lambda: np.zeros(0, np.float32)}[name]()
    filters = mel_filters(80)
    whole = log_mel_spectrogram(pcm, filters, padding=N_SAMPLES)
    for block in (4000, 12345, 1 << 18):
        ours = windowed_mel(pcm, filters, block)
        assert ours.shape == (80, -(-len(pcm) // N_SAMPLES) * 3000)
        assert np.abs(ours - whole[:, : ours.shape[1]]).max(initial=0) <= 1e-6


def test_quiet_window_max_needs_no_transform(monkeypatch):
    from workbench.engine.audio import mel
    from workbench.engine.formats.convert import mel_filters

    filters = mel_filters(80)
    rng = np.random.default_rng(1)
    loud = (0.1 * rng.standard_normal(mel.N_SAMPLES + 560)).astype(np.float32)
    quiet = loud * 1e-5
    true_max = float(mel.window_log10_mel(loud, filters).max())
    assert mel.window_log10_mel_max(loud, filters, mel.LOG_MEL_FLOOR) == true_max
    assert mel.window_log10_mel_max(loud, filters, true_max + 1) == true_max + 1

    def fail(*_):
        raise AssertionError("transformed a window that cannot raise the maximum")

    monkeypatch.setattr(mel, "window_log10_mel", fail)
    assert mel.window_log10_mel_max(quiet, filters, true_max) == true_max
    assert mel.window_log10_mel_max(np.zeros_like(loud), filters, mel.LOG_MEL_FLOOR) \
        == mel.LOG_MEL_FLOOR


# -- hostile files, in a subprocess with bounded address space ----------------------------------

@pytest.fixture(scope="module")
def ten_hours_flac(tmp_path_factory):
    """10 h of silence as 16 kHz FLAC (1.9 MB), written 10 minutes at a time."""
    import soundfile

    path = tmp_path_factory.mktemp("hostile") / "ten-hours.flac"
    zeros = np.zeros(600 * 16000, np.int16)
    with soundfile.SoundFile(path, "w", 16000, 1, "PCM_16", format="FLAC") as f:
        for _ in range(TEN_HOURS // 600):
            f.write(zeros)
    assert path.stat().st_size < 3_000_000
    return path


ISOLATED = """
import json, resource, sys, threading, time
from workbench import WhisperModel
from workbench.engine.audio.pcm import AudioError, load_audio
from workbench.engine.cancel import Cancelled

path = sys.argv[1]
w = WhisperModel.load("whisper-tiny.en", prepare_kernels=False)


def peak_rss_mb():
    # VmHWM, not ru_maxrss: ru_maxrss carries the forking parent's peak across exec
    hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
    return int(hwm.split()[1]) / 1024


out = {"rss_loaded_mb": peak_rss_mb()}


def attempt(name, call):
    start = time.perf_counter()
    try:
        result = call()
        out[name] = {"result": str(result), "duration": getattr(result, "duration", None)}
    except (AudioError, Cancelled) as exc:
        out[name] = {"error": type(exc).__name__, "message": str(exc)}
    out[name]["seconds"] = time.perf_counter() - start
    out[name]["rss_mb"] = peak_rss_mb()


data = open(path, "rb").read()
attempt("path_limited", lambda: w.transcribe(path, max_seconds=3600))
attempt("bytes_limited", lambda: w.transcribe(data, max_seconds=3600))
attempt("load_limited", lambda: load_audio(path, max_seconds=3600))
cancel = threading.Event()
threading.Timer(0.5, cancel.set).start()
attempt("cancelled", lambda: w.transcribe(data, cancel=cancel))
attempt("unlimited", lambda: w.transcribe(data))
print(json.dumps(out))
"""


def run_isolated(script: str, *args: str, address_space_gib: float = 2.5,
                 timeout: float = 120) -> dict:
    """Run `script` in a fresh interpreter whose address space is capped: a regression
    that holds hours of audio at once dies there (MemoryError), not in this process.
    Returns the JSON its last line prints."""
    limit = int(address_space_gib * 2**30)
    prelude = ("import resource; resource.setrlimit(resource.RLIMIT_AS, "
               f"({limit}, {limit}))\n")
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1",
                               "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_ten_hours_of_silence(ten_hours_flac):
    """Refused by max_seconds from the header (path, bytes, load_audio) in well under a
    second of work; cancelled soon after the flag; without a limit transcribed streaming
    to an empty transcript, memory bounded (the old whole-file path peaked at 10.9 GB)."""
    r = run_isolated(ISOLATED, str(ten_hours_flac))
    for name in ("path_limited", "bytes_limited", "load_limited"):
        assert r[name]["error"] == "AudioError", r[name]
        assert r[name]["message"] == ("the audio is 10:00:00 long; this call allows at "
                                      "most 1:00:00 (max_seconds)")
        assert r[name]["seconds"] < 2
        assert r[name]["rss_mb"] < r["rss_loaded_mb"] + 100
    assert r["cancelled"]["error"] == "Cancelled"
    assert r["cancelled"]["seconds"] < 3  # the flag is set at 0.5 s; the whole takes ~10 s
    unlimited = r["unlimited"]
    assert unlimited.get("result") == "" and unlimited["duration"] == TEN_HOURS, unlimited
    assert unlimited["rss_mb"] < 600, unlimited  # 10 h of float32 PCM alone is 2.3 GB
    assert unlimited["seconds"] < 90


def wav_bytes(samples: np.ndarray, rate: int, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return buf.getvalue()


BAD_HEADERS = """
import json, sys, time
from workbench.engine.audio.pcm import AudioError, load_audio
out = {}
for path in sys.argv[1:]:
    start = time.perf_counter()
    try:
        pcm = load_audio(path, max_seconds=60)
        out[path] = {"samples": len(pcm)}
    except AudioError as exc:
        out[path] = {"error": str(exc)}
    out[path]["seconds"] = time.perf_counter() - start
print(json.dumps(out))
"""


def test_implausible_headers_and_broken_files(tmp_path):
    """Each a clear AudioError within a second, none decoded at a huge size first."""
    import soundfile

    rng = np.random.default_rng(2)
    noise = (rng.standard_normal(16000) * 1000).astype(np.int16)
    # 32 KB whose header says 1 Hz: 16000 s, 1 GB once resampled to 16 kHz
    (tmp_path / "one-hertz.wav").write_bytes(wav_bytes(noise, 1))
    soundfile.write(tmp_path / "many-channels.wav", np.zeros((100, 65), np.float32), 16000)
    # a FLAC whose STREAMINFO does not tell its length (0): 2 minutes, found while decoding
    buf = io.BytesIO()
    soundfile.write(buf, rng.standard_normal(120 * 16000).astype(np.float32) * 0.1, 16000,
                    format="FLAC", subtype="PCM_16")
    flac = bytearray(buf.getvalue())
    assert flac[:4] == b"fLaC"
    fields = int.from_bytes(flac[18:26], "big")  # rate:20 channels:3 bits:5 samples:36
    flac[18:26] = (fields & ~((1 << 36) - 1)).to_bytes(8, "big")
    (tmp_path / "no-length.flac").write_bytes(bytes(flac))
    buf = io.BytesIO()
    soundfile.write(buf, rng.standard_normal(50 * 16000).astype(np.float32) * 0.1, 16000,
                    format="FLAC", subtype="PCM_16")
    (tmp_path / "truncated.flac").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    (tmp_path / "garbage.wav").write_bytes(b"RIFF\0\0\0\0WAVEfmt " + rng.bytes(3000))
    expected = {
        "one-hertz.wav": r"a sample rate of 1 Hz is outside 1000\.\.384000 Hz",
        "many-channels.wav": r"65 channels is outside 1\.\.64",
        "no-length.flac": r"the audio is longer than 0:01:00, the most this call allows "
                          r"\(max_seconds\)",
        "truncated.flac": r"could not decode the audio",
        "garbage.wav": r"not audio that soundfile or FFmpeg can read"}
    r = run_isolated(BAD_HEADERS, *(str(tmp_path / name) for name in expected))
    for name, pattern in expected.items():
        got = r[str(tmp_path / name)]
        assert "error" in got, (name, got)
        assert re.search(pattern, got["error"]), (name, got["error"])
        assert got["seconds"] < 2, (name, got)


@pytest.mark.parametrize("channels", [300, 1000, 65535])
@pytest.mark.parametrize("container", ["wav", "aiff"])
def test_a_header_claiming_thousands_of_channels_says_how_many(tmp_path, channels, container):
    """libsndfile refuses more than 256 channels and FFmpeg reads a count past its own
    limit as 0: the error names the count the header claims, not "0 channels"."""
    from workbench.engine.audio.pcm import AudioError, load_audio

    if container == "wav":
        data = bytearray(wav_bytes(np.zeros(400, np.int16), 16000))
        data[22:24] = channels.to_bytes(2, "little")  # fmt: channels, rate, byte rate, align
        data[28:32] = (16000 * 2 * channels).to_bytes(4, "little")
        data[32:34] = (2 * channels & 0xFFFF).to_bytes(2, "little")
    else:
        import soundfile

        buf = io.BytesIO()
        soundfile.write(buf, np.zeros(400, np.float32), 16000, format="AIFF", subtype="PCM_16")
        data = bytearray(buf.getvalue())
        comm = data.index(b"COMM")
        data[comm + 8 : comm + 10] = channels.to_bytes(2, "big")
    path = tmp_path / f"many.{container}"
    path.write_bytes(bytes(data))
    for source in (bytes(data), path):
        with pytest.raises(AudioError, match=rf"{channels} channels is outside 1\.\.64"):
            load_audio(source)


def jfk_int16() -> tuple[np.ndarray, int]:
    import soundfile

    pcm, rate = soundfile.read(shared_file("data", "whisper", "jfk.wav"), dtype="int16")
    return pcm, rate


def streamed_wav(data: bytes, size: int) -> bytes:
    """`data` (a 44-byte-header WAV) as a streaming writer leaves it: RIFF and data
    sizes unknown (0, or 0xFFFFFFFF)."""
    wav = bytearray(data)
    assert wav[:4] == b"RIFF" and wav[36:40] == b"data"
    wav[4:8] = wav[40:44] = size.to_bytes(4, "little")
    return bytes(wav)


def flac_without_length(data: bytes) -> bytes:
    """`data` (a FLAC) with STREAMINFO's 36-bit total_samples zeroed, as
    `ffmpeg -f flac pipe:` writes it."""
    flac = bytearray(data)
    assert flac[:4] == b"fLaC"
    fields = int.from_bytes(flac[18:26], "big")  # rate:20 channels:3 bits:5 samples:36
    flac[18:26] = (fields & ~((1 << 36) - 1)).to_bytes(8, "big")
    return bytes(flac)


@pytest.mark.parametrize("size", [0, 0xFFFFFFFF])
def test_streamed_wav_decodes_whole(size, tmp_path):
    """A WAV whose header does not tell its data size (browsers, FFmpeg pipes) is the
    same samples as the whole WAV, not 0 of them (libsndfile says 0 frames: PyAV reads
    it); max_seconds still holds."""
    import av  # noqa: F401  (a dev dependency: its absence is a failure, not a skip)

    from workbench.engine.audio.pcm import AudioError, load_audio

    pcm, rate = jfk_int16()
    whole = load_audio(wav_bytes(pcm, rate))
    assert len(whole) == len(pcm) == 176000
    data = streamed_wav(wav_bytes(pcm, rate), size)
    np.testing.assert_array_equal(load_audio(data), whole)
    (tmp_path / "streamed.wav").write_bytes(data)
    np.testing.assert_array_equal(load_audio(tmp_path / "streamed.wav"), whole)
    with pytest.raises(AudioError, match=r"0:00:10"):
        load_audio(data, max_seconds=10)
    long = streamed_wav(wav_bytes(np.zeros(16000 * 100, np.int16), 16000), size)
    with pytest.raises(AudioError, match=r"0:01:00"):
        load_audio(long, max_seconds=60)


def test_flac_without_length_decodes_whole(tmp_path):
    """A FLAC whose STREAMINFO says total_samples=0 (libsndfile: 2**63 - 1 frames, then
    a failed seek at its end) is the same samples as the whole FLAC, bytes or path."""
    import av  # noqa: F401  (a dev dependency: its absence is a failure, not a skip)
    import soundfile

    from workbench.engine.audio.pcm import AudioError, load_audio, open_audio

    pcm, rate = jfk_int16()
    buf = io.BytesIO()
    soundfile.write(buf, pcm, rate, format="FLAC", subtype="PCM_16")
    whole = load_audio(buf.getvalue())
    assert len(whole) == 176000
    np.testing.assert_allclose(whole, load_audio(wav_bytes(pcm, rate)), atol=1e-6)
    data = flac_without_length(buf.getvalue())
    assert open_audio(data).duration is None
    np.testing.assert_array_equal(load_audio(data), whole)
    (tmp_path / "no-length.flac").write_bytes(data)
    np.testing.assert_array_equal(load_audio(tmp_path / "no-length.flac"), whole)
    with pytest.raises(AudioError, match=r"longer than 0:00:10"):
        load_audio(data, max_seconds=10)


def test_first_read_failure_tries_pyav():
    """A FLAC cut just past its header opens in libsndfile but does not read: PyAV is
    tried, and finding no audio either, it is libsndfile's error, not 0 samples."""
    import soundfile

    from workbench.engine.audio.pcm import AudioError, load_audio

    pcm, rate = jfk_int16()
    buf = io.BytesIO()
    soundfile.write(buf, pcm, rate, format="FLAC", subtype="PCM_16")
    with soundfile.SoundFile(io.BytesIO(buf.getvalue()[:92])) as f:
        with pytest.raises(soundfile.LibsndfileError):
            f.read(4096)
    with pytest.raises(AudioError, match="could not decode the audio"):
        load_audio(buf.getvalue()[:92])


def test_max_seconds_on_arrays_and_bytes():
    from workbench.engine.audio.pcm import AudioError, decode_audio, load_audio, open_audio

    with pytest.raises(AudioError, match=r"is 0:02:00 long; this call allows at most 0:01:30"):
        load_audio(np.zeros(120 * 16000, np.float32), max_seconds=90)
    with pytest.raises(AudioError, match=r"is 0:02:00 long"):
        load_audio(np.zeros((120 * 8000, 2), np.int16), sample_rate=8000, max_seconds=90)
    with pytest.raises(AudioError, match="sample_rate=1 is outside"):
        load_audio(np.zeros(10, np.float32), sample_rate=1)
    data = wav_bytes(np.zeros(16000 * 5, np.int16), 16000)
    assert open_audio(data).duration == 5.0
    assert len(decode_audio(data, max_seconds=5)) == 16000 * 5
    with pytest.raises(AudioError, match=r"is 0:00:05 long; this call allows at most 0:00:04"):
        decode_audio(data, max_seconds=4)
    with pytest.raises(ValueError, match="max_seconds must be positive"):
        load_audio(data, max_seconds=0)


def test_blocks_are_bounded_and_checked():
    """A 44.1 kHz stereo WAV comes in blocks of at most ~BLOCK_SAMPLES, resampled as a
    whole would be; a NaN is reported at its 16 kHz position."""
    import soundfile
    import soxr

    from workbench.engine.audio.pcm import BLOCK_SAMPLES, AudioError, load_audio, open_audio

    rng = np.random.default_rng(3)
    stereo = (0.1 * rng.standard_normal((44100 * 20, 2))).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, stereo, 44100, format="WAV", subtype="FLOAT")
    source = open_audio(buf.getvalue())
    assert (source.sample_rate, source.channels, source.duration) == (44100, 2, 20.0)
    blocks = list(source.blocks())
    assert len(blocks) > 1 and max(map(len, blocks)) <= BLOCK_SAMPLES
    whole = soxr.resample(stereo.mean(axis=1), 44100, 16000, quality="HQ")
    np.testing.assert_array_equal(np.concatenate(blocks), whole)
    stereo[44100 * 10, 1] = np.inf
    buf = io.BytesIO()
    soundfile.write(buf, stereo[: 44100 * 12], 44100, format="WAV", subtype="FLOAT")
    with pytest.raises(AudioError, match="NaN or infinite samples"):
        load_audio(buf.getvalue())


# -- cancellation and the engine on real audio -------------------------------------------------

@pytest.fixture(scope="module")
def tiny_en():
    from workbench import WhisperModel

    with WhisperModel.load("whisper-tiny.en") as w:
        w.warmup.wait()
        yield w


@pytest.mark.slow
def test_cancel_stops_a_transcription_soon(tiny_en, monkeypatch):
    """The flag, set once the first of four 30 s chunks is encoded, stops the call within
    that chunk's decoding (no second chunk is encoded); a flag set from the start stops
    it before any encoding; a flag never set changes nothing."""
    from workbench.engine.audio.pcm import load_audio
    from workbench.engine.cancel import Cancelled

    jfk = load_audio(shared_file("data", "whisper", "jfk.wav"))
    audio = np.concatenate([jfk, np.zeros(30 * 16000 - len(jfk), np.float32)] * 4)
    cancel = threading.Event()
    set_at = []
    encode = tiny_en.net.encode

    def encode_then_cancel(mel, cancel_flag=None):
        features = encode(mel, cancel_flag)
        cancel.set()
        set_at.append(time.perf_counter())
        return features

    monkeypatch.setattr(tiny_en.net, "encode", encode_then_cancel)
    with pytest.raises(Cancelled):
        tiny_en.transcribe(audio, cancel=cancel)
    assert len(set_at) == 1
    assert time.perf_counter() - set_at[0] < 2.0  # a decoding step is ~10 ms

    class Looks:  # counts how often it is looked at
        calls = 0

        def is_set(self) -> bool:
            self.calls += 1
            return True

    flag = Looks()
    with pytest.raises(Cancelled):
        tiny_en.transcribe(audio, cancel=flag)
    assert flag.calls == 1 and len(set_at) == 1
    monkeypatch.undo()
    t = tiny_en.transcribe(jfk, max_tokens=8, cancel=threading.Event())
    assert t.startswith("And so my fellow") and t.duration == 11.0


@pytest.mark.slow
def test_detect_language_reads_only_the_first_window(tmp_path):
    """On a multilingual model only the first 30 s (and the samples its frames reach)
    are decoded: a 10 minute file cut off after 5 minutes is still detected, and the
    whole file would be an error."""
    import soundfile

    from workbench import WhisperModel
    from workbench.engine.audio.pcm import AudioError, load_audio

    jfk = load_audio(shared_file("data", "whisper", "jfk.wav"))
    noise = 0.002 * np.random.default_rng(4).standard_normal(16000 * 600).astype(np.float32)
    soundfile.write(tmp_path / "long.flac", np.concatenate([jfk, noise]), 16000,
                    subtype="PCM_16")
    data = (tmp_path / "long.flac").read_bytes()
    (tmp_path / "cut.flac").write_bytes(data[: len(data) // 2])
    with pytest.raises(AudioError, match="could not decode"):
        load_audio(tmp_path / "cut.flac")
    with WhisperModel.load("whisper-base", prepare_kernels=False) as base:
        language, p = base.detect_language(tmp_path / "cut.flac")
        assert language == "en" and p > 0.5
