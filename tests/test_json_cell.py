"""JSONCell driven from Python (no browser): schema and GBNF modes, pydantic models,
the streamed tree, the validation badge, errors and Stop."""

from __future__ import annotations

import json
import time

import pytest

from workbench.engine.decoding.grammar import GrammarError, SchemaError
from workbench.widgets import JSONCell
from workbench.widgets.json_cell import _NOTHING, EXAMPLE_GRAMMARS, close_partial_json


def frontend(widget, content):
    widget._handle_custom_msg(content, [])


def test_partial_json_grows_into_the_whole_value():
    value = {"name": "Ann \"A\" \\ B", "tags": ["x", "y"], "n": {"a": 1.5, "b": None},
             "ok": False}
    text = json.dumps(value, indent=2)
    shown = [close_partial_json(text[:i]) for i in range(len(text) + 1)]
    assert shown[0] is _NOTHING and shown[-1] == value
    growing = [s for s in shown if s is not _NOTHING]
    assert {"name": "Ann"} in growing and {"name": 'Ann "A" \\ B', "tags": ["x"]} in growing


@pytest.mark.slow
def test_schema_mode_streams_a_valid_tree(smollm2):
    cell = JSONCell(smollm2, temperature=0, max_tokens=200)
    cell.run()
    assert cell.wait(120)
    assert cell.error == "" and cell.validity == "valid", cell.validation
    assert isinstance(cell.value, dict) and set(cell.value) == {"name", "age", "hobbies"}
    assert json.loads(cell.value_json) == cell.value == json.loads(cell.text)
    assert "mask" in cell.stats and "ms/token" in cell.stats
    assert len(cell.mask_times) >= 5 and all(0 <= t < 1 for t in cell.mask_times)
    expected = smollm2.chat([{"role": "user", "content": cell.prompt}], grammar=cell.grammar(),
                            temperature=0, max_tokens=200).text
    assert cell.text == expected


def test_pydantic_model_gives_an_instance_until_the_schema_is_edited(smollm2):
    pydantic = pytest.importorskip("pydantic")

    class Light(pydantic.BaseModel):
        room: str
        on: bool

    cell = JSONCell(smollm2, Light, prompt="Turn on the kitchen light.", temperature=0,
                    max_tokens=64)
    assert json.loads(cell.schema_text)["required"] == ["room", "on"]
    cell.run()
    cell.wait(120)
    assert isinstance(cell.value, Light) and cell.validity == "valid"
    schema = json.loads(cell.schema_text)
    schema["properties"]["on"] = {"type": "integer", "minimum": 0, "maximum": 1}
    cell.schema_text = json.dumps(schema)
    cell.run()
    cell.wait(120)
    assert isinstance(cell.value, dict) and cell.value["on"] in (0, 1)


def test_gbnf_mode_with_an_example_grammar(smollm2):
    cell = JSONCell(smollm2, gbnf=EXAMPLE_GRAMMARS["date"], prompt="When was the moon landing?",
                    temperature=0, max_tokens=32)
    assert cell.mode == "gbnf"
    cell.run()
    cell.wait(60)
    assert cell.validity == "valid" and cell.value == cell.text
    assert len(cell.text) == 10 and cell.text[4] == cell.text[7] == "-"
    assert cell.value_json == ""


def test_bad_schema_and_grammar_are_reported(smollm2):
    cell = JSONCell(smollm2, {"type": "object", "properties": {"a": {"type": "integer"}},
                              "required": ["a"]}, max_tokens=16)
    cell.run()
    cell.wait()
    assert cell.validity == "valid" and cell.text
    cell.schema_text = '{"type": "object", "not": {"type": "string"}}'
    with pytest.raises(SchemaError):
        cell.run()
    assert "not" in cell.error and not cell.generating
    # the last answer is gone: no "valid" badge over a schema that never ran
    assert (cell.validity, cell.text, cell.value_json, cell.stats) == ("", "", "", "")
    cell.mode = "gbnf"
    cell.gbnf_text = 'root ::= ("a"'
    frontend(cell, {"type": "run"})  # from the browser: shown, not raised
    assert "GrammarError" in cell.error and "line 1" in cell.error
    with pytest.raises(GrammarError):
        cell.grammar()


def test_stop_leaves_an_incomplete_answer(smollm2):
    cell = JSONCell(smollm2, {"type": "array", "items": {"type": "string"}},
                    prompt="List every country.", temperature=0, max_tokens=400)
    cell.run()
    deadline = time.monotonic() + 60
    while not cell.text and time.monotonic() < deadline:
        cell.wait(0.05)
    frontend(cell, {"type": "stop"})
    assert cell.wait(60)
    assert cell.validity == "incomplete" and cell.value is None
    assert not cell.generating and smollm2.busy.get() is False


def test_a_runaway_schema_shows_a_valid_object_closed_at_the_budget(smollm2):
    """A poem in a string runs on past 24 tokens: the answer is closed at the budget, the
    badge says valid, and the stats line says it was closed."""
    cell = JSONCell(smollm2, temperature=0, max_tokens=24,
                    schema={"type": "object", "properties": {"poem": {"type": "string"},
                                                             "lines": {"type": "integer"}},
                            "required": ["poem", "lines"]},
                    prompt="Write a very long poem about the sea as JSON.")
    cell.run()
    assert cell.wait(120)
    assert cell.closed == "budget" and cell.validity == "valid", cell.validation
    assert set(cell.value) == {"poem", "lines"} and json.loads(cell.text) == cell.value
    assert "closed at the budget" in cell.stats and "length" in cell.stats
