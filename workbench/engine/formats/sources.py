"""Model sources as the engines load them: the registry's files (`workbench.registry`),
with the checkpoint folders it lists converted by the engine's converters.

The registry names a converter ("bert", "ctranslate2-whisper") and leaves running it
to this layer, so that it never imports the engine.
"""

from __future__ import annotations

import os
from pathlib import Path

from workbench import registry
from workbench.registry import PullError, RegisteredModel


def convert_checkpoint(entry: RegisteredModel, folder: Path, target: Path) -> Path:
    """Make `entry`'s model file at `target` from its checkpoint `folder`."""
    from workbench.engine.formats import convert  # imported only when a pull converts

    if entry.convert == "bert":
        return convert.hf_bert_to_gguf(folder, target, dtype="f32",
                                       name=Path(entry.filename).stem)
    if entry.convert == "ctranslate2-whisper":
        return convert.ct2_whisper_to_bin(folder, target)
    raise PullError(f"{entry.alias}: unknown converter {entry.convert!r}")


def resolve(source: str | os.PathLike) -> Path:
    """`registry.resolve`, converting checkpoints: an alias, a path or an `hf://` source
    as a local file (aliases pulled on first use)."""
    return registry.resolve(source, convert=convert_checkpoint)


def pull(alias: str, *, force: bool = False, progress: bool = True) -> Path:
    """`registry.pull`, converting checkpoints: download (and make) `alias`'s file."""
    return registry.pull(alias, force=force, progress=progress, convert=convert_checkpoint)

