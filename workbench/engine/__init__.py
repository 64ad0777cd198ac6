"""The engines that run models here: `LLM` (`llm.py`), `Encoder` (`encoder.py`) and
`WhisperModel` (`whisper.py`), and what they are made of (docs/architecture.md).
`load_engine` picks the one a model file calls for; every import stays inside it, so
importing this package loads nothing heavy."""

from __future__ import annotations


def load_engine(source: str, *, ctx: int = 4096, max_batch: int | None = None):
    """The engine a model file calls for: `WhisperModel` for a whisper.cpp .bin, `Encoder`
    for a BERT GGUF, `LLM` for a decoder GGUF (decoding `max_batch` generations together;
    default: the LLM's)."""
    from workbench.engine.formats import sources

    path = sources.resolve(source)
    if path.suffix == ".bin":
        from workbench.engine.whisper import WhisperModel

        return WhisperModel.load(path)
    from workbench.engine.formats.gguf import open_gguf

    g = open_gguf(path)
    if g.architecture == "bert":
        from workbench.engine.encoder import Encoder

        return Encoder(g)
    from workbench.engine.llm import LLM

    return LLM(g, kv_cache_size=ctx, **({} if max_batch is None else {"max_batch": max_batch}))
