"""Jupyter widgets for workbench models (anywidget + ipywidgets, no network needed).

- `BusyBadge`, `DeviceBadge`, `MemoryBadge`: badges following a model's `busy` /
  `device` signals and its KV-cache memory.
- `ChatCell`: a chat with a model, streaming on a worker thread.
- `TokenView`, `LogitsCell`: tokens coloured by probability, alternatives, branching.
- `LensCell`: the logit lens (layers x tokens) and attention views of one prompt.
- `JSONCell`: schema- or grammar-constrained generation shown as a JSON tree.
- `SimilarityCell`: sentence embeddings as a similarity heatmap, with search.
- `MicrophoneCell`: record or upload audio, transcribed by Whisper with segment times.
- `ServeCell`: start and stop the OpenAI-compatible server, with live request counts.
"""

from __future__ import annotations

from workbench.widgets.badges import BusyBadge, DeviceBadge, MemoryBadge
from workbench.widgets.chat import ChatCell, render_markdown
from workbench.widgets.json_cell import JSONCell
from workbench.widgets.lens import LensCell
from workbench.widgets.logits import LogitsCell, TokenView
from workbench.widgets.microphone import MicrophoneCell
from workbench.widgets.serve import ServeCell
from workbench.widgets.similarity import SimilarityCell

__all__ = ["BusyBadge", "ChatCell", "DeviceBadge", "JSONCell", "LensCell", "LogitsCell",
           "MemoryBadge", "MicrophoneCell", "ServeCell", "SimilarityCell", "TokenView",
           "render_markdown"]
