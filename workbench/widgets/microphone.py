"""`MicrophoneCell`: record in the browser (or pick a file) and transcribe it with Whisper.

    cell = MicrophoneCell(whisper)             # Record / Stop with a level meter, file upload
    cell                                       # ... speak, press Stop ...
    cell.text, cell.segments                   # the transcript, and its timed segments
    cell.transcribe_bytes(open("a.webm", "rb").read())   # what a recording does, from Python

The browser records with MediaRecorder (WebM/Opus in Chromium, Ogg or MP4 elsewhere)
and sends the encoded bytes as a binary buffer; `whisper.transcribe` decodes them
(`workbench.engine.audio.pcm`: libsndfile or PyAV, 30 s at a time) and transcribes them
on a worker thread, so the kernel stays responsive. The model's `busy` signal drives
the cell's state.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from workbench.signals import bind
from workbench.widgets.worker import Worker

STATIC = Path(__file__).parent / "static"


class MicrophoneCell(Worker, anywidget.AnyWidget):
    """Record or upload audio in the notebook and show its transcript with segment times.

    Synced traits: `text`, `segments` (dicts with `start`, `end`, `text`), `status`,
    `error`, `busy`. Options (`language`, `beam_size`, `timestamps`, `task`) go to
    `whisper.transcribe`.
    """

    _esm = STATIC / "microphone.js"
    _css = STATIC / "widgets.css"

    text = traitlets.Unicode("").tag(sync=True)
    segments = traitlets.List(traitlets.Dict()).tag(sync=True)
    status = traitlets.Unicode("").tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)
    busy = traitlets.Bool(False).tag(sync=True)

    def __init__(self, whisper: Any, *, language: str | None = "en", beam_size: int = 1,
                 timestamps: bool = True, task: str = "transcribe", **kwargs: Any):
        if not hasattr(whisper, "transcribe"):
            raise TypeError(f"{type(whisper).__name__} cannot transcribe audio")
        super().__init__(**kwargs)
        self.whisper = whisper
        self.options = dict(language=language, beam_size=beam_size, timestamps=timestamps,
                            task=task)
        self.transcript = None  # the last `Transcript`
        self._unbind = bind(whisper.busy, self, "busy", direction="to_widget")
        self.on_msg(self._on_frontend_msg)

    def transcribe_bytes(self, data: bytes, name: str = "recording") -> threading.Thread:
        """Decode and transcribe encoded audio (as the browser sends it) on a worker thread."""
        self.wait()
        self.error = ""
        self.status = f"transcribing {name} ({len(data) / 1024:.0f} KiB) ..."
        self._thread = threading.Thread(target=self._run, args=(bytes(data), name),
                                        name="workbench-transcribe", daemon=True)
        self._thread.start()
        return self._thread

    def close(self) -> None:
        """Wait for the worker, unbind the busy signal and close the widget."""
        self.wait()
        if getattr(self, "_unbind", None) is not None:
            self._unbind()
            self._unbind = None
        super().close()

    def _run(self, data: bytes, name: str) -> None:
        try:
            start = time.perf_counter()
            transcript = self.whisper.transcribe(data, **self.options)
            seconds = time.perf_counter() - start
            self.transcript = transcript
            self.segments = [{"start": round(s.start, 2), "end": round(s.end, 2),
                              "text": s.text} for s in transcript.segments]
            self.text = str(transcript)
            duration = getattr(transcript, "duration", 0.0)  # a remote engine may not say
            audio = f"{duration:.1f} s of audio" if duration else "audio"
            self.status = (f"{name}: {audio} transcribed in {seconds:.2f} s "
                           f"({transcript.language})")
        except Exception as exc:  # shown in the cell, never raised in the kernel
            self.error = f"{type(exc).__name__}: {exc}"
            self.status = ""

    def _on_frontend_msg(self, widget: Any, content: Any, buffers: Any) -> None:
        """{"type": "audio", "mime": ..., "name": ...} with the encoded audio as a buffer."""
        if not isinstance(content, dict) or content.get("type") != "audio":
            return
        if not buffers:
            self.error = "no audio arrived with the message"
            return
        self.transcribe_bytes(bytes(buffers[0]), str(content.get("name") or "recording"))
