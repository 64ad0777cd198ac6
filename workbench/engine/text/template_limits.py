"""The budget a chat template renders on: what its work costs and where it is stopped.

A chat template is a program from the model file, and a few lines of Jinja can loop for
hours or build gigabytes. `chat_template` renders every template on a `Budget` made for
that rendering by `input_budget` and spent by `render_metered`; a template past any limit
is stopped with `LimitExceeded`, which `chat_template` reports as a `ChatTemplateLimitError`
naming the limit. This module holds the budget and the measures; `chat_template`'s sandbox
calls them from the operations it intercepts.

- Counted: a rendering's *steps*. While it renders, a `sys.settrace` hook on its thread
  counts each line run in template code and each Python call made (a filter, a method, a
  helper of Jinja's), and every string, list or literal built costs one step per
  `CHARS_PER_STEP` characters or items (`charge`, `built`). The same hook tracks the
  *depth* of nested template calls and, every `_CLOCK_EVERY` steps, looks at the clock.
- Checked before it is built: the *size* of every value one operation can make much larger
  than its inputs (`check_size`). `chat_template`'s sandbox bounds `+`, `*`, `%`, `~`,
  literals, `str` methods (`text_method_args`, `printf_size`) and `tojson`;
  `metered_filter` runs a check before the other filters that can (`center`, `indent`,
  `join`, `replace`, `format`, `wordwrap`, `string`, `pprint`, `batch`, `slice`, `sum`).
  Values are measured by the length of their text (`measure`), so a list of a thousand
  references to one long string costs what that text would; a container's measure is
  kept for the rendering (`remember`), since the sandbox changes none.
- Checked after: whatever a call, filter or `{{ ... }}` returns (`finalize_value`) is
  sized and charged, and the output is counted chunk by chunk against the output limit.
- The limits: `STEP_LIMIT` steps, `SIZE_LIMIT` characters for any one value and for the
  output, `DEPTH_LIMIT` nested calls, `TIME_LIMIT_S` seconds (a backstop for work in C
  that no step sees), `SOURCE_LIMIT` characters of template source and `MAX_EXPONENT` for
  integer powers. Steps and size grow with the input (`messages`, `tools` and the other
  variables): `STEPS_PER_INPUT_CHAR` per character of their text plus
  `STEPS_PER_INPUT_VALUE` per value in them, and `SIZE_PER_INPUT_CHAR` per character, so
  a long conversation gets room in proportion. Real templates take 100-150 steps per
  message.
"""

from __future__ import annotations

import itertools
import re
import string
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jinja2
from jinja2.utils import Namespace

__all__ = ["CHARS_PER_STEP", "DEPTH_LIMIT", "MAX_EXPONENT", "SIZE_LIMIT", "SIZE_PER_INPUT_CHAR",
           "SOURCE_LIMIT", "STEPS_PER_INPUT_CHAR", "STEPS_PER_INPUT_VALUE", "STEP_LIMIT",
           "TIME_LIMIT_S", "Budget", "LimitExceeded", "built", "charge", "check_size",
           "finalize_value", "input_budget", "measure", "metered_filter", "printf_size",
           "remember", "render_metered", "size_limit", "size_of", "text_method_args",
           "text_size"]

#: The work one rendering may do; `input_budget` grows them with the input (see above).
STEP_LIMIT = 200_000  # template lines run + Python calls made + text built / CHARS_PER_STEP
STEPS_PER_INPUT_CHAR = 1
STEPS_PER_INPUT_VALUE = 100  # a message is 5 values: itself, its role and content and keys
# characters (or list items) a template may build for the cost of one step: copying a
# kilobyte costs about what running a template line does, and templates that build the
# prompt by concatenation (`ns.out = ns.out ~ ...`, quadratic) still fit long chats
CHARS_PER_STEP = 1024
SIZE_LIMIT = 1_000_000  # characters of output, and of any one string, list or literal built
SIZE_PER_INPUT_CHAR = 4
DEPTH_LIMIT = 100  # nested template calls: macros calling macros, recursive loops
TIME_LIMIT_S = 10.0  # a backstop for work no step sees (a C-level scan of a long string)
SOURCE_LIMIT = 1_000_000  # characters of template source (real ones have a few thousand)
MAX_EXPONENT = 4096  # largest integer exponent `**` may use
_CLOCK_EVERY = 4096  # steps between two looks at the clock
_TEMPLATE_FILENAME = "<template>"  # the co_filename of code Jinja compiles from a string


class LimitExceeded(BaseException):
    """Raised inside a rendering past a limit. A BaseException, so that no
    `except Exception` in Jinja or the standard library on the way out can swallow it."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit
        self.message = message


class Budget:
    """The limits of one rendering and what it has used so far (see `input_budget`)."""

    __slots__ = ("max_steps", "max_size", "steps", "depth", "check_at", "deadline", "exceeded",
                 "measured")

    def __init__(self, input_chars: int = 0, input_values: int = 0) -> None:
        self.max_steps = (STEP_LIMIT + STEPS_PER_INPUT_CHAR * input_chars
                          + STEPS_PER_INPUT_VALUE * input_values)
        self.max_size = SIZE_LIMIT + SIZE_PER_INPUT_CHAR * input_chars
        self.steps = 0
        self.depth = 0
        self.deadline = time.monotonic() + TIME_LIMIT_S
        self.check_at = min(_CLOCK_EVERY, self.max_steps)
        self.exceeded: LimitExceeded | None = None
        # id -> (list/tuple/dict, its measure): the sandbox changes no container, so a
        # measure holds for the whole rendering (the value is kept so its id stays its own)
        self.measured: dict[int, tuple[Any, int, int, int]] = {}

    def fail(self, limit: str, message: str) -> LimitExceeded:
        """The `LimitExceeded` for `limit`, kept so that a rendering that swallowed it still
        fails on its way out."""
        self.exceeded = LimitExceeded(limit, f"chat template refused: {message}")
        return self.exceeded

    def check(self) -> None:
        """Called once `steps` passes `check_at`: the step and time limits."""
        if self.exceeded is not None:
            raise self.exceeded
        if self.steps > self.max_steps:
            raise self.fail("steps", f"it ran past its step limit ({self.max_steps} steps of "
                                     "template lines, calls and text built), as loops or macro "
                                     "calls that multiply do")
        if time.monotonic() > self.deadline:
            raise self.fail("time", f"it ran past its time limit ({TIME_LIMIT_S:g} s)")
        self.check_at = min(self.steps + _CLOCK_EVERY, self.max_steps)

    def tracer(self) -> Callable:
        """A `sys.settrace` function counting the lines run in template code and the
        Python calls made while rendering, and the nesting of template calls."""

        def trace_template_lines(frame: Any, event: str, arg: Any) -> Callable:
            if event == "line":
                self.steps += 1
                if self.steps > self.check_at:
                    self.check()
            elif event == "return":  # also on a generator's yield; each resume is a call
                self.depth -= 1
            return trace_template_lines

        def trace_calls(frame: Any, event: str, arg: Any) -> Callable | None:
            self.steps += 1
            if self.steps > self.check_at:
                self.check()
            if frame.f_code.co_filename != _TEMPLATE_FILENAME:
                return None
            self.depth += 1
            if self.depth > DEPTH_LIMIT:
                raise self.fail("depth", f"it recursed too deeply (past the depth limit of "
                                         f"{DEPTH_LIMIT} nested macro calls)")
            return trace_template_lines

        return trace_calls


_local = threading.local()  # .budget: the rendering running in this thread, if any


# The guards below run on every operation of a rendering, under its tracer, where each
# Python call they make is one more traced event: they read the budget inline.

def check_size(size: int, what: str) -> None:
    """Refuse `what`, of `size` characters or items, past the size limit (before building it
    where the size can be known in advance)."""
    budget = getattr(_local, "budget", None)
    limit = SIZE_LIMIT if budget is None else budget.max_size
    if size > limit:
        message = f"{what} of {size} characters or items is past the size limit ({limit})"
        if budget is None:
            raise LimitExceeded("size", f"chat template refused: {message}")
        raise budget.fail("size", message)


def charge(size: int) -> None:
    """Count `size` characters or items built as `size / CHARS_PER_STEP` steps."""
    budget = getattr(_local, "budget", None)
    if budget is None:
        return
    if budget.exceeded is not None:
        raise budget.exceeded
    budget.steps += size // CHARS_PER_STEP
    if budget.steps > budget.check_at:
        budget.check()


_SIZED = (str, bytes, list, tuple, dict, set, frozenset)


def size_of(value: Any) -> int:
    """Characters or items in a value just built (0 for anything else)."""
    return len(value) if isinstance(value, _SIZED) else 0


def built(value: Any, what: str) -> Any:
    """`value`, just built: refused past the size limit, else its size charged."""
    if isinstance(value, _SIZED) and len(value) >= CHARS_PER_STEP:
        size = len(value)
        budget = getattr(_local, "budget", None)
        if budget is None or size > budget.max_size or budget.exceeded is not None:
            check_size(size, what)
            charge(size)
        else:
            budget.steps += size // CHARS_PER_STEP
            if budget.steps > budget.check_at:
                budget.check()
    return value


def measure(value: Any, limit: int, *, each_once: bool = False) -> tuple[int, int, int]:
    """(about `len(str(value))`, the number of values inside, their deepest nesting) for a
    value a template holds, counting no further than `limit` characters. Containers that
    share parts (or hold themselves through a namespace) count each time they appear, as
    `str` and `tojson` would print them; with `each_once`, only once."""
    if isinstance(value, str):
        return len(value), 1, 0
    budget = getattr(_local, "budget", None)
    measured = budget.measured if budget is not None and not each_once else {}
    size = nodes_seen = deepest = visits = 0
    stack = [(value, 0)]
    seen: set[int] = set()
    while stack and size <= limit:
        item, depth = stack.pop()
        visits += 1
        nodes_seen += 1
        deepest = max(deepest, depth)
        if each_once and not isinstance(item, (str, bytes, int, float)) and item is not None:
            if id(item) in seen:
                continue
            seen.add(id(item))
        if id(item) in measured and measured[id(item)][0] is item:
            _, known_size, known_nodes, known_depth = measured[id(item)]
            size += known_size
            nodes_seen += known_nodes - 1
            deepest = max(deepest, depth + known_depth)
        elif isinstance(item, (str, bytes)):
            size += len(item) + 2  # quotes when inside a container
        elif isinstance(item, bool) or item is None:
            size += 5
        elif isinstance(item, int):
            size += item.bit_length() * 3 // 10 + 2
        elif isinstance(item, float):
            size += 24
        elif isinstance(item, (list, tuple, set, frozenset)):
            size += 2 + 2 * len(item)
            if size <= limit:
                stack.extend(zip(item, itertools.repeat(depth + 1)))
        elif isinstance(item, Namespace):
            size += 13
            stack.append((_namespace_attributes(item), depth + 1))
        elif isinstance(item, (dict, Mapping)):  # dict first: an ABC check is a Python call
            size += 2 + 4 * len(item)
            if size <= limit:
                stack.extend(zip(itertools.chain.from_iterable(item.items()),
                                 itertools.repeat(depth + 1)))
        else:
            size += 16  # a macro, an undefined value, a loop helper: a short repr at most
    charge(visits)
    if budget is not None and size <= limit and isinstance(value, (list, tuple, dict)):
        remember(value, size, nodes_seen, deepest)
    return size, nodes_seen, deepest


def remember(value: Any, size: int, nodes_seen: int, deepest: int) -> None:
    """Keep the measure of a list, tuple or dict for the rest of the rendering."""
    budget = getattr(_local, "budget", None)
    if budget is not None:
        budget.measured[id(value)] = (value, size, nodes_seen, deepest)


def _namespace_attributes(ns: Namespace) -> dict:
    try:
        return dict(object.__getattribute__(ns, "_Namespace__attrs"))
    except AttributeError:  # a Jinja version that stores them otherwise
        return {}


def size_limit() -> int:
    """The size limit of the rendering running in this thread (`SIZE_LIMIT` outside one)."""
    budget = getattr(_local, "budget", None)
    return SIZE_LIMIT if budget is None else budget.max_size


def text_size(value: Any) -> int:
    """About `len(str(value))`, counted no further than just past the size limit."""
    return measure(value, size_limit())[0]


def _format_sizes(values: Any) -> tuple[int, int]:
    """(the longest text of `values`, the sum of their integers) for a format's arguments."""
    if isinstance(values, Mapping):
        values = list(values.values())
    elif not isinstance(values, (list, tuple)):
        values = [values]
    longest = max((text_size(v) for v in values), default=0)
    integers = sum(abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool))
    return longest, integers


_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def printf_size(fmt: str, values: Any) -> int:
    """An upper bound on the length of `fmt % values`: a width or precision in the format
    (or taken from the values by `*`) pads, and each conversion prints at most the longest
    value."""
    conversions = widths = 0
    star = False
    for match in _PRINTF_SPEC.finditer(fmt):
        conversions += 1
        for number in match.groups():
            if number == "*":
                star = True
            elif number:
                widths += int(number)
    longest, integers = _format_sizes(values)
    return len(fmt) + conversions * longest + widths + (integers if star else 0)


def _brace_format_size(fmt: str, values: Any) -> int:
    """An upper bound on the length of `fmt.format(*values)` (see `printf_size`)."""
    fields = widths = 0
    nested = False
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is not None:
            fields += 1
            if spec:
                widths += sum(int(number) for number in re.findall(r"\d+", spec))
                nested = nested or "{" in spec
    longest, integers = _format_sizes(values)
    return len(fmt) + fields * longest + widths + (integers if nested else 0)


def text_method_args(text: str | bytes, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a `str`/`bytes` method call whose result would be past the size limit, before
    it runs; returns `args`, with an iterable to `join` made a list (to be measured)."""
    n = len(text)
    size = None
    if name in ("center", "ljust", "rjust", "zfill"):
        width = args[0] if args else kwargs.get("width", 0)
        size = max(n, width) if isinstance(width, int) else n
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            tab = "\t" if isinstance(text, str) else b"\t"
            size = n + text.count(tab) * max(tabsize, 0)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], type(text)):
        old, new = args[0], args[1]
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        found = n + 1 if not old else text.count(old)
        if isinstance(count, int) and count >= 0:
            found = min(found, count)
        size = n + found * max(size_of(new) - len(old), 0)
    elif name == "join" and args:
        items = list(args[0])
        charge(len(items))
        args = (items, *args[1:])
        size = sum(map(size_of, items)) + n * max(len(items) - 1, 0)
    elif name in ("format", "format_map") and isinstance(text, str):
        values = (args[0] if args else {}) if name == "format_map" else [*args, *kwargs.values()]
        size = _brace_format_size(text, values)
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((size_of(v) for v in args[0].values()), default=1)
        size = n * max(longest, 1)
    if size is not None:
        check_size(size, f"the result of {type(text).__name__}.{name}()")
    return args


# Checks run before a filter, for the filters that can build a result much larger than
# their input in one call; each takes the filter's arguments (after the value's context)
# and returns them (an iterable made a list where it had to be measured).

def _center_check(value: Any, width: Any = 80) -> tuple[tuple, dict]:
    if isinstance(width, int):
        check_size(max(text_size(value), width), "the result of the center filter")
    return (value, width), {}


_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def _indent_check(s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    pad = len(width) if isinstance(width, str) else width
    if isinstance(s, str) and isinstance(pad, int):
        lines = sum(s.count(c) for c in _LINE_BREAKS) + 2
        check_size(len(s) + lines * max(pad, 0), "the result of the indent filter")
    return (s, width, *args), kwargs


def _format_check(value: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    if isinstance(value, str):
        check_size(printf_size(value, kwargs or args), "the result of the format filter")
    return (value, *args), kwargs


def _join_check(value: Any, d: Any = "", *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    items = list(value) if not isinstance(value, (str, list, tuple)) else value
    charge(len(items))
    size = size_of(d) * max(len(items) - 1, 0)
    for item in items:
        size += len(item) if isinstance(item, str) else text_size(item)
    check_size(size, "the result of the join filter")
    return (items, d, *args), kwargs


def _replace_check(s: Any, old: Any = None, new: Any = None, *args: Any, **kwargs: Any
                   ) -> tuple[tuple, dict]:
    if isinstance(s, str) and isinstance(old, str):
        text_method_args(s, "replace", (old, str(new), *args), kwargs)
    return (s, old, new, *args), kwargs


def _wordwrap_check(s: Any, width: Any = 79, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    wrapstring = args[1] if len(args) > 1 else kwargs.get("wrapstring")
    if isinstance(s, str) and isinstance(width, int):
        lines = len(s) // max(width, 1) + s.count("\n") + 1
        check_size(len(s) + lines * size_of(wrapstring or "\n"),
                    "the result of the wordwrap filter")
    return (s, width, *args), kwargs


def _shaped_text_check(what: str) -> Callable:
    """For `string` and `pprint`: the value's text, with one pad per nested value."""

    def check(value: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        size, count, depth = measure(value, size_limit())
        if what == "pprint":
            size += count * (depth + 1)
        check_size(size, f"the result of the {what} filter")
        return (value, *args), kwargs

    return check


def _batch_check(value: Any, linecount: Any = None, fill_with: Any = None
                 ) -> tuple[tuple, dict]:
    if fill_with is not None and isinstance(linecount, int):
        check_size(linecount * max(text_size(fill_with), 1), "a filled batch")
    return (value, linecount, fill_with), {}


def _slice_check(value: Any, slices: Any = None, *args: Any) -> tuple[tuple, dict]:
    if isinstance(slices, int):
        check_size(slices, "the slices of the slice filter")
    return (value, slices, *args), {}


def _sum_check(iterable: Any, attribute: Any = None, start: Any = 0) -> tuple[tuple, dict]:
    if not isinstance(start, (int, float)) and attribute is None:
        # summing lists or tuples copies the running total once per item
        items = list(iterable)
        total = size_of(start) + sum(map(size_of, items))
        check_size(total, "the result of the sum filter")
        charge(len(items) * total // 2)
        iterable = items
    return (iterable, attribute, start), {}


_FILTER_CHECKS: dict[str, Callable] = {
    "center": _center_check,
    "indent": _indent_check,
    "format": _format_check,
    "join": _join_check,
    "replace": _replace_check,
    "wordwrap": _wordwrap_check,
    "string": _shaped_text_check("string"),
    "pprint": _shaped_text_check("pprint"),
    "batch": _batch_check,
    "slice": _slice_check,
    "sum": _sum_check,
}


def metered_filter(name: str, func: Callable) -> Callable:
    """`func` (a Jinja filter) with its size check (if it has one) before it runs and its
    result's size counted after. The wrapper takes the context, which also keeps Jinja
    from running it at compile time (outside any budget) on constant arguments."""
    pass_arg = getattr(getattr(func, "jinja_pass_arg", None), "name", None)
    check = _FILTER_CHECKS.get(name)

    @jinja2.pass_context
    def metered(context: Any, *args: Any, **kwargs: Any) -> Any:
        if check is not None:
            args, kwargs = check(*args, **kwargs)
        if pass_arg == "context":
            result = func(context, *args, **kwargs)
        elif pass_arg == "eval_context":
            result = func(context.eval_ctx, *args, **kwargs)
        elif pass_arg == "environment":
            result = func(context.environment, *args, **kwargs)
        else:
            result = func(*args, **kwargs)
        return built(result, f"the result of the {name} filter")

    metered.__name__ = metered.__qualname__ = f"metered_{name}"
    return metered


def finalize_value(value: Any) -> Any:
    """Every `{{ value }}` before it is made text: its text must fit the size limit."""
    if isinstance(value, str):
        return built(value, "an output value")
    size = text_size(value)
    check_size(size, "an output value")
    charge(size)
    return value


def input_budget(variables: Mapping[str, Any]) -> Budget:
    """The budget for rendering with `variables`: the limits, grown by the characters of
    their text and the values in them (shared or self-holding containers counted once)."""
    input_chars, input_values, _ = measure(variables, sys.maxsize, each_once=True)
    return Budget(input_chars, input_values)


def render_metered(compiled: jinja2.Template, variables: dict, budget: Budget) -> str:
    """Render `compiled` with `variables` within `budget` (see `input_budget`), raising
    `LimitExceeded` at the first limit hit. The budget's tracer counts this thread's steps
    (replacing any other trace function, a debugger's or coverage's, for the time of the
    rendering), and the output is collected piece by piece, up to the output limit."""
    previous_budget = getattr(_local, "budget", None)
    previous_trace = sys.gettrace()
    _local.budget = budget
    parts = []
    produced = 0
    try:
        sys.settrace(budget.tracer())
        for chunk in compiled.generate(variables):
            produced += len(chunk)
            if produced > budget.max_size:
                raise budget.fail("output", f"its output is past the output limit "
                                            f"({budget.max_size} characters)")
            parts.append(chunk)
        if budget.exceeded is not None:  # caught and dropped on the way out somewhere
            raise budget.exceeded
    finally:
        sys.settrace(previous_trace)
        _local.budget = previous_budget
    return "".join(parts)
