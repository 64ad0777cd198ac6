"""The command line."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from workbench import lab, registry
from workbench.cli import main
from workbench.engine.formats import sources


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


def test_pull_all_pulls_every_registered_model(monkeypatch, capsys):
    pulled = []
    monkeypatch.setattr(sources, "pull", lambda alias, force=False: pulled.append(alias)
                        or Path(f"/models/{alias}"))
    assert main(["pull", "--all", "--no-kernels"]) == 0
    assert pulled == list(registry.MODELS)
    assert f"whisper-base: {Path('/models/whisper-base')}" in capsys.readouterr().out
    assert main(["pull", "gemma3-270m", "--all"]) == 1
    assert "either aliases or --all" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_in_the_foreground_until_ctrl_c(smollm2):
    """`workbench serve` serves a chat model (here with `--draft ngram`: speculative, the
    same greedy answer) and an encoder under their aliases, answers the openai client like
    the engine, and stops cleanly on SIGINT."""
    import signal
    import socket
    import time

    import httpx
    import openai

    with socket.socket() as s:  # a free port (the CLI binds it itself)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "serve", "smollm2-135m",
                             "minilm-l6", "--port", str(port), "--api-key", "k",
                             "--draft", "ngram", "--draft-tokens", "3"],
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
    assert "smollm2-135m decodes with the draft ngram" in err


# -- workbench lab -------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (Linux's /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _exists(pid: int) -> bool:
    """Whether `pid` is still in the process table (a zombie is)."""
    return Path(f"/proc/{pid}").exists()


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def test_lab_command_encrypts_kernels_and_logs_warnings_only(tmp_path):
    cmd = lab.lab_command(tmp_path, "00_tour.ipynb")
    assert "--ServerApp.log_level=WARN" in cmd and "--LabApp.log_level=WARN" in cmd
    # CurveZMQ keys from the kernel manager: ipykernel then has no plain TCP to warn about
    assert "--MappingKernelManager.transport_encryption=auto" in cmd
    assert not any("token" in arg.lower() for arg in cmd)  # `ps` would show it


def test_lab_environment_turns_the_news_off_by_default(tmp_path, monkeypatch):
    from jupyterlab_server.settings_utils import _get_overrides

    monkeypatch.setenv("JUPYTER_CONFIG_PATH", "/somewhere/of/the/users")
    monkeypatch.delenv("JUPYTER_TOKEN", raising=False)
    env = lab.lab_environment(tmp_path / "config", "abc123")
    assert env["JUPYTER_TOKEN"] == "abc123"
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [str(tmp_path / "config"),
                                                             "/somewhere/of/the/users"]
    # what JupyterLab's settings handler takes as defaults, in that environment
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", env["JUPYTER_CONFIG_PATH"])
    overrides, error = _get_overrides(str(tmp_path / "no-app-settings"))
    assert not error
    assert overrides[lab.NOTIFICATION_PLUGIN] == {"fetchNews": "false", "checkForUpdates": False}


def test_lab_keeps_the_users_own_token(tmp_path):
    env = lab.lab_environment(tmp_path, "ours", base={"JUPYTER_TOKEN": "theirs"})
    assert env["JUPYTER_TOKEN"] == "theirs" and env["JUPYTER_CONFIG_PATH"] == str(tmp_path)


def test_lab_prints_one_url_with_the_token():
    info = {"url": "http://localhost:8890/", "token": "abc", "port": 8890}
    assert lab.server_url(info, "00_tour.ipynb") == \
        "http://localhost:8890/lab/tree/00_tour.ipynb?token=abc"
    assert lab.server_url({**info, "token": ""}, "01_chat.ipynb") == \
        "http://localhost:8890/lab/tree/01_chat.ipynb"


@needs_proc
def test_lab_helper_echoes_its_lines_and_is_reaped():
    lines = []
    helper = lab.Helper([sys.executable, "-c", "print('one'); print(); print('two')"],
                        lines.append, prefix="kernels: ")
    helper._thread.join(30)
    assert lines == ["kernels: one", "kernels: two"]
    assert helper.proc.returncode == 0 and not _exists(helper.proc.pid)  # no zombie left
    assert helper.stop() == 0


@needs_proc
def test_lab_helper_stops_with_the_processes_it_started():
    lines = []
    child = ("import subprocess, sys, time; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             "print(p.pid, flush=True); time.sleep(60)")
    helper = lab.Helper([sys.executable, "-c", child], lines.append)
    deadline = time.monotonic() + 30
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(lines[0])
    assert _alive(grandchild)
    assert helper.stop() == -signal.SIGTERM
    assert not _exists(helper.proc.pid)
    deadline = time.monotonic() + 10  # reaped by init once its parent is gone
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _fake_engine(seconds: list[float]):
    from workbench.engine.runtime.warmup import KernelTask, KernelWarmup
    from workbench.signals import Signal

    warming = Signal(None)
    tasks = [KernelTask(f"step {i}", lambda s=s: time.sleep(s)) for i, s in enumerate(seconds)]
    return SimpleNamespace(warming=warming, warmup=KernelWarmup(tasks, warming).start())


def test_lab_kernel_progress_is_a_line_per_step(monkeypatch, capsys):
    monkeypatch.setattr("workbench.engine.load_engine", lambda alias: _fake_engine([1.4, 1.4]))
    lab.prepare_kernels("smollm2-135m")
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["kernels: compiling 0/2: step 0", "kernels: compiling 1/2: step 1"]
    assert len(lines) == 3 and re.fullmatch(r"kernels ready in \d+ s", lines[2]), lines


def test_lab_kernel_progress_from_a_warm_cache_is_silent(monkeypatch, capsys):
    monkeypatch.setattr("workbench.engine.load_engine", lambda alias: _fake_engine([0.01] * 6))
    lab.prepare_kernels("smollm2-135m")
    assert capsys.readouterr().out == ""


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@needs_proc
@pytest.mark.slow
def test_lab_terminal_shows_one_url_and_encrypted_kernels(tmp_path):
    """`workbench lab` as from a terminal: one URL on stdout; a kernel started and run
    through it warns of nothing; Ctrl-C ends JupyterLab and the kernels' helper."""
    import asyncio
    import urllib.request
    import uuid

    from tornado.websocket import websocket_connect

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("config", "data", "runtime", "settings", "workspaces"):
        (tmp_path / name).mkdir()
    env.update(JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_DATA_DIR=str(tmp_path / "data"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    env.pop("JUPYTER_TOKEN", None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = tmp_path / "stderr.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "workbench.cli", "lab", "--no-browser", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=open(err, "w"), text=True, env=env,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        match = re.fullmatch(rf"JupyterLab is at (http://\S+:{port})/lab/tree/00_tour\.ipynb"
                             r"\?token=(\w+)\n", line)
        assert match, (line, err.read_text())
        base, token = match.groups()
        req = urllib.request.Request(f"{base}/api/kernels", data=b'{"name": "python3"}',
                                     headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            kernel = json.loads(r.read())["id"]

        async def run_code() -> str:
            ws = await websocket_connect(f"ws{base[4:]}/api/kernels/{kernel}/channels"
                                         f"?token={token}&session_id={uuid.uuid4().hex}")
            msg_id = uuid.uuid4().hex
            ws.write_message(json.dumps({
                "header": {"msg_id": msg_id, "msg_type": "execute_request", "version": "5.3",
                           "session": uuid.uuid4().hex, "username": "test"},
                "parent_header": {}, "metadata": {}, "channel": "shell",
                "content": {"code": "6 * 7", "silent": False}}))
            while True:
                msg = json.loads(await asyncio.wait_for(ws.read_message(), 60))
                if (msg["parent_header"].get("msg_id") == msg_id
                        and msg["msg_type"] == "execute_result"):
                    ws.close()
                    return msg["content"]["data"]["text/plain"]

        assert asyncio.run(run_code()) == "42"
        helpers = [pid for pid in _children(proc.pid) if _alive(pid)]
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal
        assert proc.wait(timeout=60) == 0, err.read_text()
        assert proc.stdout.read() == ""  # the one URL was all
        log = err.read_text()
        assert "without encryption" not in log and "http" not in log, log
        assert not [pid for pid in helpers if _alive(pid)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
