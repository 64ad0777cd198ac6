"""Stored peer outputs ("goldens"): what the peers (transformers, llama.cpp, CTranslate2,
whisper.cpp, sentence-transformers) answered on fixed inputs, kept in the repository so
that the test gate compares our engine against them without installing or running them.

A golden is a folder `tests/goldens/data/<name>/`:
- `meta.json`: the peer's name and version (`peer`), the inputs it was given (`inputs`:
  prompts, seeds, options) and its JSON-shaped outputs (`outputs`: token ids, texts,
  transcripts, server answers);
- `<key>.npy`: its array outputs (logits at the compared positions, hidden states,
  vectors), one file per key;
- any other input file the peer read (the tiny GGUF files the tiny-model tests build).

Every file is written byte for byte the same from the same peer outputs, so regenerating
a golden and finding `git diff` empty shows the stored outputs are the peer's.

Each golden has one producer: a function in a `tests/goldens/make_*.py` module, listed in
that module's `GOLDENS` dict, which runs the live peers and returns a `Golden`. Producers
import the peers (torch, transformers, ctranslate2, pywhispercpp, llama-cpp-python:
the `[peers]` extra); the test modules import only this module.

    python -m tests.goldens               # regenerate every golden from the live peers
    python -m tests.goldens NAME ...      # only these (a prefix picks a family)
    python -m pytest -m peers             # the live peers still equal the stored goldens
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).resolve().parent / "data"


@dataclass
class Golden:
    """One peer's outputs on fixed inputs. `files` maps a file name to its bytes (inputs
    such as a tiny GGUF the peer's model was written to); once stored or loaded, `folder`
    holds them and `file(name)` gives their path."""

    peer: dict
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    folder: Path | None = None

    def file(self, name: str) -> Path:
        """The path of a stored input file of this golden."""
        assert self.folder is not None, "a golden not yet stored has no files on disk"
        path = self.folder / name
        if not path.is_file():
            pytest.fail(f"golden {self.folder.name} has no file {name}: regenerate it with "
                        f"`python -m tests.goldens {self.folder.name}` (needs the [peers] extra)")
        return path


def load(name: str) -> Golden:
    """The stored golden `name`; a missing one fails the test with the command that makes
    it (never a skip)."""
    folder = DATA / name
    meta = folder / "meta.json"
    if not meta.is_file():
        pytest.fail(f"the golden {name!r} is missing ({meta}): make it from the live peers with "
                    f"`pip install -e '.[peers]' && python -m tests.goldens {name}`")
    doc = json.loads(meta.read_text(encoding="utf-8"))
    arrays = {p.stem: np.load(p, allow_pickle=False) for p in sorted(folder.glob("*.npy"))}
    files = {p.name: b"" for p in folder.iterdir()
             if p.name != "meta.json" and p.suffix != ".npy"}
    return Golden(peer=doc["peer"], inputs=doc.get("inputs", {}), outputs=doc.get("outputs", {}),
                  arrays=arrays, files=files, folder=folder)


def save(name: str, golden: Golden, root: Path = DATA) -> Path:
    """Write `golden` as `root/name/` (replacing what was there); returns the folder."""
    folder = root / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    doc = {"peer": golden.peer, "inputs": golden.inputs, "outputs": golden.outputs}
    (folder / "meta.json").write_text(json.dumps(doc, indent=1, sort_keys=True,
                                                 ensure_ascii=False) + "\n",
                                   encoding="utf-8")
    for key, array in golden.arrays.items():
        np.save(folder / f"{key}.npy", np.ascontiguousarray(array), allow_pickle=False)
    for file_name, data in golden.files.items():
        (folder / file_name).write_bytes(data)
    golden.folder = folder
    return folder


def peer_versions(*distributions: str) -> dict:
    """`{"name": ..., "version": ...}`-style records of the installed peer distributions:
    {distribution: version}."""
    from importlib.metadata import version

    return {d: version(d) for d in distributions}


def digest(path: Path) -> str:
    """sha256 of a file, to tie a golden to the exact input file it was made from."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
