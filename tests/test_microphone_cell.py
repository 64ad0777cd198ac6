"""MicrophoneCell driven from Python as the browser drives it: encoded audio bytes in a
custom message, decoded with PyAV and transcribed by the real tiny.en model."""

from __future__ import annotations

import io

import numpy as np
import pytest

from tests.support.shared import shared_file
from tests.support.speech import JFK, jfk_pcm, wer
from workbench.widgets import MicrophoneCell


def encode(pcm: np.ndarray, container: str, codec: str, rate: int = 48000) -> bytes:
    """Encode 16 kHz mono samples as a browser's MediaRecorder would send them."""
    import av
    import soxr

    samples = soxr.resample(pcm, 16000, rate).astype(np.float32)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        for start in range(0, len(samples), 960):
            frame = av.AudioFrame.from_ndarray(samples[None, start : start + 960], format="flt",
                                               layout="mono")
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def tiny_en():
    from workbench import WhisperModel

    with WhisperModel.load("whisper-tiny.en") as w:
        yield w


@pytest.mark.slow
@pytest.mark.parametrize("container,codec", [("webm", "libopus"), ("ogg", "libopus"),
                                             ("mp4", "aac")])
def test_recorded_clip_is_transcribed(tiny_en, container, codec):
    data = encode(jfk_pcm(), container, codec)
    assert data[:4] in (b"\x1aE\xdf\xa3", b"OggS") or data[4:8] == b"ftyp"
    cell = MicrophoneCell(tiny_en)
    # exactly what the browser sends: {type: "audio", mime, name} with one binary buffer
    cell._handle_custom_msg({"type": "audio", "mime": f"audio/{container}",
                             "name": "recording"}, [memoryview(data)])
    assert cell.wait(timeout=120)
    assert cell.error == ""
    assert wer(cell.text, JFK) == 0, cell.text
    assert cell.segments and cell.segments[0]["start"] <= 1.0
    assert cell.segments[-1]["end"] <= 11.5
    assert "11.0 s of audio" in cell.status or "10.9 s of audio" in cell.status, cell.status
    assert cell.busy is False
    cell.close()


@pytest.mark.slow
def test_uploaded_wav_and_bad_bytes(tiny_en):
    cell = MicrophoneCell(tiny_en, timestamps=False)
    cell.transcribe_bytes(shared_file("data", "whisper", "jfk.wav").read_bytes(), "jfk.wav")
    cell.wait(timeout=120)
    assert wer(cell.text, JFK) == 0 and len(cell.segments) == 1
    cell.transcribe_bytes(b"this is not audio", "notes.txt")
    cell.wait(timeout=60)
    assert "AudioError" in cell.error and cell.status == ""
    cell._handle_custom_msg({"type": "audio"}, [])
    assert "no audio" in cell.error
    cell.close()


def test_refuses_what_cannot_transcribe():
    with pytest.raises(TypeError, match="cannot transcribe"):
        MicrophoneCell(object())
