"""The command line."""

from __future__ import annotations

import pytest

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
