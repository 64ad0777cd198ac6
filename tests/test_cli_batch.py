"""The command line's batch, profiling and tracing, device and grammar flags."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import jsonschema
import pytest

from workbench import batch
from workbench.cli import main
from workbench.engine.options import DEFAULTS

SUBJECTS = ["France", "Japan", "Peru", "Kenya", "Norway", "Chile", "Egypt", "India"]


def _batch_lines(n: int) -> list[dict]:
    """n input lines, short (the batch's time goes to reading prompts): four completions
    to one chat, 1 to 3 tokens each."""
    lines = []
    for i in range(n):
        s = SUBJECTS[i % len(SUBJECTS)]
        if i % 5 == 4:
            line = {"id": f"chat-{i}", "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"A city in {s}?"}]}
        else:
            line = {"prompt": f"{i} {s}:"}  # id: the line number
        line["max_tokens"] = 1 + i % 3
        lines.append(line)
    return lines


def _write_jsonl(path, items) -> None:
    path.write_text("".join(json.dumps(x) + "\n" for x in items), encoding="utf-8")


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "workbench.cli", *args]


@pytest.mark.slow
def test_batch_resumes_after_a_kill(tmp_path, smollm2):
    """A 200-line batch killed (SIGKILL) part way, its output's last line cut short, then
    run again: 200 answers, one per id, the first run's kept as they were and only the
    rest computed; the answers are the model's greedy answers to each line alone."""
    source, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    lines = _batch_lines(200)
    _write_jsonl(source, lines)
    args = _cli("batch", "-i", str(source), "-o", str(out), "-t", "0", "--max-batch", "16",
                "--ctx", "512")
    first = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and first.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 40:
                break
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before it could be killed"
        first.send_signal(signal.SIGKILL)
    finally:
        first.wait()
    with out.open("a", encoding="utf-8") as f:  # as if killed in the middle of a write
        f.write('{"id": "chat-199", "line": 200, "te')
    before = out.read_text(encoding="utf-8").splitlines()[:-1]
    assert 40 <= len(before) < 200

    rerun = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(before)} of 200 lines already done" in rerun.stderr
    assert "cut short" in rerun.stderr
    after = out.read_text(encoding="utf-8").splitlines()
    assert after[: len(before)] == before  # kept, not computed again
    records = [json.loads(line) for line in after]
    expected_ids = [line.get("id", i + 1) for i, line in enumerate(lines)]
    assert sorted(map(str, (r["id"] for r in records))) == sorted(map(str, expected_ids))
    assert len(records) == 200  # each line answered once

    by_id = {r["id"]: r for r in records}
    # lines answered by either run, chats and completions
    for i in (0, 4, 100, 198, 199):
        line, record = lines[i], by_id[expected_ids[i]]
        if "messages" in line:
            c = smollm2.chat(line["messages"], temperature=0, max_tokens=line["max_tokens"])
        else:
            c = smollm2.generate(line["prompt"], temperature=0, max_tokens=line["max_tokens"])
        assert record["text"] == c.text, (i, record)
        assert record["line"] == i + 1 and record["finish_reason"] == c.finish_reason
        assert record["usage"] == {"prompt_tokens": c.usage.prompt_tokens,
                                   "completion_tokens": c.usage.completion_tokens,
                                   "total_tokens": c.usage.total_tokens}


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "hi"}\n{"prompt": "hi"\n', "line 2: not JSON"),
    ('{"prompt": "hi"}\n\n["a list"]\n', "line 3: a line must be a JSON object"),
    ('{"max_tokens": 4}\n', "line 1: a line needs either \"prompt\""),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}\n', "not both"),
    ('{"prompt": "a"}\n{"prompt": "b", "temprature": 0}\n', "line 2: unknown field 'temprature'"),
    ('{"prompt": "a", "max_tokens": -1}\n', "line 1: max_tokens must be >= 0"),
    ('{"prompt": "a", "id": 7}\n{"prompt": "b", "id": 7}\n', "line 2: id 7 is already line 1's"),
    ('{"messages": "hello"}\n', "line 1: \"messages\" must be a non-empty list"),
    ('{"prompt": "a", "grammar": "root ::= ("}\n', "line 1:"),
    ('{"prompt": "a", "logit_bias": {"1_000": 5}}\n', "line 1: logit_bias keys"),
    ('{"prompt": "a", "logit_bias": {" 12 ": 5}}\n', "line 1: logit_bias keys"),
    ('{"prompt": "a", "logit_bias": {"\u0661\u0662": 5}}\n', "line 1: logit_bias keys"),
    ('{"prompt": "a", "draft": "small.gguf"}\n', "line 1: \"draft\" is 'ngram'"),
    ('{"prompt": "a", "draft": "ngram", "grammar": "root ::= \\"a\\""}\n',
     "line 1: a line with a grammar or schema cannot draft"),
    ('{"prompt": "a", "draft_tokens": 0}\n', "line 1: draft_tokens must be an int >= 1"),
])
def test_bad_batch_lines_fail_before_any_work(tmp_path, capsys, content, message):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(content, encoding="utf-8")
    assert main(["batch", "-i", str(source), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "workbench: error:" in err and message in err, err
    assert not out.exists()


def test_batch_refuses_its_input_as_output(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "a"}\n', encoding="utf-8")
    assert main(["batch", "-i", str(source), "-o", str(source)]) == 1
    assert "must differ" in capsys.readouterr().err


def test_batch_refuses_its_input_hard_linked_as_output(tmp_path, capsys):
    """The same file under another name (a hard link) is the input too: it would read
    its own lines as answers ("4 of 4 lines already done") and answer nothing."""
    import os

    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": i, "prompt": "a"} for i in range(4)])
    before = source.read_bytes()
    os.link(source, out)
    assert main(["batch", "-i", str(source), "-o", str(out), "-m", "/no/such/model.gguf"]) == 1
    err = capsys.readouterr().err
    assert "must differ" in err and "already done" not in err, err
    assert source.read_bytes() == before


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_batch_refuses_an_output_that_is_not_a_regular_file(tmp_path, capsys, kind):
    """A FIFO as the output used to block the run forever (opening it waits for a
    reader); it, a directory or a device is refused with a one-line error."""
    import os
    import threading

    source, out = tmp_path / "in.jsonl", tmp_path / "out"
    _write_jsonl(source, [{"prompt": "a"}])
    if kind == "fifo":
        os.mkfifo(out)
    else:
        out.mkdir()
    result = []
    run = threading.Thread(target=lambda: result.append(
        main(["batch", "-i", str(source), "-o", str(out), "-m", "/no/such/model.gguf"])),
        daemon=True)
    run.start()
    run.join(10)
    if run.is_alive():  # blocked opening the FIFO: open its other end to let it go
        os.close(os.open(out, os.O_WRONLY | os.O_NONBLOCK))
        run.join(10)
        pytest.fail("workbench batch blocked on a FIFO output")
    err = capsys.readouterr().err
    assert result == [1], err
    assert "workbench: error:" in err and "not a regular file" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_read_done_drops_a_cut_line_and_failed_lines(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "text": "a"}\n{"id": "x", "error": "boom"}\n'
                   '{"id": 3, "text": "c"}\n{"id": 4, "te', encoding="utf-8")
    done, dropped = batch.read_done(out)
    assert done == {"1", '3'} and len(dropped) == 2
    assert out.read_text(encoding="utf-8") == '{"id": 1, "text": "a"}\n{"id": 3, "text": "c"}\n'
    assert batch.read_done(tmp_path / "missing.jsonl") == (set(), [])
    out.write_text('{"id": 1}\nnot json\n{"id": 2}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2: not a line of `workbench batch` output"):
        batch.read_done(out)


def test_batch_of_finished_lines_loads_no_model(tmp_path, capsys):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"prompt": "a"}, {"id": "b", "prompt": "b"}])
    _write_jsonl(out, [{"id": 1, "text": "x"}, {"id": "b", "text": "y"}])
    assert main(["batch", "-i", str(source), "-o", str(out), "-m", "/no/such/model.gguf"]) == 0
    assert "2 of 2 lines already done" in capsys.readouterr().err


def test_batch_per_line_options_and_a_line_that_fails(tmp_path, capsys, smollm2):
    """Per-line options override the flags; a line whose generation fails is recorded with
    its error (exit 1) and tried again by the next run."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [
        {"id": "a", "prompt": "The capital of France is", "max_tokens": 2},
        {"id": "b", "prompt": "The capital of France is", "stop": ["."]},
        {"id": "long", "prompt": "word " * 200}])
    assert main(["batch", "-i", str(source), "-o", str(out), "-t", "0", "-n", "6",
                 "--ctx", "64"]) == 1
    assert "1 of 3 lines failed" in capsys.readouterr().err
    records = {r["id"]: r for r in _read_jsonl(out)}
    assert records["a"]["text"] == smollm2.generate("The capital of France is", temperature=0,
                                                    max_tokens=2).text
    assert records["b"]["text"] == " Paris" and records["b"]["finish_reason"] == "stop"
    assert "context holds 64" in records["long"]["error"]
    assert main(["batch", "-i", str(source), "-o", str(out), "-t", "0", "--ctx", "64"]) == 1
    err = capsys.readouterr().err
    assert "2 of 3 lines already done" in err and "tried again" in err
    ids = [r["id"] for r in _read_jsonl(out)]  # (in the order the lines finished)
    assert sorted(ids[:2]) == ["a", "b"] and ids[2] == "long"


def test_batch_drafts_per_run_and_per_line(tmp_path, capsys, smollm2):
    """`--draft MODEL --draft-tokens N` drafts every line with that model unless the line
    says otherwise (`"draft": "ngram"`, null, its own `draft_tokens`); a constrained line
    decodes without the run's draft. Greedy answers are the model's own, and a line
    that drafted reports its drafted and accepted tokens."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompt = "Repeat: one two three four, one two three four, one two"
    _write_jsonl(source, [
        {"id": "run", "prompt": prompt},
        {"id": "ngram", "prompt": prompt, "draft": "ngram", "draft_tokens": 2},
        {"id": "none", "prompt": prompt, "draft": None},
        {"id": "json", "messages": [{"role": "user", "content": "A number?"}],
         "schema": {"type": "integer"}}])
    draft = str(smollm2.path)
    assert main(["batch", "-i", str(source), "-o", str(out), "-t", "0", "-n", "12", "-q",
                 "--draft", draft, "--draft-tokens", "3"]) == 0
    records = {r["id"]: r for r in _read_jsonl(out)}
    want = smollm2.generate(prompt, temperature=0, max_tokens=12).text
    assert [records[i]["text"] for i in ("run", "ngram", "none")] == [want] * 3
    assert records["run"]["usage"]["drafted_tokens"] > 0  # the same model: all kept
    assert records["run"]["usage"]["accepted_tokens"] == records["run"]["usage"][
        "drafted_tokens"]
    assert records["ngram"]["usage"]["drafted_tokens"] > 0
    assert "drafted_tokens" not in records["none"]["usage"]
    assert "drafted_tokens" not in records["json"]["usage"]
    assert isinstance(json.loads(records["json"]["text"]), int)
    source.write_text(json.dumps({"prompt": "a", "draft": draft}) + "\n", encoding="utf-8")
    assert main(["batch", "-i", str(source), "-o", str(tmp_path / "o2.jsonl"),
                 "--draft", "ngram"]) == 1  # a model the run did not name
    assert "\"draft\" is 'ngram' (prompt lookup) or null" in capsys.readouterr().err


PLAIN_PROMPTS = ["The capital of France is", "The capital of Japan is", "A haiku:"]


def test_batch_of_plain_text_prompts_writes_one_answer_per_line(tmp_path, capsys, smollm2,
                                                                monkeypatch):
    """binfer's `-i prompts.txt -o outputs.txt`: one prompt per line (blank lines skipped),
    one answer per line in the input's order; `--use-template` chats them; `-q` prints
    nothing while loading, `-v` the startup timing; `--no-cuda-graphs` sets the switch."""
    monkeypatch.setenv("WORKBENCH_CUDA_GRAPHS", "1")  # restored after the test
    source, out = tmp_path / "prompts.txt", tmp_path / "outputs.txt"
    source.write_text(f"{PLAIN_PROMPTS[0]}\n\n{PLAIN_PROMPTS[1]}\r\n{PLAIN_PROMPTS[2]}\n")
    assert not batch.is_jsonl(source)
    assert main(["batch", "-i", str(source), "-o", str(out), "-t", "0", "-n", "12", "-q",
                 "--no-cuda-graphs"]) == 0
    assert capsys.readouterr().err == "" and os.environ["WORKBENCH_CUDA_GRAPHS"] == "0"
    rows = out.read_text(encoding="utf-8").split("\n")
    want = [smollm2.generate(p, temperature=0, max_tokens=12).text for p in PLAIN_PROMPTS]
    assert rows == [batch.escape_line(w) for w in want] + [""]
    assert any("\n" in w for w in want) and all("\n" not in r for r in rows[:3])
    assert not (tmp_path / "outputs.txt.progress.jsonl").exists()

    chats = tmp_path / "chats.txt"
    assert main(["batch", "-i", str(source), "-o", str(chats), "-t", "0", "-n", "8",
                 "--use-template", "-v"]) == 0
    assert re.search(r"loaded on cpu in [0-9.]+ s; kernels ready", capsys.readouterr().err)
    want = [smollm2.chat([{"role": "user", "content": p}], temperature=0, max_tokens=8).text
            for p in PLAIN_PROMPTS]
    assert chats.read_text(encoding="utf-8").split("\n") == \
        [batch.escape_line(w) for w in want] + [""]
    assert batch.escape_line("a\\b\nc\rd") == "a\\\\b\\nc\\rd"
    with pytest.raises(ValueError, match="use-template is for plain text"):
        jsonl = tmp_path / "in.jsonl"
        _write_jsonl(jsonl, [{"prompt": "x"}])
        batch.run_file(lambda: smollm2, jsonl, tmp_path / "o.jsonl", DEFAULTS,
                       use_template=True)


# -- a JSON Schema of the Chrome trace-event format (the parts Perfetto reads) -------------
TRACE_SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {"type": "array", "items": {"oneOf": [
            {"type": "object",  # a complete event: a span
             "required": ["ph", "name", "ts", "dur", "pid", "tid"],
             "properties": {"ph": {"const": "X"}, "name": {"type": "string"},
                            "cat": {"type": "string"},
                            "ts": {"type": "number", "minimum": 0},
                            "dur": {"type": "number", "minimum": 0},
                            "pid": {"type": "integer"}, "tid": {"type": "integer"},
                            "args": {"type": "object"}}},
            {"type": "object",  # metadata: process and thread names
             "required": ["ph", "name", "pid", "args"],
             "properties": {"ph": {"const": "M"},
                            "name": {"enum": ["process_name", "thread_name",
                                              "process_sort_index", "thread_sort_index"]},
                            "pid": {"type": "integer"}, "tid": {"type": "integer"},
                            "args": {"type": "object", "required": ["name"],
                                     "properties": {"name": {"type": "string"}}}}},
        ]}},
    },
}


def test_generate_writes_a_chrome_trace(tmp_path, capsys):
    """--trace writes trace-event JSON (checked against the format's schema; the
    `perfetto` package's trace processor downloads its binary, so it cannot run offline)
    with spans of every phase, on the main and the scheduler threads, named."""
    trace = tmp_path / "t.json"
    assert main(["generate", "-t", "0", "-n", "4", "--trace", str(trace),
                 "The capital of France is"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(" Paris") and f"trace written to {trace}" in captured.err
    doc = json.loads(trace.read_text(encoding="utf-8"))
    jsonschema.validate(doc, TRACE_SCHEMA)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    assert {"load", "tokenize", "prefill", "decode", "sample", "detokenize", "token",
            "step"} <= names
    threads = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {e["tid"] for e in spans} <= set(threads)
    where = {e["name"]: threads[e["tid"]] for e in spans}
    assert where["tokenize"] == "MainThread" and where["decode"] == "workbench-scheduler"
    tokens = [e for e in spans if e["name"] == "token"]
    assert [e["args"]["id"] is not None for e in tokens] == [True] * 4
    steps = [e for e in spans if e["name"] == "step"]
    for d in (e for e in spans if e["name"] in ("decode", "prefill", "sample")):
        assert any(s["tid"] == d["tid"] and s["ts"] <= d["ts"]
                   and d["ts"] + d["dur"] <= s["ts"] + s["dur"] + 1e-3 for s in steps), d
    assert sum(e["args"]["tokens"] for e in spans if e["name"] == "prefill") == 5


def test_profile_prints_phases_and_tokens_per_second(capsys):
    assert main(["chat", "-t", "0", "-n", "5", "--profile", "What is 2 + 2?"]) == 0
    err = capsys.readouterr().err
    table = err[err.index("phase ") :]
    for phase in ("load", "tokenize", "chat_template", "prefill", "decode", "sample",
                  "detokenize", "wall"):
        assert f"\n{phase} " in table, table
    assert "prefill:" in table and "prompt tokens" in table
    assert re.search(r"decode: [1-5] generated tokens, [\d.]+ tok/s", table), table


def test_grammar_and_schema_files_constrain_the_output(tmp_path, capsys):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema), encoding="utf-8")
    assert main(["chat", "-t", "0", "-n", "24", "--schema", str(tmp_path / "s.json"),
                 "Is Paris in France? Answer in JSON."]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), schema)

    (tmp_path / "g.gbnf").write_text('root ::= ("red" | "green" | "blue") "!"\n',
                                     encoding="utf-8")
    assert main(["generate", "-t", "0", "-n", "8", "--grammar", str(tmp_path / "g.gbnf"),
                 "My favourite colour is"]) == 0
    assert capsys.readouterr().out.strip() in ("red!", "green!", "blue!")


@pytest.mark.parametrize("name, content, message", [
    ("missing.gbnf", None, "cannot read the grammar file"),
    ("bad.gbnf", 'root ::= ("a" | \n', "is not a valid grammar"),
    ("bad.json", "{not json", "is not JSON"),
    ("bad-schema.json", '{"type": "no such type"}', "is not a valid JSON Schema"),
])
def test_bad_grammar_or_schema_file_is_a_clean_error(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content, encoding="utf-8")
    flag = "--grammar" if name.endswith(".gbnf") else "--schema"
    assert main(["generate", flag, str(path), "hi"]) == 1
    err = capsys.readouterr().err
    assert message in err and str(path) in err and "Traceback" not in err, err


def test_device_flag(capsys):
    assert main(["generate", "--device", "cpu", "-t", "0", "-n", "1",
                 "The capital of France is"]) == 0
    assert capsys.readouterr().out == " Paris\n"
    assert main(["generate", "--device", "tpu", "hi"]) == 1
    assert "unknown device 'tpu'" in capsys.readouterr().err
    # --dtype (the device weights' format; tests/test_device.py runs it on the devices)
    assert main(["generate", "--device", "cpu", "--dtype", "bf16", "hi"]) == 1
    assert "the CPU engine runs the file's own formats" in capsys.readouterr().err


def test_transcribe_profile(tmp_path, capsys):
    """Whisper's phases: load, mel, encode, decode, detokenize."""
    import numpy as np
    import soundfile

    t = np.arange(16000 * 2) / 16000
    wav = tmp_path / "tone.wav"
    soundfile.write(wav, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000)
    assert main(["transcribe", "--profile", str(wav)]) == 0
    table = capsys.readouterr().err
    for phase in ("load", "mel", "encode", "decode", "detokenize"):
        assert f"\n{phase} " in table, table
