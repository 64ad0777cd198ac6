"""Property-based requests (Schemathesis strategies from the server's own OpenAPI schema)
against the real server on a loopback port: valid and invalid bodies for every route. None
may get a 5xx, and every error must be OpenAI-shaped."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

EXAMPLES = 30  # per route and mode
ROUTE_MODEL = {"/v1/chat/completions": "smollm2-135m", "/v1/completions": "smollm2-135m",
               "/v1/embeddings": "minilm-l6", "/v1/audio/transcriptions": "whisper-tiny.en",
               "/v1/audio/translations": "whisper-tiny.en"}


@pytest.fixture(scope="module")
def live_server(smollm2, minilm):
    import workbench
    from workbench import WhisperModel

    with WhisperModel.load("whisper-tiny.en") as whisper, \
            workbench.serve({"smollm2-135m": smollm2, "minilm-l6": minilm,
                             "whisper-tiny.en": whisper}, port=0, max_queue=4,
                            max_body_bytes=1 << 20, max_tokens_limit=4) as server:
        yield server


def _operations(url: str):
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


# valid bodies run the models and are slow; invalid ones (the inner loop's check) are quick
MODES = [pytest.param(mode, marks=pytest.mark.slow) if mode.value == "positive" else mode
         for mode in schemathesis.GenerationMode]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_no_server_errors(live_server, mode):
    operations = _operations(live_server.url)
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions",
                                              "/v1/embeddings", "/v1/audio/transcriptions"}
    seen: dict[str, set[int]] = {}
    for op in operations:
        try:
            _fuzz(op, mode, live_server.url, seen)
        except Unsatisfiable:  # no way to make a GET without a body invalid
            assert op.method.upper() == "GET", op.path
    # every POST route was exercised
    assert {p for p in seen if p.startswith("/v1/")} >= {
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings",
        "/v1/audio/transcriptions"}, seen


def _fuzz(op, mode, url: str, seen: dict[str, set[int]]) -> None:
    """Send EXAMPLES generated requests to one route; record the status codes."""
    strategy = op.as_strategy(generation_mode=mode)
    if op.path in ROUTE_MODEL:  # a served model, or every request would be a 404
        strategy = strategy.map(_with_model(ROUTE_MODEL[op.path]))

    @given(case=strategy)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        response = case.call(base_url=url, timeout=120)
        seen.setdefault(op.path, set()).add(response.status_code)
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error

    run()


def _with_model(model: str):
    def fix(case):
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model
        return case

    return fix
