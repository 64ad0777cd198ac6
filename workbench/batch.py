"""`workbench batch`: answer every line of a JSONL file, decoded together, resumably.

Each input line is a JSON object: `{"messages": [...]}` (a chat) or `{"prompt": "..."}`
(a completion), with an optional `"id"` (default: the line number) and any
`GenerationOptions` field (`max_tokens`, `temperature`, `seed`, `stop` ...) or
`"grammar"` (GBNF text) / `"schema"` (a JSON Schema) for that line alone, and
`"draft"` / `"draft_tokens"` for its speculative decoding (`"ngram"`: prompt lookup; the
run's `--draft` model by the name given there; null: none):

    {"id": "q1", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}
    {"prompt": "The capital of France is", "temperature": 0, "stop": ["\\n"]}

Every line goes to the model as its own request from a small pool of threads, so the
model's scheduler decodes up to `max_batch` of them in one forward pass per token.
Each answer is one output line, written and flushed as it finishes (in the order they
finish, not the input's):

    {"id": "q1", "line": 1, "text": "...", "finish_reason": "stop",
     "usage": {"prompt_tokens": 31, "completion_tokens": 9, "total_tokens": 40}}

(a line that drafted has `drafted_tokens` and `accepted_tokens` in its usage too).

A line whose generation fails gets `"error"` instead of `text`. Run again with the same
output file and the lines already answered are skipped: a killed run loses only the
lines in flight (a truncated last line is dropped); failed lines are tried again.

A plain text input (binfer's `-i prompts.txt`: any file that is not JSONL) holds one
prompt per line, each continued as it is (with `use_template`, sent as a chat's user
message); its output is plain text too, one answer per line in the input's order, with
backslashes, newlines and carriage returns written as `\\`, `\n` and `\r`. Until every
line is answered the answers are kept in `OUT.progress.jsonl` (so a run resumes the same
way), and the text file is written at the end.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.engine.options import OPTION_NAMES, GenerationOptions

LINE_FIELDS = ("id", "prompt", "messages", "grammar", "schema", "draft", "draft_tokens")
LOOKUP = "ngram"  # a line's (or the run's) draft for prompt lookup


@dataclass(frozen=True)
class BatchLine:
    """One input line: its `id`, its 1-based `line` number, a `prompt` or `messages`,
    its options, its constraint (a compiled `Grammar`, or None) and its draft (`LOOKUP`,
    the run's draft model's name, or None) with the proposals per pass (None: the
    engine's default)."""

    id: str | int
    line: int
    prompt: str | None
    messages: list[dict] | None
    options: GenerationOptions
    grammar: Any = None
    draft: str | None = None
    draft_tokens: int | None = None


@dataclass(frozen=True)
class Drafts:
    """The run's speculative decoding: its default draft (`LOOKUP`, a model's name as
    `--draft` gave it, or None), the proposals per pass (None: the engine's default) and
    how a draft model is loaded by that name (once, if some line drafts with it)."""

    default: str | None = None
    tokens: int | None = None
    load: Callable[[str], Any] | None = None

    def __post_init__(self):
        if self.tokens is not None:
            _check_draft_tokens(self.tokens)

    def for_line(self, item: dict, grammar: Any) -> tuple[str | None, int | None]:
        """A line's (draft, draft_tokens): its own fields, else the run's; a line with a
        grammar or schema decodes without the run's draft (speculation takes none). A
        bad field is a ValueError."""
        tokens = item.get("draft_tokens", self.tokens)
        if tokens is not None:
            _check_draft_tokens(tokens)
        if "draft" not in item:
            return (None if grammar is not None else self.default), tokens
        draft = item["draft"]
        if draft is not None and draft not in (LOOKUP, self.default):
            run = (f", or {self.default!r} (the run's --draft)"
                   if self.default not in (None, LOOKUP) else "")
            raise ValueError(f"\"draft\" is {LOOKUP!r} (prompt lookup){run} or null, not "
                             f"{draft!r}")
        if draft is not None and grammar is not None:
            raise ValueError("a line with a grammar or schema cannot draft (\"draft\"); "
                             "constrained output decodes without one")
        return draft, tokens


def _check_draft_tokens(value: Any) -> None:
    """`speculative.check_draft_tokens`, imported when used (it loads the decoding
    modules, which this module's readers need only for lines that use them)."""
    from workbench.engine.decoding.speculative import check_draft_tokens

    check_draft_tokens(value)


def id_key(value: Any) -> str:
    """How ids compare (JSON text: 1 and "1" are different ids)."""
    return json.dumps(value, sort_keys=True)


def read_lines(path: str | os.PathLike, options: GenerationOptions, grammar: Any = None,
               drafts: Drafts = Drafts()) -> list[BatchLine]:
    """Every line of the JSONL file at `path`, checked before any work: a bad line
    (not JSON, neither `prompt` nor `messages`, an unknown field, an option out of range,
    a bad grammar or draft, a repeated id) is a ValueError naming it. `options`,
    `grammar` and `drafts` are the defaults the lines' own fields override. Blank lines
    are skipped."""
    from workbench.engine.decoding.grammar import Grammar, resolve_grammar

    path = Path(path)
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    compiled: dict[str, Grammar] = {}  # lines with the same constraint share its grammar
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}); a batch is a JSONL "
                         "file") from None
    for number, raw in enumerate(text.split("\n"), 1):  # (splitlines would also cut at
        #                                                  U+2028, which JSON strings hold)
        if not raw.strip():
            continue
        where = f"{path}, line {number}"
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg} at column {exc.colno})"
                             ) from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: a line must be a JSON object, not "
                             f"{type(item).__name__}")
        unknown = sorted(set(item) - set(LINE_FIELDS) - set(OPTION_NAMES))
        if unknown:
            raise ValueError(f"{where}: unknown field {', '.join(map(repr, unknown))}; "
                             f"a line has {', '.join(LINE_FIELDS)} and the generation "
                             f"options {', '.join(OPTION_NAMES)}")
        prompt, messages = item.get("prompt"), item.get("messages")
        if (prompt is None) == (messages is None):
            raise ValueError(f"{where}: a line needs either \"prompt\" (a completion) or "
                             "\"messages\" (a chat), not "
                             + ("both" if prompt is not None else "neither"))
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            raise ValueError(f"{where}: \"prompt\" must be a non-empty string")
        if messages is not None and not _is_conversation(messages):
            raise ValueError(f"{where}: \"messages\" must be a non-empty list of "
                             "{\"role\": ..., \"content\": ...} objects")
        line_id = item.get("id", number)
        if isinstance(line_id, bool) or not isinstance(line_id, (str, int)):
            raise ValueError(f"{where}: \"id\" must be a string or an integer")
        key = id_key(line_id)
        if key in seen:
            raise ValueError(f"{where}: id {line_id!r} is already line {seen[key]}'s")
        seen[key] = number
        fields = {k: v for k, v in item.items() if k in OPTION_NAMES}
        try:  # (GenerationOptions reads logit_bias's keys, strings in JSON: parse_logit_bias)
            line_options = GenerationOptions.of(options, **fields)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        line_grammar = grammar
        if item.get("grammar") is not None or item.get("schema") is not None:
            spec = id_key([item.get("grammar"), item.get("schema")])
            if spec not in compiled:
                try:
                    compiled[spec] = resolve_grammar(item.get("grammar"), item.get("schema"))
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{where}: {exc}") from None
            line_grammar = compiled[spec]
        try:
            draft, draft_tokens = drafts.for_line(item, line_grammar)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        lines.append(BatchLine(line_id, number, prompt, messages, line_options,
                               line_grammar, draft, draft_tokens))
    return lines


def is_jsonl(path: str | os.PathLike) -> bool:
    """Whether `path` is a JSONL batch: named `.jsonl`, or (not named `.txt`) every one
    of its first non-blank lines a JSON object."""
    path = Path(path)
    if path.suffix.lower() in (".jsonl", ".txt"):
        return path.suffix.lower() == ".jsonl"
    try:
        with open(path, encoding="utf-8") as f:
            head = [line for line in (f.readline() for _ in range(50)) if line.strip()]
    except (OSError, UnicodeDecodeError):
        return True  # read_lines reports it
    for line in head:
        try:
            if not isinstance(json.loads(line), dict):
                return False
        except ValueError:
            return False
    return bool(head)


def read_text_lines(path: str | os.PathLike, options: GenerationOptions, grammar: Any = None,
                    use_template: bool = False, drafts: Drafts = Drafts()) -> list[BatchLine]:
    """binfer's input: one prompt per line of the text file at `path` (blank lines
    skipped, ids are line numbers); with `use_template` each is a chat's user message.
    Each line drafts with the run's draft (`drafts`)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    lines = []
    for number, raw in enumerate(text.split("\n"), 1):
        prompt = raw.rstrip("\r")
        if not prompt.strip():
            continue
        chat = [{"role": "user", "content": prompt}] if use_template else None
        draft, draft_tokens = drafts.for_line({}, grammar)
        lines.append(BatchLine(number, number, None if use_template else prompt, chat,
                               options, grammar, draft, draft_tokens))
    return lines


def escape_line(text: str) -> str:
    """An answer as one line of a text output (backslash, newline and CR escaped)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _is_conversation(messages: Any) -> bool:
    return (isinstance(messages, list) and bool(messages)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages))


def read_done(path: str | os.PathLike) -> tuple[set[str], list[str]]:
    """The ids (as `id_key`) answered in the output file at `path` and what was dropped.

    A last line cut short (a killed run) is removed from the file, and so are lines that
    record an error (they are to be tried again). A missing file has no ids. Another
    line that is not JSON is a ValueError: the file is not one `workbench batch` wrote."""
    path = Path(path)
    if not path.exists():
        return set(), []
    data = path.read_bytes()
    kept: list[bytes] = []
    done: set[str] = set()
    dropped: list[str] = []
    rows = data.split(b"\n")
    complete = len(rows) - 1  # the last piece follows the last newline: complete if empty
    for i, raw in enumerate(rows, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or "id" not in record:
                raise ValueError("no id")
        except ValueError:
            if i >= complete:  # the line being written when the run stopped
                dropped.append(f"line {i} (cut short)")
                continue
            raise ValueError(f"{path}, line {i}: not a line of `workbench batch` output; "
                             "choose another output file") from None
        if "error" in record:
            dropped.append(f"line {i} (failed: tried again)")
            continue
        done.add(id_key(record["id"]))
        kept.append(raw)
    if dropped or (data and not data.endswith(b"\n")):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(r + b"\n" for r in kept))
        os.replace(tmp, path)
    return done, dropped


def answer(llm: Any, line: BatchLine, cancel: threading.Event | None = None,
           draft_models: dict[str, Any] | None = None) -> dict:
    """The output record of one line (generated to its end on `llm`; `draft_models`: the
    loaded draft models by name)."""
    kw: dict[str, Any] = dict(options=line.options, grammar=line.grammar, cancel=cancel)
    if line.draft is not None:
        kw["draft"] = line.draft if line.draft == LOOKUP else (draft_models or {})[line.draft]
        if line.draft_tokens is not None:
            kw["draft_tokens"] = line.draft_tokens
    completion = (llm.chat(line.messages, **kw) if line.messages is not None
                  else llm.generate(line.prompt, **kw)).wait()
    usage = completion.usage
    counts = {"prompt_tokens": usage.prompt_tokens,
              "completion_tokens": usage.completion_tokens,
              "total_tokens": usage.total_tokens}
    if getattr(usage, "drafted_tokens", None) is not None:  # a line that drafted
        counts.update(drafted_tokens=usage.drafted_tokens,
                      accepted_tokens=usage.accepted_tokens)
    return {"id": line.id, "line": line.line, "text": completion.text,
            "finish_reason": completion.finish_reason, "usage": counts}


def run(llm: Any, lines: Iterable[BatchLine], out: str | os.PathLike, *,
        workers: int | None = None, progress: Callable[[dict], None] | None = None,
        draft_models: dict[str, Any] | None = None) -> int:
    """Answer `lines` on `llm`, appending one JSON line per answer to `out` (flushed as
    each finishes); `progress(record)` after each; `draft_models`: the draft models the
    lines name, loaded. `workers` requests are in flight at
    once (default: twice the model's `max_batch`, so that a place coming free in the batch
    finds the next request waiting). Returns the number of lines that failed (their
    records carry `"error"`). Ctrl-C cancels what is in flight and raises
    KeyboardInterrupt."""
    from workbench.engine.cancel import Cancelled

    lines = list(lines)
    workers = workers or 2 * getattr(llm, "max_batch", 8)
    cancel = threading.Event()
    failed = 0

    def one(line: BatchLine) -> dict:
        try:
            return answer(llm, line, cancel, draft_models)
        except Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded on the line, the others go on
            return {"id": line.id, "line": line.line, "error": f"{type(exc).__name__}: {exc}"}

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="batch")
    try:
        with open(out, "a", encoding="utf-8") as f:
            pending: set[Future] = {pool.submit(one, line) for line in lines}
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    record = fut.result()
                    failed += "error" in record
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
                    f.flush()
                    if progress is not None:
                        progress(record)
    except BaseException:
        cancel.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return failed


def check_output(source: str | os.PathLike, out: str | os.PathLike) -> None:
    """Refuse an output file `run_file` cannot append its answers to: the input itself
    (the same path, or the same file through a hard or symbolic link: its lines would
    read as answers already given) or, when it exists, anything but a regular file (a
    FIFO would block the run until some reader opens it, a device swallow the answers)."""
    try:
        st = os.stat(out)
    except FileNotFoundError:
        if Path(source).resolve() == Path(out).resolve():  # (the input is missing too)
            raise ValueError("the output file must differ from the input file") from None
        return
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode)
                else "a directory" if stat.S_ISDIR(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device")
        raise ValueError(f"the output {out} is {kind}, not a regular file; name a file "
                         "(new, or one an earlier run wrote)")
    if os.path.samestat(st, os.stat(source)):
        raise ValueError("the output file must differ from the input file")


def run_file(llm_factory: Callable[[], Any], source: str | os.PathLike,
             out: str | os.PathLike, options: GenerationOptions, grammar: Any = None, *,
             file=None, use_template: bool = False, quiet: bool = False,
             drafts: Drafts = Drafts()) -> int:
    """The `workbench batch` command: read and check `source` (JSONL, or plain text: one
    prompt per line, `use_template` to chat them), skip what `out` already answers, load
    the model (`llm_factory()`) and the draft model the lines use (`drafts`) only if
    lines remain, and answer them with a progress bar on `file` (default: stderr; none
    when `quiet`). Returns the exit status (1 when lines failed)."""
    file = file or sys.stderr
    check_output(source, out)
    if is_jsonl(source):
        if use_template:
            raise ValueError("--use-template is for plain text prompts; a JSONL line "
                             "chooses \"prompt\" or \"messages\" itself")
        return _answer_file(llm_factory, read_lines(source, options, grammar, drafts), out,
                            file, quiet, drafts)
    lines = read_text_lines(source, options, grammar, use_template, drafts)
    progress = Path(f"{out}.progress.jsonl")
    check_output(source, progress)
    status = _answer_file(llm_factory, lines, progress, file, quiet, drafts)
    if status == 0:  # every line answered: the text file, in the input's order
        by_id = {}
        for raw in progress.read_text(encoding="utf-8").splitlines():
            if raw.strip():
                record = json.loads(raw)
                by_id[id_key(record["id"])] = record["text"]
        tmp = Path(f"{out}.tmp")
        tmp.write_text("".join(escape_line(by_id[id_key(line.id)]) + "\n" for line in lines),
                       encoding="utf-8")
        os.replace(tmp, out)
        progress.unlink()
    return status


def _answer_file(llm_factory: Callable[[], Any], lines: list[BatchLine],
                 out: str | os.PathLike, file, quiet: bool, drafts: Drafts) -> int:
    """Answer the `lines` that `out` (JSONL) does not hold yet, appending to it."""
    from tqdm import tqdm

    done, dropped = read_done(out)
    todo = [line for line in lines if id_key(line.id) not in done]
    n_done = len(lines) - len(todo)
    if dropped and not quiet:
        print(f"workbench: dropped from {out}: {'; '.join(dropped)}", file=file)
    if n_done and not quiet:
        print(f"workbench: {n_done} of {len(lines)} lines already done in {out}; "
              f"{len(todo)} to go", file=file)
    if not todo:
        return 0
    llm = llm_factory()
    named = {line.draft for line in todo} - {None, LOOKUP}
    draft_models = {name: drafts.load(name) for name in named}
    with tqdm(total=len(lines), initial=n_done, unit="line", desc="batch", file=file,
              dynamic_ncols=True, disable=quiet) as bar:
        failed = run(llm, todo, out, progress=lambda record: bar.update(1),
                     draft_models=draft_models)
    if failed:
        print(f"workbench: {failed} of {len(todo)} lines failed (their \"error\" is in {out}; "
              "run again to retry them)", file=file)
        return 1
    return 0
