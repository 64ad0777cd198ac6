"""Rendering a GGUF model's chat template (`tokenizer.chat_template`) safely.

A chat template is a Jinja program shipped inside a model file, so it is
untrusted input: a crafted GGUF could try to climb from a string to Python's
internals and run shell commands. Templates here run in Jinja's immutable
sandbox with a few extra guards:

- reading any `_`-prefixed attribute (`''.__class__`, `cycler.__init__`,
  `x|attr('__globals__')`, `'{0.__class__}'.format(x)` ...) raises at once
  instead of quietly rendering as an empty "undefined" value;
- methods that change data (`list.append`, `dict.update` ...) are refused;
- huge powers and ranges are refused.

A template also runs on a budget, since a few lines of Jinja can loop for hours or build
gigabytes: a step limit (template lines run, Python calls made and text built, counted by
a `sys.settrace` hook on this thread while it renders), a depth limit on nested macro
calls, a size limit on every string, list or literal it builds (checked before the
operations that can build a large one in one go: `*`, `+`, `~`, `%`, `center`, `indent`,
`join`, `replace`, `format`, `tojson(indent=...)`, `str.ljust` ...), an output limit and
a time limit as a backstop; they grow with the size of the conversation rendered.
`template_limits` holds the budget, its limits and the measures (see its docstring); the
sandbox here calls them. `check_template_limits` tries a template on a few ordinary
conversations, as `LLM` does when it loads a model.

Every such refusal, every template syntax error and every
`raise_exception(...)` the template calls becomes a `ChatTemplateError`; a limit hit
is a `ChatTemplateLimitError` naming the limit.

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
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from workbench.engine.text.template_limits import (
    MAX_EXPONENT,
    SIZE_LIMIT,
    SOURCE_LIMIT,
    LimitExceeded,
    built,
    charge,
    check_size,
    finalize_value,
    input_budget,
    measure,
    metered_filter,
    printf_size,
    remember,
    render_metered,
    size_limit,
    size_of,
    text_method_args,
    text_size,
)

__all__ = ["CHATML", "GEMMA", "ChatTemplate", "ChatTemplateError", "ChatTemplateLimitError",
           "check_template_limits", "fallback_template", "render"]

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


_COMPILED_CACHE_SIZE = 64


class ChatTemplateError(ValueError):
    """A chat template that cannot be rendered: a syntax error, a
    `raise_exception(...)` from the template itself, a refused (unsafe) operation,
    or an error while it ran."""


class ChatTemplateLimitError(ChatTemplateError):
    """A chat template that ran past one of its limits. `limit` names which: "steps",
    "size", "output", "depth" or "time" (see `template_limits.STEP_LIMIT` and the constants
    beside it)."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's part in
    training templates; for inference it just renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)  # the `generation` name itself
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _MeteredCodeGenerator(CodeGenerator):
    """Jinja's code generator, with `~` joins and list, tuple and dict literals built
    through the sandbox, which checks their size."""

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _checked_literal(self, visit: Callable, node: nodes.Node, frame: Any) -> None:
        if getattr(node, "ctx", "load") != "load":  # a target (`for a, b in ...`)
            visit(node, frame)
            return
        self.write("environment.checked_literal(")
        visit(node, frame)
        self.write(")")

    def visit_Tuple(self, node: nodes.Tuple, frame: Any) -> None:
        self._checked_literal(super().visit_Tuple, node, frame)

    def visit_List(self, node: nodes.List, frame: Any) -> None:
        self._checked_literal(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Any) -> None:
        self._checked_literal(super().visit_Dict, node, frame)


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, made loud and bounded: unsafe access raises instead of
    yielding an undefined value, and operations that build large values check the size
    limit first (with `template_limits.Budget`'s tracer counting steps while a template
    renders)."""

    code_generator_class = _MeteredCodeGenerator
    intercepted_binops = frozenset({"+", "*", "%", "**"})

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

    def getitem(self, obj: Any, argument: Any) -> Any:
        result = super().getitem(obj, argument)
        if isinstance(argument, slice):
            charge(size_of(result))
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        # lists are measured by their text: a list of a thousand references to one long
        # string is as costly to sort, compare or print as that much text
        size = 0
        result_measure = None  # the result's (size, nodes, depth), for a list or tuple
        if operator == "+":
            if isinstance(left, str) and isinstance(right, str):
                size = len(left) + len(right)
            elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                limit = size_limit()
                (a, a_nodes, a_depth), (b, b_nodes, b_depth) = (measure(left, limit),
                                                                measure(right, limit))
                size = a + b
                result_measure = (size, a_nodes + b_nodes, max(a_depth, b_depth))
        elif operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, str) and isinstance(count, int):
                    size = len(seq) * count
                elif isinstance(seq, (list, tuple)) and isinstance(count, int) and count > 0:
                    seq_size, seq_nodes, seq_depth = measure(seq, size_limit())
                    size = seq_size * count
                    result_measure = (size, seq_nodes * count, seq_depth)
        elif operator == "%" and isinstance(left, str):
            size = printf_size(left, right)
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
              and abs(left) > 1 and right > MAX_EXPONENT):
            raise SecurityError(f"an integer power with exponent {right} is refused "
                                f"(limit {MAX_EXPONENT})")
        if size > SIZE_LIMIT:  # the smallest limit: only then look closer
            kind = type(left if isinstance(left, (str, list, tuple)) else right).__name__
            what = {"+": "adding", "*": "repeating", "%": "`%` formatting"}[operator]
            check_size(size, f"{what} a {kind}")
        result = built(self.binop_table[operator](left, right), f"the result of `{operator}`")
        if result_measure is not None:
            remember(result, *result_measure)
        return result

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        # the sandbox wraps `str.format` in a function that keeps the method as __wrapped__
        method = getattr(__obj, "__wrapped__", __obj) if isinstance(
            __obj, types.FunctionType) else __obj
        if isinstance(method, types.BuiltinMethodType):
            owner = getattr(method, "__self__", None)
            if isinstance(owner, (str, bytes)):
                args = text_method_args(owner, method.__name__, args, kwargs)
            elif method.__name__ == "fromkeys" and args:  # n keys, each with the value
                keys = list(args[0])
                value = args[1] if len(args) > 1 else None
                check_size(len(keys) * max(text_size(value), 1), "the result of fromkeys()")
                args = (keys, *args[1:])
        return built(super().call(__context, __obj, *args, **kwargs), "a call's result")

    def concat(self, parts: Iterable[str]) -> str:
        """The join of a macro's, a `{% set %}` block's or a `caller()`'s output."""
        parts = list(parts)
        size = sum(map(len, parts))
        check_size(size, "a block's output")
        charge(size)
        return "".join(parts)

    def checked_concat(self, parts: tuple) -> str:
        """`a ~ b ~ ...`"""
        size = 0
        for part in parts:
            size += len(part) if isinstance(part, str) else text_size(part)
        check_size(size, "the result of `~`")
        charge(size)
        return "".join(map(str, parts))

    def checked_literal(self, value: Any) -> Any:
        """A list, tuple or dict literal: its text must fit the size limit, so that values
        nesting shared parts (`(t, t)` again and again) cannot grow past it unseen."""
        if value:
            check_size(text_size(value), f"a {type(value).__name__} literal")
        return value


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
    size, count, depth = measure(value, size_limit())
    pad = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    if ensure_ascii:
        size *= 12  # `\uXXXX`, twice for a character outside the BMP
    check_size(size + count * (1 + depth * max(pad, 0)), "the result of the tojson filter")
    if separators is not None:
        separators = tuple(separators)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _make_environment() -> _ChatSandbox:
    env = _ChatSandbox(
        finalize=finalize_value,
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: metered_filter(name, func) for name, func in env.filters.items()}
    env.globals.pop("lipsum", None)  # `lipsum(n)` writes n paragraphs: unbounded, and unused
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
    if len(source) > SOURCE_LIMIT:
        raise ChatTemplateLimitError(
            f"chat template refused: its source is {len(source)} characters, past the size "
            f"limit for a template ({SOURCE_LIMIT})", "size")
    try:
        return _ENV.from_string(source)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(_describe_syntax_error(source, exc)) from exc
    except SecurityError as exc:
        raise ChatTemplateError(f"chat template refused: {exc}") from exc
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template cannot be compiled: {exc}") from exc
    except LimitExceeded as exc:
        raise ChatTemplateLimitError(exc.message, exc.limit) from None
    except RecursionError as exc:  # brackets or blocks nested thousands deep
        raise ChatTemplateLimitError("chat template refused: it nests too deeply to compile "
                                     "(past Python's recursion limit)", "depth") from exc


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
    variables.update(messages=messages, add_generation_prompt=add_generation_prompt,
                     bos_token=bos_token, eos_token=eos_token, tools=tools)
    budget = input_budget(variables)
    try:
        return render_metered(compiled, variables, budget)
    except ChatTemplateError:
        raise
    except LimitExceeded as exc:
        raise ChatTemplateLimitError(exc.message, exc.limit) from None
    except RecursionError as exc:
        raise ChatTemplateLimitError("chat template refused: it recursed too deeply (past "
                                     "Python's recursion limit)", "depth") from exc
    except MemoryError as exc:  # a growth no size check foresaw
        raise ChatTemplateLimitError("chat template refused: it ran out of memory before "
                                     "reaching its size limit", "size") from exc
    except SecurityError as exc:
        raise ChatTemplateError(f"chat template refused: {exc}") from exc
    except OverflowError as exc:  # the sandbox's range() limit
        raise ChatTemplateError(f"chat template refused: {exc}") from exc
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError,
            ArithmeticError) as exc:
        raise ChatTemplateError(
            f"chat template failed: {type(exc).__name__}: {exc}") from exc


#: The conversations `check_template_limits` renders: with and without a system message,
#: a single user turn, and one with a tool, so that templates that refuse one shape (with
#: their own `raise_exception`) still render another.
LIMIT_CHECK_CONVERSATIONS: tuple[tuple[list[dict], list | None], ...] = (
    ([{"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "Hello!"},
      {"role": "assistant", "content": "Hi! How can I help?"},
      {"role": "user", "content": "What is 2 + 2?"}], None),
    ([{"role": "user", "content": "Hello!"},
      {"role": "assistant", "content": "Hi! How can I help?"},
      {"role": "user", "content": "What is 2 + 2?"}], None),
    ([{"role": "user", "content": "Hello!"}], None),
    ([{"role": "user", "content": "What is the weather in Paris?"}],
     [{"type": "function", "function": {
         "name": "get_weather", "description": "The weather in a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                        "required": ["city"]}}}]),
)


def check_template_limits(template: str, bos_token: str = "", eos_token: str = "") -> None:
    """Refuse a chat template that runs past its limits on ordinary conversations.

    Renders each of `LIMIT_CHECK_CONVERSATIONS` within the budget chat uses (so a hostile
    template costs at most a few of its budgets) and raises `ChatTemplateLimitError` at
    the first limit hit. The template's other errors, such as its own
    `raise_exception(...)` for a conversation shape it does not accept or a syntax error,
    are left for rendering time to report.
    """
    for messages, tools in LIMIT_CHECK_CONVERSATIONS:
        try:
            render(template, messages, add_generation_prompt=True, bos_token=bos_token,
                   eos_token=eos_token, tools=tools)
        except ChatTemplateLimitError:
            raise
        except ChatTemplateError:
            continue


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
