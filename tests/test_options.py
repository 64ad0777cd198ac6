"""`GenerationOptions`: one home for the generation defaults, read by the engine's
signatures, the CLI, the server schema, the remote client and the widgets. No model
file needed."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workbench import registry
from workbench.engine.decoding.sampling import SamplingParams as SamplingParamsFromSampling
from workbench.engine.options import DEFAULTS, GenerationOptions, SamplingParams


def test_sampling_params_keep_their_home_and_old_import_path():
    assert SamplingParamsFromSampling is SamplingParams
    sampling = {f.name for f in dataclasses.fields(SamplingParams)}
    assert sampling <= {f.name for f in dataclasses.fields(GenerationOptions)}


def test_of_applies_overrides_and_checks_them():
    base = GenerationOptions(temperature=0, max_tokens=5)
    assert GenerationOptions.of() is DEFAULTS
    assert GenerationOptions.of(base) is base
    assert GenerationOptions.of(base, max_tokens=7) == dataclasses.replace(base, max_tokens=7)
    with pytest.raises(TypeError):
        GenerationOptions.of(temprature=0)  # a typo is refused, as a keyword was before
    with pytest.raises(ValueError, match="max_tokens"):
        GenerationOptions.of(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        GenerationOptions(top_p=0)
    with pytest.raises(TypeError, match="GenerationOptions"):
        GenerationOptions.of({"temperature": 0})


@pytest.mark.parametrize("field, value, error, message", [
    ("temperature", float("nan"), ValueError, "finite"),
    ("top_p", float("inf"), ValueError, "finite"),
    ("temperature", "0.5", TypeError, "number, not str"),
    ("presence_penalty", True, TypeError, "number, not bool"),
    ("max_tokens", "5", TypeError, "integer, not str"),
    ("max_tokens", 2.5, TypeError, "integer, not float"),
    ("top_k", 4.0, TypeError, "integer, not float"),
    ("logprobs", -1, ValueError, "logprobs must be >= 0"),
    ("repeat_last_n", -2, ValueError, "repeat_last_n"),
    ("seed", -2, ValueError, "seed must be >= 0, or -1"),
    ("seed", 1.5, TypeError, "integer"),
    ("seed", [1, -3], ValueError, "seed must be >= 0"),
])
def test_values_of_the_wrong_type_or_out_of_range_are_refused(field, value, error, message):
    """Each option says what it takes instead of failing later inside the sampler
    (NumPy's "Probabilities contain NaN", a str compared with an int)."""
    with pytest.raises(error, match=message):
        GenerationOptions(**{field: value})


def test_seeds_numpy_numbers_and_llama_cpps_random_seed():
    import numpy as np

    assert GenerationOptions(seed=-1).seed is None  # llama.cpp's spelling of "random"
    opts = GenerationOptions(top_k=np.int64(3), temperature=np.float32(0.5), seed=np.int64(7))
    assert opts.sampling().top_k == 3 and opts.sampling().seed == 7
    assert GenerationOptions(seed=[1, 2]).seed == [1, 2]  # one per prompt of a batch
    with pytest.raises(TypeError, match="list of seeds is for generate_batch"):
        GenerationOptions(seed=[1, 2]).sampling()


def test_sampling_part_stops_and_changed_fields():
    opts = GenerationOptions(temperature=0, seed=3, logit_bias=None, stop=["", "\n"])
    params = opts.sampling()
    assert type(params) is SamplingParams and params.logit_bias == {} and params.seed == 3
    assert opts.sampling(seed=9).seed == 9
    assert opts.stop_strings() == ["\n"]
    assert GenerationOptions(stop="END").stop_strings() == ["END"]
    assert GenerationOptions(temperature=0.5, max_tokens=5).changed() == {
        "temperature": 0.5, "max_tokens": 5}


@pytest.mark.parametrize("key", ["1_000", " 12 ", "\u0661\u0662", "\uff11\uff12", "+12", "12.0",
                                 "", "0x1f", "-1", "9" * 5000, -1, True, 1.5],
                         ids=lambda key: repr(key)[:12])
def test_logit_bias_keys_are_plain_token_ids(key):
    """Only non-negative integers or plain ASCII decimal strings name a token: int() would
    also read "1_000", " 12 " and Arabic-Indic or fullwidth digits as numbers."""
    with pytest.raises((TypeError, ValueError), match="logit_bias"):
        GenerationOptions(logit_bias={key: 1.0})


def test_logit_bias_takes_ids_as_integers_or_digit_strings():
    import numpy as np

    bias = GenerationOptions(logit_bias={"12": 1, 7: float("-inf"), np.int64(3): 2.5}).logit_bias
    assert bias == {12: 1.0, 7: float("-inf"), 3: 2.5}
    assert all(type(k) is int and type(v) is float for k, v in bias.items())
    for value in (float("nan"), "5", True):
        with pytest.raises((TypeError, ValueError), match="logit_bias"):
            GenerationOptions(logit_bias={1: value})
    with pytest.raises(TypeError, match="logit_bias"):
        GenerationOptions(logit_bias=[(1, 2.0)])


def test_python_defaults_follow_the_seed_table():
    """parabun's `chat`/`generate` table: greedy, 512 tokens, the model's end tokens, no
    echo; the filters off unless given (parabun's topK/topP, binfer's --top-k 0 --top-p 1)."""
    from workbench.engine.llm import LLM

    assert (DEFAULTS.temperature, DEFAULTS.max_tokens, DEFAULTS.stop_tokens) == (0, 512, None)
    assert (DEFAULTS.top_k, DEFAULTS.top_p, DEFAULTS.min_p) == (0, 1.0, 0.0)
    assert inspect.signature(LLM.generate).parameters["include_prompt"].default is False
    assert inspect.signature(LLM.embed).parameters["normalize"].default is False


def test_the_generation_methods_show_every_option_with_its_default():
    from workbench.engine.llm import LLM

    for method in (LLM.generate, LLM.chat, LLM.generate_batch, LLM.chat_batch, LLM.chat_json):
        params = inspect.signature(method).parameters
        for f in dataclasses.fields(GenerationOptions):
            assert params[f.name].default == getattr(DEFAULTS, f.name), (method, f.name)
        assert params["options"].default is None and params["options"].kind is params[
            "options"].KEYWORD_ONLY
    assert "overrides" not in inspect.signature(LLM.generate).parameters
    assert "generate_args" in inspect.signature(LLM.chat).parameters  # grammar=, prefix= ...


def _readme_defaults() -> dict[str, str]:
    """The README's options table: option name -> its "Python API, CLI" cell."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 4:
            for name in re.findall(r"`(\w+)`", cells[0]):
                rows[name] = cells[1]
    return rows


def test_the_readme_the_options_and_the_cli_help_agree_on_the_defaults():
    """One table for the seed user: the README's row, `GenerationOptions` and `--help`."""
    import contextlib
    import io

    from workbench import cli

    readme = _readme_defaults()
    assert readme["top_k"] == readme["top_p"] == readme["min_p"] == "off (0 / 1.0 / 0)"
    assert (DEFAULTS.top_k, DEFAULTS.top_p, DEFAULTS.min_p) == (0, 1.0, 0.0)
    assert readme["temperature"].startswith(f"{DEFAULTS.temperature:g} ")
    assert readme["max_tokens"] == str(DEFAULTS.max_tokens)
    for command in ("generate", "chat", "batch"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            cli._parser().parse_args([command, "--help"])
        help_text = " ".join(out.getvalue().split())
        for flag, value in (("--top-k", "0 = off (default: 0)"),
                            ("--top-p", "1.0 = off (default: 1.0)"),
                            ("--min-p", "0 = off (default: 0.0)"),
                            ("--temperature", f"(default: {DEFAULTS.temperature})"),
                            ("--max-tokens", f"(default: {DEFAULTS.max_tokens})")):
            assert f"{flag} " in help_text and value in help_text, (command, flag)


def test_cli_flags_default_to_the_options():
    from workbench import cli

    args = cli._parser().parse_args(["generate", "hi"])
    assert cli._options(args) == DEFAULTS
    args = cli._parser().parse_args(["chat", "-t", "0", "-n", "5", "--stop", "x"])
    assert cli._options(args) == GenerationOptions(temperature=0, max_tokens=5, stop=["x"])


def test_server_schema_passes_the_option_fields_it_knows():
    from workbench.server.schemas import ChatCompletionRequest, CompletionRequest

    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 temperature=0, top_k=3, min_p=0.1, seed=1, stop="x")
    assert body.sampling() == {"temperature": 0, "top_p": 1.0, "top_k": 3, "min_p": 0.1,
                               "seed": 1, "stop": ["x"]}
    # omitted fields take OpenAI's defaults (sampling at temperature 1, no filter)
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}]
                                 ).sampling() == {"temperature": 1.0, "top_p": 1.0,
                                                  "top_k": 0, "min_p": 0.0}
    assert CompletionRequest(model="m", prompt="hi").max_tokens == 16  # OpenAI's default


def test_remote_requests_take_options_objects():
    from workbench.server.remote import _request_options

    body = _request_options({"options": GenerationOptions(temperature=0, top_k=5),
                             "max_tokens": 9})
    assert body == {"temperature": 0, "max_tokens": 9, "extra_body": {"top_k": 5}}
    # the Python API's defaults travel, so a remote model is greedy like a local one
    assert _request_options({}) == {"temperature": 0, "max_tokens": 512}


def test_widget_controls_keep_their_own_defaults():
    from workbench.widgets.chat import CHAT_TEMPERATURE, CHAT_TOP_P, ChatCell
    from workbench.widgets.json_cell import JSONCell

    assert ChatCell.temperature.default_value == CHAT_TEMPERATURE == 0.8  # a chat cell samples
    assert JSONCell.temperature.default_value == DEFAULTS.temperature == 0
    for cell in (ChatCell, JSONCell):
        assert cell.max_tokens.default_value == DEFAULTS.max_tokens
    assert ChatCell.top_p.default_value == CHAT_TOP_P == 0.95  # its slider's own start


def test_the_remote_client_imports_no_engine():
    code = ("import sys, workbench.server.remote; print([m for m in sys.modules if m.startswith("
            "('numba', 'llvmlite', 'workbench.kernels', 'workbench.engine.llm'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_the_registry_needs_a_converter_for_converted_aliases(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    with pytest.raises(registry.PullError, match=r"use workbench\.pull"):
        registry.pull("minilm-l6")
