"""The golden `remote-llama-cpp-server`: what llama-cpp-python's server
(`llama_cpp.server`) answered to the requests of tests/test_remote.py's ChatCell and
SimilarityCell tests, on the SmolLM2 and MiniLM GGUF files.

The producer starts the server on the two files as the test's fixture did before the
golden, puts the recording proxy of tests/support/replay_server.py in front of it, and
drives the same cells with the same calls as the tests, so the recorded requests are
the cells' own. One setting differs from the server's defaults: llama.cpp's "extra
buffer types" (weights repacked for the CPU's AMX or AVX kernels; `--no-repack` in
llama.cpp's own tools) are off, because its AMX kernels crash on Q4_1 weights
(llama.cpp issues #16315 and #20824; here a segfault in ggml_backend_amx_mul_mat on the
first prompt, on this machine's AMX Xeon), and so that no CPU-specific repacked kernel
takes part in the answers.

Each response body is kept as the server sent it (a stream event by event), except what
changes from run to run, set to fixed values: a completion's "id" (a random
"chatcmpl-<uuid>") becomes "chatcmpl-recorded" and its "created" timestamp 0, and
sse-starlette's keep-alive comments (": ping - <time>", sent only when a stream stalls
for 15 s) are dropped.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.goldens import Golden, digest, peer_versions
from tests.support.replay_server import Exchange, ReplayServer, serving, to_records

CHAT_MODEL, EMBED_MODEL = "smollm2-135m", "minilm-l6"
# the server's settings per model (llama_cpp.server.settings.ModelSettings)
SETTINGS = {CHAT_MODEL: {"n_ctx": 2048, "n_threads": 2},
            EMBED_MODEL: {"embedding": True, "n_threads": 2}}
# llama.cpp's model parameters beyond the server's settings (llama_model_params)
MODEL_PARAMS = {"use_extra_bufts": False}

_ID = re.compile(rb'("id": ?")((?:chat)?cmpl)-[^"]*"')
_CREATED = re.compile(rb'("created": ?)\d+')


def make_llama_cpp_server() -> Golden:
    """Record llama_cpp.server's answers to the cells' requests (a few minutes on 2 cores)."""
    from workbench.engine.formats import sources

    paths = {alias: sources.resolve(alias) for alias in SETTINGS}
    with _live_server(paths) as live, ReplayServer([], upstream=live) as proxy:
        _drive_chat_cell(proxy.base_url + "/v1")
        _drive_similarity_cell(proxy.base_url + "/v1")
    records, files = to_records([_normalized(ex) for ex in proxy.exchanges])
    return Golden(
        peer=peer_versions("llama-cpp-python", "sse-starlette"),
        inputs={"models": {alias: {"file": path.name, "sha256": digest(path),
                                   "settings": SETTINGS[alias]}
                           for alias, path in paths.items()},
                "llama_model_params": MODEL_PARAMS},
        outputs={"exchanges": records}, files=files)


GOLDENS = {"remote-llama-cpp-server": make_llama_cpp_server}


@contextmanager
def _live_server(paths: dict[str, Path]) -> Iterator[str]:
    """llama_cpp.server on the model files, on a loopback port of its own; its root URL.
    (The server loads a model when a request first names it: the patch holds until the
    server stops.)"""
    from unittest import mock

    import llama_cpp
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def model_params():
        params = defaults()
        params.use_extra_bufts = MODEL_PARAMS["use_extra_bufts"]
        return params

    models = [ModelSettings(model=str(path), model_alias=alias, verbose=False,
                            **SETTINGS[alias]) for alias, path in paths.items()]
    with mock.patch.object(llama_cpp.llama_cpp, "llama_model_default_params", model_params):
        app = create_app(server_settings=ServerSettings(), model_settings=models)
        with serving(app, name="llama_cpp.server") as url:
            yield url


def _drive_chat_cell(base_url: str) -> None:
    """test_chat_cell_over_a_remote_engine's requests: a ChatCell's answer, the same
    question asked directly with the openai client, a long answer stopped mid-stream and
    a regenerated one."""
    import openai

    from tests.test_remote import QUESTION, STORY
    from workbench import RemoteEngine
    from workbench.widgets import ChatCell

    with RemoteEngine(base_url, CHAT_MODEL) as remote:
        cell = ChatCell(remote, temperature=0, max_tokens=24, repeat_penalty=1.0)
        cell.send(QUESTION)
        assert cell.wait(timeout=120) and cell.error == "", cell.error
        with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
            client.chat.completions.create(
                model=CHAT_MODEL, messages=cell.messages[:2], temperature=0, top_p=0.95,
                max_tokens=24, extra_body={"repeat_penalty": 1.0})
        cell.max_tokens = 300
        cell.send(STORY)
        while cell.generating and not cell.log[-1].get("streaming"):
            time.sleep(0.01)  # the proxy answers once the whole story is recorded
        cell.stop()
        assert cell.wait(timeout=120)
        cell.max_tokens = 24
        cell.regenerate()
        assert cell.wait(timeout=120) and cell.error == "", cell.error
        cell.close()


def _drive_similarity_cell(base_url: str) -> None:
    """test_similarity_cell_over_a_remote_engine's requests: the sentences embedded."""
    from tests.test_remote import SENTENCES
    from workbench import RemoteEngine
    from workbench.widgets import SimilarityCell

    with RemoteEngine(base_url, EMBED_MODEL) as remote:
        cell = SimilarityCell(remote, SENTENCES)
        assert cell.wait(timeout=120)
        cell.close()


def _normalized(exchange: Exchange) -> Exchange:
    """The exchange with its run-to-run fields fixed and keep-alive comments dropped."""
    chunks = []
    for chunk in exchange.chunks:
        if exchange.streamed and all(line.startswith(b":") for line in chunk.splitlines()
                                     if line.strip()):
            continue  # ": ping - 2025-01-01 00:00:00.000000+00:00"
        chunk = _ID.sub(rb'\1\2-recorded"', chunk)
        chunks.append(_CREATED.sub(rb"\g<1>0", chunk))
    return Exchange(exchange.method, exchange.path, exchange.body, exchange.status,
                    exchange.content_type, tuple(chunks))
