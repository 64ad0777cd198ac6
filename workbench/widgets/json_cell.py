"""`JSONCell`: constrained generation with a schema or a GBNF grammar, shown as a JSON tree.

    cell = JSONCell(m, schema=Light, prompt="Turn on the kitchen light.")
    cell                # schema editor, prompt, Generate / Stop, tree, badge, mask time
    cell.run(); cell.wait()
    cell.value          # a Light instance (a dict for a JSON Schema, text for GBNF)

The schema editor holds JSON Schema text; a pydantic class passed as `schema`
is shown as its schema and used as long as the text is not edited. In "gbnf"
mode the editor holds a GBNF grammar (a few examples are built in). The answer
streams into `value_json` as the JSON parsed so far (open strings, arrays and
objects closed), so the tree grows while the model writes; the badge says
whether the finished answer validates (with `jsonschema`, or the pydantic
model) and the stats give the grammar's mask time per token.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

import anywidget
import numpy as np
import traitlets

from workbench.engine.decoding.grammar import Grammar
from workbench.engine.options import DEFAULTS
from workbench.widgets.chat import STATIC, UPDATE_INTERVAL
from workbench.widgets.worker import StoppableWorker

if TYPE_CHECKING:
    from workbench.engine.llm import LLM

# GBNF examples of our own, in llama.cpp's grammar language.
EXAMPLE_GRAMMARS = {
    "yes or no": 'root ::= ("yes" | "no") "."\n',
    "bulleted list": 'root ::= item{1,5}\nitem ::= "- " [^\\n]+ "\\n"\n',
    "date": 'root ::= year "-" month "-" day\nyear ::= [12] [0-9] [0-9] [0-9]\n'
            'month ::= "0" [1-9] | "1" [0-2]\nday ::= "0" [1-9] | [12] [0-9] | "3" [01]\n',
    "sum": 'root ::= num (" + " num)+ " = " num\nnum ::= [1-9] [0-9]{0,3}\n',
}
DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                   "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


class JSONCell(StoppableWorker, anywidget.AnyWidget):
    """Grammar-constrained generation for `model`: a JSON Schema (or GBNF) editor, a
    prompt, Generate / Stop, the answer as a JSON tree, a validation badge and the
    per-token mask time.

    Synced traits: `mode` ("schema" or "gbnf"), `schema_text`, `gbnf_text`, `prompt`,
    `temperature`, `max_tokens` (editable in the browser), `examples`, `text` (raw
    output), `value_json` (the JSON parsed so far), `validity` ("", "valid",
    "invalid", "incomplete"), `validation` (the reason), `generating`, `busy`,
    `stats`, `error`.
    """

    _esm = STATIC / "json.js"
    _css = STATIC / "widgets.css"

    mode = traitlets.Enum(("schema", "gbnf"), "schema").tag(sync=True)
    schema_text = traitlets.Unicode("").tag(sync=True)
    gbnf_text = traitlets.Unicode("").tag(sync=True)
    examples = traitlets.Dict().tag(sync=True)
    prompt = traitlets.Unicode("").tag(sync=True)
    temperature = traitlets.Float(DEFAULTS.temperature).tag(sync=True)  # the engine's: greedy
    max_tokens = traitlets.Int(DEFAULTS.max_tokens).tag(sync=True)
    text = traitlets.Unicode("").tag(sync=True)
    value_json = traitlets.Unicode("").tag(sync=True)
    validity = traitlets.Unicode("").tag(sync=True)
    validation = traitlets.Unicode("").tag(sync=True)
    generating = traitlets.Bool(False).tag(sync=True)
    busy = traitlets.Bool(False).tag(sync=True)
    stats = traitlets.Unicode("").tag(sync=True)
    # why the answer was closed before the model ended it ("budget", "free_text",
    # "repetition"; see workbench.engine.decoding.closing), or ""
    closed = traitlets.Unicode("").tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)


    def __init__(self, model: LLM, schema: dict | str | type | None = None, *,
                 prompt: str = "Describe a person who likes the sea.", gbnf: str | None = None,
                 temperature: float = DEFAULTS.temperature,
                 max_tokens: int = DEFAULTS.max_tokens, **options: Any):
        """`schema`: a JSON Schema (dict or text) or a pydantic model class; `gbnf`:
        start in GBNF mode with this grammar. `options` go to `model.chat`."""
        pydantic_model = schema if isinstance(schema, type) else None
        if pydantic_model is not None:
            schema = Grammar.from_json_schema(pydantic_model).schema
        if schema is None:
            schema = DEFAULT_SCHEMA
        schema_text = schema if isinstance(schema, str) else json.dumps(schema, indent=2)
        super().__init__(mode="gbnf" if gbnf is not None else "schema",
                         schema_text=schema_text,
                         gbnf_text=gbnf if gbnf is not None else EXAMPLE_GRAMMARS["bulleted list"],
                         examples=EXAMPLE_GRAMMARS, prompt=prompt,
                         temperature=temperature, max_tokens=max_tokens)
        self.model = model
        self.options: dict[str, Any] = dict(options)
        self.mask_times: list[float] = []  # seconds per token, of the last run
        self._pydantic = (pydantic_model, schema_text) if pydantic_model is not None else None
        self._value: Any = None
        self._thread: threading.Thread | None = None
        self._follow(model)
        self.on_msg(self._on_frontend_msg)

    # -- public API --------------------------------------------------------------------------
    @property
    def value(self) -> Any:
        """The finished answer: the parsed JSON (a pydantic instance when the cell was
        given a model class and its schema was not edited), or the text in GBNF mode;
        None before a run completes."""
        return self._value

    def grammar(self) -> Grammar:
        """The grammar the editor holds now (raises `GrammarError` / `SchemaError`)."""
        if self.mode == "gbnf":
            return Grammar.from_gbnf(self.gbnf_text)
        model = self._pydantic_model()
        return Grammar.from_json_schema(model if model is not None else self.schema_text)

    def run(self) -> threading.Thread:
        """Generate an answer for the prompt on a worker thread (returned). A bad grammar
        or schema is reported in `error` (and raised); RuntimeError while one runs."""
        if self.generating:
            raise RuntimeError("an answer is being generated; wait() for it or stop() it")
        self.error = self.validation = self.validity = self.closed = self.stats = ""
        self.text = self.value_json = ""  # the last answer goes, whether or not this one runs
        self._value = None
        try:
            grammar = self.grammar()
        except ValueError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            raise
        options = {**self.options, "temperature": float(self.temperature),
                   "max_tokens": int(self.max_tokens)}
        self._stop.clear()
        self.generating = True
        thread = threading.Thread(target=self._generate, args=(grammar, self.prompt, options),
                                  name="workbench-json", daemon=True)
        self._thread = thread
        thread.start()
        return thread

    # -- internals ---------------------------------------------------------------------------
    def _pydantic_model(self) -> type | None:
        if self._pydantic is not None and self._pydantic[1] == self.schema_text:
            return self._pydantic[0]
        return None

    def _generate(self, grammar: Grammar, prompt: str, options: dict[str, Any]) -> None:
        """Worker: stream the constrained answer; always leaves `generating` False."""
        pieces: list[str] = []
        masks: list[float] = []
        reason = "error"
        start = time.perf_counter()
        completion = None
        try:
            completion = self.model.chat([{"role": "user", "content": prompt}],
                                         grammar=grammar, **options)
            pushed = 0.0
            for event in completion.iter_events():
                pieces.append(event.text)
                if event.mask_ms is not None:
                    masks.append(event.mask_ms / 1e3)
                if event.closed and not self.closed:
                    self.closed = event.closed
                if self._stop.is_set():
                    reason = "stopped"
                    break
                now = time.perf_counter()
                if now - pushed >= UPDATE_INTERVAL:
                    pushed = now
                    self._show("".join(pieces), grammar, masks, start, None)
            else:
                reason = completion.finish_reason
        except Exception as exc:  # shown in the cell, never raised in the kernel
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            if completion is not None:
                try:
                    completion.close()
                except Exception:  # noqa: BLE001 - already reported or harmless
                    pass
            self.mask_times = masks
            text = "".join(pieces)
            self._show(text, grammar, masks, start, reason)
            self._judge(text, grammar, reason)
            self.generating = False

    def _show(self, text: str, grammar: Grammar, masks: list[float], start: float,
              reason: str | None) -> None:
        self.text = text
        if grammar.kind == "json_schema":
            partial = close_partial_json(text)
            self.value_json = json.dumps(partial) if partial is not _NOTHING else ""
        parts = [f"{len(masks)} tokens", f"{time.perf_counter() - start:.1f}s"]
        if masks:
            ms = np.asarray(masks) * 1e3
            parts.append(f"mask {np.median(ms):.3f} ms/token (p50), "
                         f"{np.percentile(ms, 99):.3f} ms (p99)")
        if reason:
            parts.append(reason)
        if self.closed:
            parts.append(CLOSED_NOTES[self.closed])
        self.stats = " · ".join(parts)

    def _judge(self, text: str, grammar: Grammar, reason: str) -> None:
        """Set `value`, `validity` and `validation` for the finished answer (one closed at
        the budget ends with "length", complete)."""
        if reason != "stop" and not (reason == "length" and self.closed == "budget"):
            self.validity, self.validation = "incomplete", f"generation ended: {reason}"
            return
        if grammar.kind != "json_schema":
            self._value = text
            self.validity, self.validation = "valid", "matches the grammar"
            return
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            self.validity, self.validation = "invalid", f"not JSON: {exc}"
            return
        model = self._pydantic_model()
        try:
            if model is not None:
                self._value = model.model_validate(value)
                self.validity, self.validation = "valid", f"a valid {model.__name__}"
                return
            self._value = value
            self.validity, self.validation = _validate(value, grammar.schema)
        except Exception as exc:  # pydantic's or jsonschema's verdict
            self.validity, self.validation = "invalid", str(exc).splitlines()[0]

    def _on_frontend_msg(self, widget: Any, content: Any, buffers: Any) -> None:
        """Actions from the browser: {"type": "run"} and {"type": "stop"}."""
        if not isinstance(content, dict):
            return
        try:
            if content.get("type") == "run":
                self.run()
            elif content.get("type") == "stop":
                self.stop()
        except (RuntimeError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"


# The stats line's note on an answer the closer ended (see `JSONCell.closed`).
CLOSED_NOTES = {"budget": "closed at the budget (raise max_tokens for more)",
                "free_text": "a long string was closed early",
                "repetition": "a loop was closed early"}


def _validate(value: Any, schema: Any) -> tuple[str, str]:
    try:
        import jsonschema
    except ImportError:
        return "valid", "complete (install jsonschema to check it independently)"
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    errors = sorted(cls(schema).iter_errors(value), key=lambda e: list(e.path))
    if errors:
        where = "/".join(map(str, errors[0].path)) or "(root)"
        return "invalid", f"{where}: {errors[0].message}"
    return "valid", "validates against the schema (jsonschema)"


_NOTHING = object()


def close_partial_json(text: str) -> Any:
    """The value a prefix of a JSON text stands for so far: open strings, arrays and
    objects are closed, and a trailing key, comma or unfinished literal is dropped.
    Returns `_NOTHING` when nothing can be shown yet."""
    closers, in_string, escape, cuts = _scan(text)
    if escape:
        text = text[:-1]
    candidates = [text + ('"' if in_string else "") + "".join(reversed(closers))]
    for cut in reversed(cuts[-3:]):  # back off to where the last member or element began
        head = text[:cut]
        candidates.append(head + "".join(reversed(_scan(head)[0])))
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except json.JSONDecodeError:
            continue
    return _NOTHING


def _scan(text: str) -> tuple[list[str], bool, bool, list[int]]:
    """(closers of the containers open at the end, inside a string, after a backslash,
    offsets just before each member or element began)."""
    closers: list[str] = []
    cuts: list[int] = []
    in_string = escape = False
    for i, c in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            closers.append("]" if c == "[" else "}")
            cuts.append(i + 1)
        elif c in "]}":
            if closers:
                closers.pop()
        elif c == ",":
            cuts.append(i)
    return closers, in_string, escape, cuts
