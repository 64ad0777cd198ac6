"""The command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workbench.cli import main
from workbench.engine import sources


@pytest.mark.parametrize("command", [[], ["pull"], ["list"], ["chat"], ["generate"], ["serve"]])
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
def test_a_conversation_past_the_context_keeps_the_session(capsys, monkeypatch):
    """Interactive chat: a turn that no longer fits the context is reported (naming --ctx)
    and dropped; the session goes on, and /reset makes room again."""
    lines = ["Hello there, how are you?", "Tell me more about yourself please " * 10,
             "/reset", "Hi"]

    def typed(prompt: str = "") -> str:
        if not lines:
            raise EOFError  # Ctrl-D
        return lines.pop(0)

    monkeypatch.setattr("builtins.input", typed)
    assert main(["chat", "-t", "0", "-n", "8", "--ctx", "80"]) == 0
    out, err = capsys.readouterr()
    assert "the context holds 80" in err and "(on the command line: --ctx); /reset" in err
    assert len([a for a in out.split("\n") if a.strip()]) == 2  # the first and last turn


def test_os_errors_are_one_line(capsys, tmp_path):
    """A directory where a file goes, a port out of range: one line, no traceback."""
    assert main(["batch", "-i", str(tmp_path), "-o", str(tmp_path / "out.jsonl")]) == 1
    assert main(["serve", "--port", "99999", "smollm2-135m"]) == 1
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith(("workbench: serving", "preparing kernels"))]
    assert len(err) == 2 and all(line.startswith("workbench: error: ") for line in err), err
    assert "port must be in 0..65535" in err[1]


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
    import numba

    pool = numba.config.NUMBA_NUM_THREADS
    assert main(["bench", "--threads", str(pool + 1)]) == 1
    assert "pip install llama-cpp-python" in capsys.readouterr().err
    # this process's Numba pool has started: `bench` leaves its size alone (a variable
    # that differs from it makes Numba's next compile fail)
    numba.njit(lambda v: v + 1)(1)
    assert numba.config.NUMBA_NUM_THREADS == pool


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_peak_memory_while_generating(alias):
    """Peak RSS of a process that loads the model, prefills 512 tokens and decodes 32
    stays within 1.5x the GGUF file plus 300 MB (weights stay in their file format).
    Measured with the kernels already in Numba's disk cache, as on every run but the
    first after an install."""
    from workbench import LLM

    path = sources.pull(alias)
    with LLM.load(path, kv_cache_size=600) as warm:  # compile and cache the kernels first:
        warm.generate("word " * 520, max_tokens=2, temperature=0).wait()  # not in the child
    out = subprocess.run([sys.executable, "-m", "workbench.bench", "--rss-child", "workbench",
                          "--model", str(path), "--prompt-tokens", "512",
                          "--decode-tokens", "32"], check=True, capture_output=True, text=True)
    peak_mb = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    budget_mb = 1.5 * path.stat().st_size / 1e6 + 300
    assert 0 < peak_mb <= budget_mb, f"peak RSS {peak_mb:.0f} MB, budget {budget_mb:.0f} MB"


@pytest.mark.slow
def test_serve_in_the_foreground_until_ctrl_c(smollm2):
    """`workbench serve` serves a chat model and an encoder under their aliases, answers the
    openai client like the engine, and stops cleanly on SIGINT."""
    import signal
    import socket
    import time

    import httpx
    import openai

    with socket.socket() as s:  # a free port (the CLI binds it itself)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "serve", "smollm2-135m",
                             "minilm-l6", "--port", str(port), "--api-key", "k"],
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list()] == ["smollm2-135m", "minilm-l6"]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model="smollm2-135m", messages=messages,
                                           temperature=0, max_tokens=16)
        assert r.choices[0].message.content == smollm2.chat(messages, temperature=0,
                                                            max_tokens=16).text
        assert len(client.embeddings.create(model="minilm-l6", input="hi").data[0]
                   .embedding) == 384
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err, err  # 130: ended by SIGINT
    assert f"serving smollm2-135m, minilm-l6 at http://127.0.0.1:{port}/v1" in err
