"""Whisper's log-mel features, whole (`log_mel_spectrogram`) and in 30 s windows.

16 kHz audio (`workbench.engine.audio.pcm.SAMPLE_RATE`), periodic Hann window of 400
samples, hop 160, reflect-padded centred frames, power spectrum through the model
file's mel filterbank, log10 (floored at 1e-10 and at 8 below the maximum), then
(x + 4) / 4. A 30 s chunk is 3000 frames.

The windowed pieces (`mel_windows`, `window_log10_mel`, `window_log10_mel_max`,
`scale_log_mel`) compute the same spectrogram 30 s at a time, so that long audio
never sits whole in memory. A window carries context past its own samples: its
centred frames read 200 samples before it and 40 after, and it also computes the
next window's first 2 frames, the last frames that can touch its audio, so its
frames are exactly those of the whole spectrogram. The clamp at 8 below the maximum
is over the whole spectrogram, so the windows need its global maximum first: one
pass for the maximum (`window_log10_mel_max`, which skips quiet windows' transforms),
then one to scale each window (`scale_log_mel`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from workbench.engine.audio.pcm import SAMPLE_RATE

N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples in a chunk
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames in a chunk


def log_mel_spectrogram(audio: np.ndarray, filters: np.ndarray, padding: int = 0) -> np.ndarray:
    """Whisper's log-mel spectrogram of 16 kHz mono audio: (n_mels, n_frames) float32.

    `padding` zero samples are appended first (Whisper appends a whole chunk,
    480000, so that the last chunk is complete). n_frames = len(audio) // 160.
    """
    audio = np.asarray(audio, dtype=np.float32)
    if padding:
        audio = np.concatenate([audio, np.zeros(padding, np.float32)])
    if len(audio) <= N_FFT // 2:  # reflect padding needs more samples than it adds
        audio = np.concatenate([audio, np.zeros(N_FFT // 2 + 1 - len(audio), np.float32)])
    x = np.pad(audio, N_FFT // 2, mode="reflect")  # centred frames
    n_frames = 1 + (len(x) - N_FFT) // HOP_LENGTH
    frames = np.lib.stride_tricks.as_strided(
        x, shape=(n_frames, N_FFT), strides=(x.strides[0] * HOP_LENGTH, x.strides[0]))
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)
    spectrum = np.fft.rfft(frames * window, axis=-1)  # (n_frames, 201)
    power = (spectrum.real ** 2 + spectrum.imag ** 2)[:-1]  # the last frame is dropped
    mel = filters.astype(np.float64) @ power.T  # (n_mels, n_frames - 1)
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


# The same spectrogram window by window, so that long audio never sits whole in memory.
# A 30 s window's 3000 frames read 200 samples before it and 40 after; its x also holds
# the next window's first 2 frames (360 after), the last frames that can touch audio
# past the window's end, so that the maxima of the windows are the whole one's.
LOG_MEL_FLOOR = float(np.log10(np.float64(1e-10)))  # every all-zero frame's log10 power
WINDOW_BEFORE = N_FFT // 2
WINDOW_AFTER = 2 * HOP_LENGTH + N_FFT // 2
WINDOW_FRAMES = N_FRAMES + 2


def mel_windows(blocks: Iterable[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The 16 kHz float32 audio of `blocks` (in order, any sizes) as 30 s windows:
    `(samples, x)` per window, `samples` its own N_SAMPLES (fewer in the last one),
    `x` the WINDOW_BEFORE + N_SAMPLES + WINDOW_AFTER samples its frames read, reflected
    at the start of the audio and zero past its end as in `log_mel_spectrogram(audio,
    padding=N_SAMPLES)`: `window_log10_mel(x)` is that spectrogram's frames
    3000 k ... 3000 k + 3001 (before its clamp). Holds about one window at a time."""
    need = N_SAMPLES + WINDOW_AFTER
    pieces: list[np.ndarray] = []
    have = 0
    head: np.ndarray | None = None  # the WINDOW_BEFORE samples before this window
    source = iter(blocks)
    ended = False
    while True:
        while have < need and not ended:
            block = next(source, None)
            if block is None:
                ended = True
            elif len(block):
                pieces.append(np.asarray(block, dtype=np.float32))
                have += len(block)
        if not have:
            return
        buf = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        ahead = buf[:need]
        if len(ahead) < need:
            ahead = np.concatenate([ahead, np.zeros(need - len(ahead), np.float32)])
        if head is None:  # centred frames at the start: reflected, as np.pad does
            x = np.pad(ahead, (WINDOW_BEFORE, 0), mode="reflect")
        else:
            x = np.concatenate([head, ahead])
        yield buf[:N_SAMPLES], x
        head = buf[N_SAMPLES - WINDOW_BEFORE : N_SAMPLES].copy()
        rest = buf[N_SAMPLES:]
        pieces, have = ([rest], len(rest)) if len(rest) else ([], 0)


def window_log10_mel(x: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """log10 mel power (floored at 1e-10) of a window's WINDOW_FRAMES frames, from its
    samples `x` (`mel_windows`): (n_mels, WINDOW_FRAMES) float64, computed as
    `log_mel_spectrogram` computes the same frames."""
    x = np.asarray(x, dtype=np.float32)
    frames = np.lib.stride_tricks.as_strided(
        x, shape=(WINDOW_FRAMES, N_FFT), strides=(x.strides[0] * HOP_LENGTH, x.strides[0]))
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)
    spectrum = np.fft.rfft(frames * window, axis=-1)  # (WINDOW_FRAMES, 201)
    power = spectrum.real ** 2 + spectrum.imag ** 2
    mel = filters.astype(np.float64) @ power.T  # (n_mels, WINDOW_FRAMES)
    return np.log10(np.maximum(mel, 1e-10))


def window_log10_mel_max(x: np.ndarray, filters: np.ndarray, floor: float) -> float:
    """max(floor, the largest value of `window_log10_mel(x)`), skipping the transform
    when the loudest sample shows that no frame exceeds `floor` (quiet audio): a mel
    bin is at most max(filters) * the sum of the power spectrum, which is at most
    N_FFT * the frame's energy (Parseval; the Hann window is <= 1), at most
    N_FFT * N_FFT * the largest squared sample."""
    x = np.asarray(x, dtype=np.float32)
    peak = max(float(x.max(initial=0.0)), -float(x.min(initial=0.0)))
    bound = max(float(filters.max()), 0.0) * N_FFT * N_FFT * peak * peak
    if bound * 1.01 < 10.0 ** floor / 1.01:  # margins far above float32 rounding
        return floor
    return max(floor, float(window_log10_mel(x, filters).max()))


def scale_log_mel(log_spec: np.ndarray, log_max: float) -> np.ndarray:
    """Whisper's last steps on log10 mel power: floored at `log_max` - 8 (`log_max` the
    largest value over the whole spectrogram), then (x + 4) / 4, as float32."""
    return ((np.maximum(log_spec, log_max - 8.0) + 4.0) / 4.0).astype(np.float32)
