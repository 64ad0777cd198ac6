"""Rendering a GGUF model's chat template (`tokenizer.chat_template`) safely.

A chat template is a Jinja program shipped inside a model file, so it is
untrusted input: a crafted GGUF could try to climb from a string to Python's
internals and run shell commands. Templates here run in Jinja's immutable
sandbox with a few extra guards:

- reading any `_`-prefixed attribute (`''.__class__`, `cycler.__init__`,
  `x|attr('__globals__')`, `'{0.__class__}'.format(x)` ...) raises at once
  instead of quietly rendering as an empty "undefined" value;
- methods that change data (`list.append`, `dict.update` ...) are refused;
- huge repetitions (`'a' * 10**10`), powers and ranges are refused.

Every such refusal, every template syntax error and every
`raise_exception(...)` the template calls becomes a `ChatTemplateError`.

The variables a template sees follow what Hugging Face `transformers` and
llama-cpp-python provide: `messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, `tools`, any extra keyword the caller passes, and the helpers
`raise_exception(message)` and `strftime_now(format)`. The `tojson` filter
keeps non-ASCII text as is (`json.dumps(..., ensure_ascii=False)`) and takes
`indent`, `separators` and `sort_keys` arguments. The `{% generation %}`
block tag some training templates use is accepted and renders its body.

    >>> render(CHATML, [{"role": "user", "content": "Hi"}])
    '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["CHATML", "GEMMA", "ChatTemplate", "ChatTemplateError", "fallback_template",
           "render"]

#: The fallback template for models whose GGUF carries no `tokenizer.chat_template`:
#: plain ChatML (`<|im_start|>role\ncontent<|im_end|>\n` per message, then
#: `<|im_start|>assistant\n` when a generation prompt is asked for), the format
#: llama.cpp also falls back to. It adds no default system message. Content may be a
#: string, None (rendered empty) or a list of OpenAI-style parts, whose `text` parts
#: are joined.
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is iterable %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: The fallback for Gemma-style vocabularies (with `<start_of_turn>` and `<end_of_turn>`
#: tokens) whose GGUF carries no template: `<start_of_turn>user\n...<end_of_turn>\n`,
#: the assistant's turns under the role `model`, system messages folded into the start
#: of the next user turn (Gemma has no system role), and `<start_of_turn>model\n` as the
#: generation prompt. BOS is left to the tokenizer's `add_bos`.
GEMMA = (
    "{%- macro text(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content is iterable %}"
    "{%- for part in content %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{%- endmacro %}"
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- set ns.system = ns.system + text(message['content']) + '\n\n' %}"
    "{%- else %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\n' }}"
    "{%- if role == 'user' %}{{- ns.system }}{%- set ns.system = '' %}{%- endif %}"
    "{{- text(message['content']) | trim }}"
    "{{- '<end_of_turn>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)


def fallback_template(tokens: Sequence[str]) -> str:
    """The template for a model whose GGUF has none: `GEMMA` for a vocabulary with Gemma's
    turn tokens, else `CHATML`."""
    return GEMMA if {"<start_of_turn>", "<end_of_turn>"} <= set(tokens) else CHATML


_MAX_REPEAT = 1_000_000  # longest string or list a template may build with `*`
_MAX_EXPONENT = 4096  # largest integer exponent `**` may use
_COMPILED_CACHE_SIZE = 64


class ChatTemplateError(ValueError):
    """A chat template that cannot be rendered: a syntax error, a
    `raise_exception(...)` from the template itself, a refused (unsafe) operation,
    or an error while it ran."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's part in
    training templates; for inference it just renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)  # the `generation` name itself
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, made loud: unsafe access raises instead of
    yielding an undefined value, and oversized `*` / `**` results are refused."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is refused: "
            "templates may not reach Python internals or call methods that modify data")

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(attribute, str) and attribute.startswith("_"):
            # a mapping's own key is data; anything else named `_...` is Python machinery
            if isinstance(obj, Mapping) and attribute in obj:
                return obj[attribute]
            self.unsafe_undefined(obj, attribute)
        return super().getattr(obj, attribute)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if (isinstance(seq, (str, list, tuple)) and isinstance(count, int)
                        and len(seq) * count > _MAX_REPEAT):
                    raise SecurityError(
                        f"repeating a {type(seq).__name__} to {len(seq) * count} items is "
                        f"refused (limit {_MAX_REPEAT})")
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
              and abs(left) > 1 and right > _MAX_EXPONENT):
            raise SecurityError(f"an integer power with exponent {right} is refused "
                                f"(limit {_MAX_EXPONENT})")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: Any) -> NoReturn:
    """The template's `raise_exception(message)`."""
    raise ChatTemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    """The template's `strftime_now(format)`: the local time, formatted."""
    if not isinstance(fmt, str):
        raise ChatTemplateError("strftime_now() takes a format string")
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | str | None = None, separators: Any = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    """The template's `tojson` filter: JSON without ASCII escaping or HTML quoting."""
    if separators is not None:
        separators = tuple(separators)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _make_environment() -> _ChatSandbox:
    env = _ChatSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()


def _describe_syntax_error(source: str, exc: TemplateSyntaxError) -> str:
    line = exc.lineno or 0
    text = ""
    lines = source.splitlines()
    if 1 <= line <= len(lines):
        snippet = lines[line - 1].strip()
        text = f" (`{snippet[:80]}{'...' if len(snippet) > 80 else ''}`)"
    return f"chat template syntax error on line {line}{text}: {exc.message}"


@functools.lru_cache(maxsize=_COMPILED_CACHE_SIZE)
def _compile(source: str) -> jinja2.Template:
    """The compiled template for `source` (cached by source text)."""
    try:
        return _ENV.from_string(source)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(_describe_syntax_error(source, exc)) from exc
    except SecurityError as exc:
        raise ChatTemplateError(f"chat template refused: {exc}") from exc
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template cannot be compiled: {exc}") from exc


def _check_messages(messages: Any) -> list:
    if not isinstance(messages, (list, tuple)):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts, "
                        f"got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', "
                            f"got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}] needs a string 'role', got {role!r}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise TypeError(f"messages[{i}]['content'] must be a string, None or a list of "
                            f"content parts, got {type(content).__name__}")
    return list(messages)


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "", tools: list | None = None,
           **variables: Any) -> str:
    """Render a chat template (Jinja source) for `messages` in the sandbox.

    `messages` is a list of dicts with a string `role`; `content` may be a
    string, None or a list of content parts (`[{"type": "text", "text": ...}]`),
    passed to the template unchanged. `tools` (OpenAI-style function specs) and
    any extra `variables` are visible to the template by name. Compiled
    templates are cached by their source text.

    Raises `TypeError`/`ValueError` for malformed `messages`, and
    `ChatTemplateError` for syntax errors, the template's own
    `raise_exception(...)`, refused (unsafe) operations and runtime errors.
    """
    if not isinstance(template, str):
        raise TypeError(f"template must be a string, got {type(template).__name__}")
    messages = _check_messages(messages)
    compiled = _compile(template)
    try:
        return compiled.render(
            variables,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=tools,
        )
    except ChatTemplateError:
        raise
    except SecurityError as exc:
        raise ChatTemplateError(f"chat template refused: {exc}") from exc
    except OverflowError as exc:  # the sandbox's range() limit
        raise ChatTemplateError(f"chat template refused: {exc}") from exc
    except RecursionError as exc:
        raise ChatTemplateError("chat template recursed too deeply") from exc
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError,
            ArithmeticError) as exc:
        raise ChatTemplateError(
            f"chat template failed: {type(exc).__name__}: {exc}") from exc


SAMPLE_CONVERSATION = [{"role": "user", "content": "Hello!"},
                       {"role": "assistant", "content": "Hi! How can I help?"},
                       {"role": "user", "content": "What is 2 + 2?"}]


def validate_chat_template(template: str) -> str:
    """Check a chat template: it compiles in the sandbox and renders a short conversation.

    Returns that rendering (to look at); raises `ChatTemplateError` naming the line for
    a syntax error, or the failure (a refused operation, `raise_exception`) otherwise.
    """
    _compile(template)
    return render(template, list(SAMPLE_CONVERSATION), add_generation_prompt=True)


class ChatTemplate:
    """A chat template with its special tokens, compiled once.

        >>> t = ChatTemplate(CHATML)
        >>> t.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
        '<|im_start|>user\\nHi<|im_end|>\\n'

    Construction raises `ChatTemplateError` for a template with a syntax error.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        if not isinstance(source, str):
            raise TypeError(f"source must be a string, got {type(source).__name__}")
        _compile(source)
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def chatml(cls, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """The fallback ChatML template (`CHATML`)."""
        return cls(CHATML, bos_token=bos_token, eos_token=eos_token)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text for `messages`; see the module-level `render`."""
        return render(self.source, messages, add_generation_prompt=add_generation_prompt,
                      bos_token=self.bos_token, eos_token=self.eos_token, **variables)

    def __repr__(self) -> str:
        head = self.source[:40].replace("\n", "\\n")
        return f"ChatTemplate({head!r}{'...' if len(self.source) > 40 else ''})"
