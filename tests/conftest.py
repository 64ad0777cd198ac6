"""Shared fixtures: the real models, each loaded once per session (helpers and builders
that several modules use live in tests/support/)."""

from __future__ import annotations

import gc
import os
import sys
import time

import pytest

# The peers the goldens were made from (tests/goldens). `WORKBENCH_BLOCK_PEERS=1` makes
# importing them fail even where they are installed, to check that the gate runs without
# them (as `.ci/run`'s environment, which never installs them, does).
PEER_MODULES = ("torch", "transformers", "ctranslate2", "pywhispercpp", "llama_cpp",
                "sentence_transformers", "faster_whisper")


class _PeerBlocker:
    """A meta path finder that refuses the peer modules."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in PEER_MODULES:
            raise ImportError(f"{name} is a peer: the test gate compares against the stored "
                              "goldens (tests/goldens) and must not import it")
        return None


if os.environ.get("WORKBENCH_BLOCK_PEERS") == "1":
    sys.meta_path.insert(0, _PeerBlocker())


_SESSION_LLMS: list = []  # the session fixtures' LLMs, loaded so far


def _model_fixture(name: str, kind: str, alias: str):
    """A session fixture `name`: `workbench.<kind>.load(alias)`, closed after the last test."""

    @pytest.fixture(scope="session", name=name)
    def loaded():
        import workbench

        with getattr(workbench, kind).load(alias) as model:
            # the tests check the engine as it runs once its kernels are ready: on a cold
            # kernel cache the warm-up's thread and helper process compile them meanwhile
            # (two-worker runs on a cold cache twice failed the bit-level batch-invariance
            # checks of the first tests on one worker, never on a warm cache)
            model.warmup.wait()
            if kind == "LLM":
                _SESSION_LLMS.append(model)
            yield model
            if model in _SESSION_LLMS:
                _SESSION_LLMS.remove(model)

    return loaded


@pytest.fixture(autouse=True)
def _no_generation_outlives_its_test(request):
    """After each test the shared session models are idle. A generation a test leaves
    running (a Completion kept alive by a traceback, a stream never closed) decodes on
    beside the next tests' requests, in their batches: the batch-invariance checks then
    see neighbours they did not ask for. Waits a moment for abandoned generations to
    stop, then fails the test that left one."""
    yield
    busy = [m for m in _SESSION_LLMS if m._scheduler.pending]
    if not busy:
        return
    gc.collect()  # frees Completions only a reference cycle kept alive: they then stop
    deadline = time.monotonic() + 10.0
    while busy and time.monotonic() < deadline:
        time.sleep(0.05)
        busy = [m for m in busy if m._scheduler.pending]
    if busy:
        names = ", ".join(f"{m.path.name} ({m._scheduler.pending} requests)" for m in busy)
        pytest.fail(f"{request.node.nodeid} left generations running on {names}",
                    pytrace=False)


smollm2 = _model_fixture("smollm2", "LLM", "smollm2-135m")
minilm = _model_fixture("minilm", "Encoder", "minilm-l6")
qwen = _model_fixture("qwen", "LLM", "qwen2.5-coder-0.5b")
gemma3 = _model_fixture("gemma3", "LLM", "gemma3-270m")


@pytest.fixture(scope="module")
def engines(smollm2, minilm):
    """What the server tests serve, by model id: a chat model, an embedder, Whisper."""
    from workbench import WhisperModel

    with WhisperModel.load("whisper-tiny.en") as whisper:
        yield {"smollm2-135m": smollm2, "minilm-l6": minilm, "whisper-tiny.en": whisper}


def pytest_configure(config):
    """With `-n N` (pytest-xdist), each worker computes on one thread: N workers on N
    cores, not N pools of N threads taking turns (their spinning waits made the engine
    several times slower beside another busy process). Set here, in the controller, the
    variables reach the workers before they load NumPy and Numba; a child process a
    test starts inherits them."""
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        for var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ.setdefault(var, "1")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    """A browser test is slow too: the inner loop, `-m "not slow"`, leaves it out. The
    peers tier (tests/test_peers.py) runs only when `-m` names it (`-m peers`): the gate
    compares against the stored goldens and installs no peer."""
    for item in items:
        if item.get_closest_marker("browser") is not None:
            item.add_marker(pytest.mark.slow)
    if "peers" in (config.option.markexpr or ""):
        return
    peers = [item for item in items if item.get_closest_marker("peers") is not None]
    if peers:
        config.hook.pytest_deselected(items=peers)
        items[:] = [item for item in items if item.get_closest_marker("peers") is None]
