"""The sizes every transformer configuration here starts with.

`LlamaConfig` (decoders) and `BertConfig` (encoders) extend `TransformerSizes` with
their families' own settings; each reads the values from its `{arch}.*` metadata.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransformerSizes:
    """The architecture name, the depth and the widths of a transformer."""

    arch: str  # `general.architecture`
    n_layer: int
    n_embd: int  # model width
    n_ff: int  # feed-forward width
    n_head: int  # attention (query) heads
