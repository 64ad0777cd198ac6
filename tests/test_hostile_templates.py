"""Chat templates that try to exhaust time or memory: each is refused with a
`ChatTemplateLimitError` naming the limit it hit, quickly and without a blowup, while real
templates (and long conversations) still render; a GGUF carrying such a template fails
at `LLM.load`.

The payloads run in one subprocess under RLIMIT_AS (so a guard that stops working fails
the test with a MemoryError instead of taking this machine's memory), which reports each
outcome, its time and the process's peak RSS as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from tests.support.byte_level import gpt2_alphabet
from tests.support.chat_templates import GEMMA_STYLE, LLAMA3_STYLE, MISTRAL_STYLE
from workbench.engine.text import chat_template, template_limits
from workbench.engine.text.chat_template import (
    CHATML,
    ChatTemplateError,
    ChatTemplateLimitError,
    check_template_limits,
    render,
)

# the limit each payload must hit -> name -> template: the audit's findings, loops and
# recursion, one operation making one huge string, growing containers, output
PAYLOADS_BY_LIMIT = {
    "steps": {
        "macro_fan_out": ("{% macro f(n) %}{% if n < 40 %}{{ f(n+1) }}{{ f(n+1) }}{% endif %}"
                          "{% endmacro %}{{ f(0) }}"),
        "nested_loops": ("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}"
                         "{% endfor %}"),
        "loop_over_long_string": ("{% set s = 'ab' * 400000 %}{% for a in s %}{% for b in s %}"
                                  "{% endfor %}{% endfor %}"),
        "copying_in_a_loop": ("{% set s = 'x' * 999999 %}{% for i in range(99999) %}"
                              "{% set t = s.upper() %}{% endfor %}"),
        "sum_of_lists": "{{ (range(99999)|batch(1)|list)|sum(start=[])|length }}",
        "macro_output": ("{% macro f() %}{% for i in range(100000) %}{{ 'x' * 999999 }}"
                         "{% endfor %}{% endmacro %}{{ f()|length }}"),
    },
    "size": {
        "concat_doubling": ("{% set s = namespace(v='x') %}{% for i in range(100000) %}"
                            "{% set s.v = s.v ~ s.v %}{% endfor %}{{ s.v }}"),
        "plus_doubling": ("{% set s = namespace(v='x') %}{% for i in range(100000) %}"
                          "{% set s.v = s.v + s.v %}{% endfor %}{{ s.v }}"),
        "center": "{{ 'x'|center(10**9) }}",
        "center_literal": "{{ 'x'|center(1000000000) }}",
        "tojson_indent": "{{ messages|tojson(indent=10**9) }}",
        "string_multiplication": "{{ 'x' * 999999 * 1000 }}",
        "huge_join": "{{ (['x' * 999999] * 1000)|join }}",
        "join_method": "{{ ''.join(['x' * 999999] * 1000) }}",
        "format_filter": "{{ '%999999999d'|format(1) }}",
        "percent_star": "{{ '%*d' % (999999999, 1) }}",
        "percent_precision": "{{ '%.999999999f' % 1.5 }}",
        "str_format": "{{ '{:>999999999}'.format(1) }}",
        "str_format_nested_width": "{{ '{:>{}}'.format(1, 999999999) }}",
        "ljust": "{{ 'x'.ljust(10**9) }}",
        "expandtabs": "{{ ('\t' * 99999).expandtabs(100000) }}",
        "indent": "{{ ('\n' * 999999)|indent(999999) }}",
        "replace_filter": "{{ ('x' * 999999)|replace('', 'y' * 999) }}",
        "replace_method": "{{ ('x' * 999999).replace('x', 'yy' * 999) }}",
        "wordwrap": "{{ ('x' * 999999)|wordwrap(1, wrapstring='y' * 1000) }}",
        "translate": "{{ ('x' * 999999).translate({120: 'y' * 9999}) }}",
        "batch_fill": "{{ [1]|batch(10**9, 0)|list|length }}",
        "list_repr": "{{ ['x' * 999999] * 1000 }}",
        "list_growth": ("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
                        "{% set ns.l = ns.l + ['x' * 1000] %}{% endfor %}{{ ns.l|length }}"),
        "list_doubling": ("{% set ns = namespace(l=['x' * 999999]) %}{% for i in range(30) %}"
                          "{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|sort|length }}"),
        "list_repetition_by_text": "{{ (['x' * 999999] * 1000)|sort|length }}",
        "filled_batch": "{{ ['x']|batch(1000, 'x' * 999999)|list|length }}",
        "shared_tuple_doubling": ("{% set ns = namespace(t=1) %}{% for i in range(100) %}"
                                  "{% set ns.t = (ns.t, ns.t) %}{% endfor %}{{ ns.t|tojson }}"),
        "dict_fromkeys": "{% set d = {}.fromkeys(range(99999), 'x' * 999999) %}{{ d }}",
        "set_block_doubling": ("{% set ns = namespace(v='x') %}{% for i in range(100) %}"
                               "{% set b %}{{ ns.v }}{{ ns.v }}{% endset %}{% set ns.v = b %}"
                               "{% endfor %}"),
    },
    "depth": {
        "deep_recursion": "{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}",
        "recursive_loop": "{% for x in [1] recursive %}{{ loop([x]) }}{% endfor %}",
    },
    "output": {
        "long_output": "{% for i in range(100000) %}{{ 'x' * 999 }}{% endfor %}",
    },
}
PAYLOADS = {name: (template, limit) for limit, group in PAYLOADS_BY_LIMIT.items()
            for name, template in group.items()}  # name -> (template, limit)

LIMIT_WORDS = {"steps": "step limit", "size": "size limit", "output": "output limit",
               "depth": "depth limit"}
MEMORY_LIMIT = 2 << 30  # the child's address space
TIME_BOUND_S = 5.0  # each payload took minutes before the limits; now well under a second

_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    from workbench.engine.text.chat_template import render, ChatTemplateLimitError
    payloads = json.loads(sys.stdin.read())
    results = {}
    for name, template in payloads.items():
        start = time.perf_counter()
        try:
            render(template, [{"role": "user", "content": "hi"}])
            outcome = {"error": None}
        except ChatTemplateLimitError as exc:
            outcome = {"error": type(exc).__name__, "limit": exc.limit, "message": str(exc)}
        except BaseException as exc:
            outcome = {"error": type(exc).__name__, "limit": None, "message": str(exc)[:300]}
        outcome["seconds"] = time.perf_counter() - start
        results[name] = outcome
    # a Python RecursionError (here before the template's own depth limit) is a limit too
    sys.setrecursionlimit(250)
    try:
        render("{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}", [])
        results["python_recursion"] = {"error": None}
    except ChatTemplateLimitError as exc:
        results["python_recursion"] = {"error": type(exc).__name__, "limit": exc.limit,
                                       "message": str(exc), "seconds": 0.0}
    # VmHWM, not ru_maxrss: ru_maxrss carries the forking parent's peak across exec
    hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
    maxrss_mb = int(hwm.split()[1]) / 1024
    print(json.dumps({"results": results, "maxrss_mb": maxrss_mb}))
""").replace("MEMORY_LIMIT", str(MEMORY_LIMIT))


@pytest.fixture(scope="module")
def outcomes():
    payloads = {name: template for name, (template, _) in PAYLOADS.items()}
    run = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(payloads),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_hostile_template_is_refused_naming_the_limit(outcomes, name):
    expected = PAYLOADS[name][1]
    outcome = outcomes["results"][name]
    assert outcome["error"] == "ChatTemplateLimitError", outcome
    assert outcome["limit"] == expected, outcome
    assert outcome["message"].startswith("chat template refused: ")
    assert LIMIT_WORDS[expected] in outcome["message"]
    assert outcome["seconds"] < TIME_BOUND_S, outcome


def test_python_recursion_error_becomes_a_depth_limit(outcomes):
    outcome = outcomes["results"]["python_recursion"]
    assert outcome["error"] == "ChatTemplateLimitError" and outcome["limit"] == "depth", outcome
    assert "recursed too deeply" in outcome["message"]


def test_hostile_templates_take_little_memory(outcomes):
    # every payload together, in the child's lifetime: nothing near the gigabytes they
    # took before (the child starts at about 40 MB)
    assert outcomes["maxrss_mb"] < 400, outcomes["maxrss_mb"]


def test_time_limit_backs_up_the_step_count(monkeypatch):
    # each step scans a megabyte in C, which no step count sees
    monkeypatch.setattr(template_limits, "TIME_LIMIT_S", 0.3)
    template = ("{% set s = 'x' * 999999 %}{% for i in range(99999) %}{% if 'y' in s %}"
                "{% endif %}{% endfor %}")
    start = time.perf_counter()
    with pytest.raises(ChatTemplateLimitError, match="time limit") as info:
        render(template, [])
    assert info.value.limit == "time" and time.perf_counter() - start < 3


def test_limit_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError) as info:
        render(PAYLOADS["nested_loops"][0], [])
    assert isinstance(info.value, ValueError) and isinstance(info.value, ChatTemplateLimitError)
    assert info.value.limit == "steps"


def test_the_tracer_in_place_before_is_restored():
    def outer_tracer(frame, event, arg):
        return None

    previous = sys.gettrace()
    sys.settrace(outer_tracer)
    try:
        render(CHATML, [{"role": "user", "content": "hi"}])
        with pytest.raises(ChatTemplateLimitError):
            render(PAYLOADS["deep_recursion"][0], [])
        assert sys.gettrace() is outer_tracer
    finally:
        sys.settrace(previous)


def test_limits_hold_in_other_threads():
    errors = []

    def worker():
        try:
            render(PAYLOADS["macro_fan_out"][0], [])
        except ChatTemplateLimitError as exc:
            errors.append(exc.limit)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == ["steps", "steps"]


# --- the limits leave room for real work --------------------------------------------------------

def test_limits_scale_with_the_conversation():
    # 3000 turns take ~300k steps, past STEP_LIMIT alone; 3 MB of content makes 3 MB of
    # output, past SIZE_LIMIT alone
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
             for i in range(3000)]
    assert render(chat_template.GEMMA, turns).count("<start_of_turn>") == 3001
    big = "word " * 600_000
    out = render(CHATML, [{"role": "user", "content": big}])
    assert len(out) > template_limits.SIZE_LIMIT and big in out


def test_variables_that_hold_themselves_are_measured_once():
    looped = {"name": "x"}
    looped["self"] = looped
    assert render("{{ messages|length }}{{ looped.name }}", [{"role": "user", "content": "hi"}],
                  looped=looped) == "1x"


def test_building_a_list_turn_by_turn_stays_cheap():
    # `list.append` is refused, so templates grow lists with `+`; each list's measure is
    # kept, so this is linear, not quadratic
    template = ("{% set ns = namespace(l=[]) %}{% for m in messages %}"
                "{% set ns.l = ns.l + [{'role': m.role, 'content': m.content}] %}{% endfor %}"
                "{{ ns.l|length }}")
    turns = [{"role": "user", "content": f"turn {i}"} for i in range(2000)]
    start = time.perf_counter()
    assert render(template, turns) == "2000"
    assert time.perf_counter() - start < 3


def test_small_repetition_and_formatting_still_work():
    msgs = [{"role": "user", "content": "hi"}]
    assert render("{{ '=' * 3 }}{{ 'ab'|center(6) }}{{ '%5.1f' % 2.25 }}"
                  "{{ '{:>4}'.format(7) }}{{ [1, 2] + [3] }}{{ ('a', 'b')|join('-') }}"
                  "{{ messages|tojson(indent=1) }}", msgs) == (
        "===  ab    2.2   7[1, 2, 3]a-b" + json.dumps(msgs, indent=1))


# --- the check at load time ---------------------------------------------------------------------

SYSTEMLESS = ("{% for m in messages %}{% if m.role == 'system' %}"
              "{{ raise_exception('System role not supported') }}{% endif %}"
              "<{{ m.role }}>{{ m.content }}{% endfor %}")


@pytest.mark.parametrize("template", [
    CHATML, chat_template.GEMMA, SYSTEMLESS,
    "{{ raise_exception('always refuses') }}",  # left for chat time to report
    "{% if %}",  # likewise
], ids=["chatml", "gemma", "systemless", "always_raises", "syntax_error"])
def test_load_check_passes_templates_within_limits(template):
    check_template_limits(template)


def test_load_check_passes_the_family_templates():
    for template in (LLAMA3_STYLE, GEMMA_STYLE, MISTRAL_STYLE):
        check_template_limits(template)


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_load_check_passes_the_real_models_templates(alias):
    from workbench.engine.formats import sources
    from workbench.engine.formats.gguf import open_gguf

    template = open_gguf(sources.resolve(alias)).get("tokenizer.chat_template")
    assert template
    check_template_limits(template)


@pytest.mark.parametrize("name", ["macro_fan_out", "concat_doubling", "center", "tojson_indent"])
def test_load_check_refuses_hostile_templates(name):
    start = time.perf_counter()
    with pytest.raises(ChatTemplateLimitError, match=LIMIT_WORDS[PAYLOADS[name][1]]):
        check_template_limits(PAYLOADS[name][0])
    assert time.perf_counter() - start < TIME_BOUND_S


def test_load_check_sees_a_blowup_behind_another_shapes_raise_exception():
    # refuses the system-first conversation, then loops forever on the others
    template = SYSTEMLESS + ("{% for a in range(99999) %}{% for b in range(99999) %}"
                             "{% endfor %}{% endfor %}")
    with pytest.raises(ChatTemplateLimitError, match="step limit"):
        check_template_limits(template)


# --- a GGUF carrying a hostile template ----------------------------------------------------------

def _write_tiny_llama(path, template: str) -> None:
    """A one-layer llama with random weights, a byte-level vocabulary and `template`."""
    import gguf

    tokens = [bytes([b]).decode("latin-1") for b in range(256)] + ["ab", "<|im_start|>",
                                                                     "<|im_end|>"]
    V, D, F, H = len(tokens), 16, 32, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-hostile-template")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(H)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(D // H)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(_byte_level(tokens))
    w.add_token_types([1] * 257 + [3, 3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(V - 1)
    w.add_eos_token_id(V - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(template)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D),
              "blk.0.attn_norm.weight": (D,), "blk.0.ffn_norm.weight": (D,),
              "blk.0.attn_q.weight": (D, D), "blk.0.attn_k.weight": (D, D),
              "blk.0.attn_v.weight": (D, D), "blk.0.attn_output.weight": (D, D),
              "blk.0.ffn_gate.weight": (F, D), "blk.0.ffn_up.weight": (F, D),
              "blk.0.ffn_down.weight": (D, F)}
    for name, shape in shapes.items():
        w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _byte_level(tokens: list[str]) -> list[str]:
    """GPT-2's printable stand-ins for the byte tokens (special tokens kept as they are)."""
    alphabet = gpt2_alphabet()
    return [alphabet[i] if i < 256 else t for i, t in enumerate(tokens)]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    def write(template: str):
        path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
        _write_tiny_llama(path, template)
        return path

    return write


def test_llm_load_refuses_a_gguf_with_a_hostile_template(tiny_gguf):
    from workbench import LLM

    path = tiny_gguf(PAYLOADS["macro_fan_out"][0])
    start = time.perf_counter()
    with pytest.raises(ChatTemplateLimitError, match="step limit"):
        LLM.load(str(path), device="cpu", prepare_kernels=False)
    assert time.perf_counter() - start < 10


def test_llm_with_a_benign_template_loads_and_chat_time_uses_the_same_limits(tiny_gguf):
    from workbench import LLM

    with LLM.load(str(tiny_gguf(CHATML)), device="cpu", prepare_kernels=False) as m:
        msgs = [{"role": "user", "content": "hi"}]
        assert m.apply_chat_template(msgs) == render(CHATML, msgs)
        with pytest.raises(ChatTemplateLimitError, match="size limit"):
            m.apply_chat_template(msgs, chat_template=PAYLOADS["center"][0])
