"""The command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workbench import registry
from workbench.cli import main


@pytest.mark.parametrize("command", [[], ["pull"], ["list"], ["chat"], ["generate"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main(command + ["--help"])
    assert exc.value.code == 0
    assert "usage: workbench" in capsys.readouterr().out


def test_list_shows_aliases(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "(default)" in out and "qwen2.5-coder-0.5b" in out


def test_bad_model_is_a_clean_error(capsys):
    assert main(["generate", "-m", "/no/such/model.gguf", "hi"]) == 1
    assert "no model file or alias" in capsys.readouterr().err


@pytest.mark.slow
def test_one_shot_chat_answers(capsys):
    assert main(["chat", "--temperature", "0", "What is the capital of France?"]) == 0
    assert capsys.readouterr().out == "The capital of France is Paris.\n"


@pytest.mark.slow
def test_generate_streams_a_completion(capsys):
    assert main(["generate", "-t", "0", "-n", "3", "The capital of France is"]) == 0
    # three tokens " Paris", ".", "\n", then the newline the CLI ends its output with
    assert capsys.readouterr().out == " Paris.\n\n"


def test_bench_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: workbench bench" in out and "pip install llama-cpp-python" in out


def test_bench_explains_how_to_get_llama_cpp(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    assert main(["bench"]) == 1
    assert "pip install llama-cpp-python" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_peak_memory_while_generating(alias):
    """Peak RSS of a process that loads the model, prefills 512 tokens and decodes 32
    stays within 1.5x the GGUF file plus 300 MB (weights stay in their file format).
    Measured with the kernels already in Numba's disk cache, as on every run but the
    first after an install."""
    from workbench import LLM

    path = registry.pull(alias)
    with LLM.load(path, kv_cache_size=600) as warm:  # compile and cache the kernels first:
        warm.generate("word " * 520, max_tokens=2, temperature=0).wait()  # not in the child
    out = subprocess.run([sys.executable, "-m", "workbench.bench", "--rss-child", "workbench",
                          "--model", str(path), "--prompt-tokens", "512",
                          "--decode-tokens", "32"], check=True, capture_output=True, text=True)
    peak_mb = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    budget_mb = 1.5 * path.stat().st_size / 1e6 + 300
    assert 0 < peak_mb <= budget_mb, f"peak RSS {peak_mb:.0f} MB, budget {budget_mb:.0f} MB"
