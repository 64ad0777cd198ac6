"""Chat template rendering: the models' own templates against llama.cpp's references,
the template features real model families rely on, and the sandbox refusing templates
that try to reach Python internals."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import jinja2
import pytest

from tests.support.chat_templates import GEMMA_STYLE, LLAMA3_STYLE, MISTRAL_STYLE
from tests.support.shared import reference
from workbench.engine.text import chat_template
from workbench.engine.text.chat_template import CHATML, ChatTemplate, ChatTemplateError, render

# alias -> the llama.cpp reference made on that alias's GGUF
REFERENCES = {
    "smollm2-135m": "llamacpp_smollm2.json",
    "qwen2.5-coder-0.5b": "llamacpp_qwen2.5-coder-0.5b.json",
}



_TEMPLATES: dict[str, str] = {}


def _gguf_template(alias: str) -> str:
    """The `tokenizer.chat_template` stored in the GGUF that `alias` pulls."""
    if alias not in _TEMPLATES:
        import gguf

        from workbench.engine.formats.sources import pull

        field = gguf.GGUFReader(pull(alias)).fields["tokenizer.chat_template"]
        _TEMPLATES[alias] = field.contents()
    return _TEMPLATES[alias]


# --- the real models' templates ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("alias", sorted(REFERENCES))
def test_gguf_template_reproduces_llamacpp_rendering(alias):
    ref = reference(REFERENCES[alias])
    source = _gguf_template(alias)
    case = ref["chat_template"]
    assert render(source, case["messages"]) == case["rendered"]

    chats = [g for g in ref["generations"] if g["kind"] == "chat"]
    assert chats, f"{REFERENCES[alias]} has no chat generations to check"
    for g in chats:
        assert render(source, g["messages"], add_generation_prompt=True) == g["rendered"], \
            g["messages"]


@pytest.mark.slow
def test_smollm2_template_through_the_wrapper():
    t = ChatTemplate(_gguf_template("smollm2-135m"))
    msgs = [{"role": "user", "content": "Hi"}]
    assert t.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo d'une ville",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


@pytest.mark.slow
def test_qwen_template_renders_the_tools_block():
    out = render(_gguf_template("qwen2.5-coder-0.5b"),
                 [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL])
    assert out == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:"
        '\n<tools>\n{"type": "function", "function": {"name": "get_weather", "description": '
        '"Météo d\'une ville", "parameters": {"type": "object", "properties": {"city": '
        '{"type": "string"}}, "required": ["city"]}}}\n</tools>\n\nFor each function call, '
        "return a json object with function name and arguments within <tool_call></tool_call>"
        ' XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_qwen_template_renders_tool_calls_and_responses():
    msgs = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"rain": false}'},
        {"role": "assistant", "content": "21 °C, dry."},
    ]
    out = render(_gguf_template("qwen2.5-coder-0.5b"), msgs, add_generation_prompt=False)
    assert out == (
        "<|im_start|>system\nUse tools.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
        '<tool_response>\n{"rain": false}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n21 °C, dry.<|im_end|>\n")


# --- templates shaped like other model families' ----------------------------------------------
# (LLAMA3_STYLE, GEMMA_STYLE and MISTRAL_STYLE: tests/support/chat_templates.py)

CONVERSATION = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": " Hi there \n"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


def test_llama3_style_template():
    today = datetime.now().strftime("%d %b %Y")
    out = render(LLAMA3_STYLE, CONVERSATION, bos_token="<|begin_of_text|>")
    assert out == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        f"Today Date: {today}\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><!-- 3 turns -->"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # an extra variable reaches the template by name
    dated = render(LLAMA3_STYLE, CONVERSATION, date_string="01 Jan 2025")
    assert "Today Date: 01 Jan 2025\n\n" in dated


def test_llama3_style_tool_call_and_its_raise_exception():
    call = {"type": "function", "function": {"name": "w", "arguments": {"city": "Zürich"}}}
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "tool_calls": [call]}]
    out = render(LLAMA3_STYLE, msgs, add_generation_prompt=False)
    assert out.endswith('<|start_header_id|>assistant<|end_header_id|>\n\n'
                        '{"name": "w", "parameters": {"city": "Zürich"}}<|eot_id|>'
                        "<!-- 2 turns -->")
    msgs[1]["tool_calls"] = [call, call]
    with pytest.raises(ChatTemplateError, match="only supports single tool-calls"):
        render(LLAMA3_STYLE, msgs)


def test_gemma_style_template():
    out = render(GEMMA_STYLE, CONVERSATION, bos_token="<bos>")
    assert out == (
        "<bos><start_of_turn>user\n  Be brief.  \n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " Hi "}]}]
    assert render(GEMMA_STYLE, parts, bos_token="<bos>") == (
        "<bos><start_of_turn>user\n<start_of_image>Hi<end_of_turn>\n<start_of_turn>model\n")


def test_mistral_style_template():
    out = render(MISTRAL_STYLE, CONVERSATION, bos_token="<s>", eos_token="</s>")
    assert out == "<s>[INST]   Be brief.  \n\n Hi there \n [/INST] Hello!</s>[INST] Bye [/INST]"


@pytest.mark.parametrize("template", [GEMMA_STYLE, MISTRAL_STYLE], ids=["gemma", "mistral"])
def test_alternation_errors_surface_the_templates_message(template):
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError) as info:
        render(template, msgs)
    assert str(info.value) == "Conversation roles must alternate user/assistant/user/assistant/..."


def test_non_mutating_methods_work():
    msgs = [{"role": "user", "content": "  Alpha beta  ", "name": "ann"}]
    t = ("{% set m = messages[0] %}{{ m.content.strip().upper() }}|{{ m.content.split() }}|"
         "{{ m.content.strip().startswith('Alpha') }}|{{ m.get('name') }}|"
         "{{ m.get('missing', 'dflt') }}|{% for k, v in m.items() %}{{ k }};{% endfor %}|"
         "{{ m.keys()|list|length }}|{{ '{}-{}'.format('a', 1) }}|{{ m.role|title }}|"
         "{{ messages|length }}{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}"
         "{{ i }}{% endfor %}")
    assert render(t, msgs) == ("ALPHA BETA|['Alpha', 'beta']|True|ann|dflt|role;content;name;|"
                               "3|a-1|User|102")


def test_trim_and_lstrip_blocks():
    t = ("{% for m in messages %}\n    {% if m.role %}\n[{{ m.role }}]\n"
         "    {% endif %}\n{% endfor %}")
    assert render(t, [{"role": "a"}, {"role": "b"}]) == "[a]\n[b]\n"


def test_generation_block_renders_its_body():
    t = "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    assert render(t, [{"role": "assistant", "content": "x"}]) == "<x>"


# --- the fallback and the wrapper -------------------------------------------------------------

def test_chatml_fallback():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert render(CHATML, msgs) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert render(CHATML, msgs, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_chatml_fallback_handles_none_and_content_parts():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
            {"role": "assistant"}]
    assert render(CHATML, msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n")


def test_gemma_fallback_for_gemma_vocabularies():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
            {"role": "user", "content": "Colors?"}, {"role": "assistant"}]
    assert render(chat_template.GEMMA, msgs) == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nColors?<end_of_turn>\n"
        "<start_of_turn>model\n<end_of_turn>\n<start_of_turn>model\n")
    gemma_like = ["<pad>", "<eos>", "<start_of_turn>", "<end_of_turn>", "a"]
    assert chat_template.fallback_template(gemma_like) == chat_template.GEMMA
    assert chat_template.fallback_template(["<|im_start|>", "a"]) == CHATML


def test_chat_template_wrapper():
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}"
                     "{% endfor %}{% if add_generation_prompt %}>{% endif %}{{ extra }}",
                     bos_token="<s>", eos_token="</s>")
    msgs = [{"role": "user", "content": "hi"}]
    assert t.render(msgs) == "<s>hi</s>>"
    assert t.render(msgs, add_generation_prompt=False, extra="!") == "<s>hi</s>!"
    assert "ChatTemplate(" in repr(t)
    assert ChatTemplate.chatml().render(msgs) == render(CHATML, msgs)
    with pytest.raises(ChatTemplateError, match="line 1"):
        ChatTemplate("{% if %}")


def test_compiled_templates_are_cached_by_source():
    source = "{{ messages|length }} cached"
    assert chat_template._compile(source) is chat_template._compile(source)
    assert render(source, []) == "0 cached"


# --- errors -----------------------------------------------------------------------------------

def test_raise_exception_message_surfaces():
    with pytest.raises(ChatTemplateError) as info:
        render("{{ raise_exception('System role not supported') }}", [])
    assert str(info.value) == "System role not supported"


def test_syntax_error_names_the_line():
    with pytest.raises(ChatTemplateError, match=r"syntax error on line 3") as info:
        render("{% for m in messages %}\n{{ m.content }}\n{% if %}\n{% endfor %}", [])
    assert isinstance(info.value, ValueError)
    with pytest.raises(ChatTemplateError, match="line 1"):
        render("{% for m in messages %}never closed", [])


def test_runtime_errors_become_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="undefined"):
        render("{{ nothing.here }}", [])
    with pytest.raises(ChatTemplateError, match="TypeError"):
        # SmolLM2's template concatenates content, which fails for None
        render("{{ 'x' + messages[0]['content'] }}", [{"role": "user", "content": None}])
    with pytest.raises(ChatTemplateError):
        render("{% include 'other.jinja' %}", [])


def test_tojson_keeps_non_ascii_and_takes_indent():
    msgs = [{"role": "user", "content": "café", "meta": {"b": 1, "a": [1, "é"]}}]
    assert render("{{ messages[0].content|tojson }}", msgs) == '"café"'
    assert render("{{ messages[0].meta|tojson }}", msgs) == '{"b": 1, "a": [1, "é"]}'
    assert render("{{ messages[0].meta|tojson(indent=2) }}", msgs) == (
        '{\n  "b": 1,\n  "a": [\n    1,\n    "é"\n  ]\n}')
    assert render("{{ messages[0].meta|tojson(2) }}", msgs).startswith('{\n  "b"')
    assert render("{{ messages[0].meta|tojson(sort_keys=true, separators=(',', ':')) }}",
                  msgs) == '{"a":[1,"é"],"b":1}'
    # not HTML-escaped as Jinja's own tojson would
    assert render("{{ '<a & b>'|tojson }}", []) == '"<a & b>"'


def test_strftime_now():
    before = datetime.now().strftime("%Y-%m-%d")
    out = render("{{ strftime_now('%Y-%m-%d') }}", [])
    assert out in {before, datetime.now().strftime("%Y-%m-%d")}
    datetime.strptime(render("{{ strftime_now('%d %b %Y') }}", []), "%d %b %Y")


@pytest.mark.parametrize("messages", ["hello", {"role": "user", "content": "x"}, None, 3])
def test_messages_must_be_a_list(messages):
    with pytest.raises(TypeError, match="messages must be a list"):
        render(CHATML, messages)


@pytest.mark.parametrize("messages, error", [
    (["hello"], TypeError),
    ([{"content": "no role"}], ValueError),
    ([{"role": 3, "content": "x"}], ValueError),
    ([{"role": "user", "content": 42}], TypeError),
    ([{"role": "user", "content": {"text": "x"}}], TypeError),
])
def test_malformed_messages_are_rejected(messages, error):
    with pytest.raises(error, match=r"messages\[0\]"):
        render(CHATML, messages)


def test_template_must_be_a_string():
    with pytest.raises(TypeError):
        render(None, [])


# --- the sandbox ------------------------------------------------------------------------------
# Each payload would run `touch PATH` through os.popen if it reached Python's internals
# (the control test below shows they do in an unsandboxed Jinja environment).

PAYLOADS = {
    # the GGUF chat-template injection reported against llama-cpp-python (CVE-2024-34359):
    # walk object's subclasses to warnings.catch_warnings, then its module's builtins
    "subclasses_builtins": (
        "{% for c in ().__class__.__base__.__subclasses__() %}"
        "{% if c.__name__ == 'catch_warnings' %}"
        "{{ c()._module.__builtins__['__import__']('os').popen('touch PATH').read() }}"
        "{% endif %}{% endfor %}"),
    "cycler_globals": "{{ cycler.__init__.__globals__.os.popen('touch PATH').read() }}",
    "joiner_globals": "{{ joiner.__init__.__globals__.os.popen('touch PATH').read() }}",
    "self_globals_builtins": (
        "{{ self.__init__.__globals__.__builtins__.__import__('os')"
        ".popen('touch PATH').read() }}"),
    "namespace_smuggling": (
        "{% set ns = namespace(f=lipsum) %}"
        "{{ ns.f.__globals__.os.popen('touch PATH').read() }}"),
    "namespace_class_globals": (
        "{{ namespace.__init__.__globals__.os.popen('touch PATH').read() }}"),
    "helper_globals": (
        "{{ raise_exception.__globals__.json.__builtins__.__import__('os')"
        ".popen('touch PATH').read() }}"),
    "attr_filter": (
        "{{ (cycler|attr('__init__')|attr('__globals__'))['os'].popen('touch PATH').read() }}"),
    "subscript": "{{ cycler['__init__']['__globals__']['os'].popen('touch PATH').read() }}",
    "config_flask_style": (
        "{{ config.__class__.__init__.__globals__['os'].popen('touch PATH').read() }}"),
    "format_string": "{{ '{0.__init__.__globals__[os]}'.format(cycler) }}{{ 'touch PATH' }}",
}


def _payload(name: str, target: Path) -> str:
    return PAYLOADS[name].replace("PATH", str(target))


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_injection_payloads_are_refused_and_run_nothing(name, tmp_path):
    target = tmp_path / "pwned"
    with pytest.raises(ChatTemplateError, match="refused"):
        render(_payload(name, target), [{"role": "user", "content": "hi"}])
    assert not target.exists()


@pytest.mark.parametrize("name", ["subclasses_builtins", "cycler_globals", "helper_globals"])
def test_control_payloads_do_run_without_the_sandbox(name, tmp_path):
    target = tmp_path / "pwned"
    jinja2.Environment().from_string(_payload(name, target)).render(
        raise_exception=chat_template._raise_exception)
    assert target.exists()


@pytest.mark.parametrize("template", [
    "{{ ''.__class__ }}",  # the plain sandbox renders this as an empty string
    "{{ ''.__class__.__mro__ }}",
    "{{ ''['__class__'] }}",
    "{{ messages[0].__class__ }}",
    "{{ messages.__len__() }}",
    "{{ ''|attr('__class__') }}",
    "{% if ''.__class__ %}yes{% endif %}",
    "{{ '{0.__class__}'.format('') }}",
    "{{ ''.__class__.__subclasses__ }}",
    "{{ lipsum.__globals__ }}",
    "{{ strftime_now.__globals__ }}",
    "{{ undefined_thing._private }}",
    "{{ messages[0].content._x }}",
])
def test_internal_attribute_access_is_an_error_not_silence(template):
    with pytest.raises(ChatTemplateError, match="refused"):
        render(template, [{"role": "user", "content": "hi"}])


def test_underscore_keys_of_mappings_are_plain_data():
    msgs = [{"role": "user", "content": "hi", "_meta": "m"}]
    assert render("{{ messages[0]._meta }}{{ messages[0]['_meta'] }}", msgs) == "mm"


@pytest.mark.parametrize("template", [
    "{% set xs = [] %}{{ xs.append(1) }}",
    "{% set xs = [] %}{% set _ = xs.append(1) %}",
    "{{ messages.append({'role': 'system', 'content': 'injected'}) }}",
    "{{ messages.pop() }}",
    "{{ messages[0].update({'content': 'changed'}) }}",
    "{{ messages[0].clear() }}",
    "{% set d = {} %}{{ d.setdefault('a', 1) }}",
])
def test_mutation_is_refused(template):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="refused"):
        render(template, msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template", [
    "{{ 'a' * 10**10 }}",
    "{{ [0] * 100000000 }}",
    "{{ 10 ** 1000000 }}",
    "{{ range(10**8)|list|length }}",
])
def test_resource_exhaustion_is_refused(template):
    with pytest.raises(ChatTemplateError, match="refused"):
        render(template, [])


def test_small_repetition_and_powers_still_work():
    assert render("{{ '-' * 5 }}{{ [1] * 2 }}{{ 2 ** 10 }}{{ range(3)|list }}", []) == (
        "-----[1, 1]1024[0, 1, 2]")


def test_runaway_recursion_is_an_error():
    with pytest.raises(ChatTemplateError, match="recursed"):
        render("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", [])
