"""workbench: a Jupyter-first workbench for local AI inference.

    from workbench import LLM
    m = LLM.load("smollm2-135m")
    print(m.chat([{"role": "user", "content": "Hello!"}], temperature=0).text)

    from workbench import Encoder
    enc = Encoder.load("minilm-l6")
    print(enc.similarity("A man is eating food.", "Someone is having a meal."))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "Completion", "TokenEvent", "Encoder", "WhisperModel", "Transcript",
           "serve", "RemoteEngine", "Branch", "BranchStore", "PrefixCache", "Grammar",
           "parse_gbnf", "compile_schema", "UnsupportedSchemaError", "Closing",
           "ClosedEarlyWarning", "GrammarBudgetError", "validate_chat_template",
           "ChatTemplateError", "PrefixCacheError", "GGUFError", "AudioError", "Cancelled",
           "__version__"]
_GRAMMAR = ("Grammar", "parse_gbnf", "compile_schema", "UnsupportedSchemaError")
_ERRORS = {"GGUFError": "gguf", "AudioError": "audio", "Cancelled": "cancel"}  # name: module

# `workbench.serve` is the function (the package `workbench/serve/` holds it): binding it
# here, after the package is imported, keeps later submodule imports from rebinding it
from workbench.serve.runner import serve  # noqa: E402  (light: no server packages yet)

if TYPE_CHECKING:
    from workbench.engine.audio import AudioError
    from workbench.engine.branch import Branch, BranchStore
    from workbench.engine.cancel import Cancelled
    from workbench.engine.chat_template import ChatTemplateError, validate_chat_template
    from workbench.engine.closing import ClosedEarlyWarning, Closing, GrammarBudgetError
    from workbench.engine.encoder import Encoder
    from workbench.engine.gguf import GGUFError
    from workbench.engine.grammar import Grammar, UnsupportedSchemaError, compile_schema, parse_gbnf
    from workbench.engine.kv_cache import PrefixCache, PrefixCacheError
    from workbench.engine.llm import LLM, Completion, TokenEvent
    from workbench.engine.whisper import Transcript, WhisperModel
    from workbench.serve.remote import RemoteEngine


def __getattr__(name: str):
    # the engine imports NumPy and Numba; keep `import workbench` (and the CLI's
    # `pull`/`list`) light by loading it on first use
    if name in ("LLM", "Completion", "TokenEvent"):
        from workbench.engine import llm

        return getattr(llm, name)
    if name in ("WhisperModel", "Transcript"):
        from workbench.engine import whisper

        return getattr(whisper, name)
    if name in ("Branch", "BranchStore"):
        from workbench.engine import branch

        return getattr(branch, name)
    if name in ("Closing", "ClosedEarlyWarning", "GrammarBudgetError"):
        from workbench.engine import closing

        return getattr(closing, name)
    if name in ("PrefixCache", "PrefixCacheError"):
        from workbench.engine import kv_cache

        return getattr(kv_cache, name)
    if name in ("validate_chat_template", "ChatTemplateError"):
        from workbench.engine import chat_template

        return getattr(chat_template, name)
    if name in _ERRORS:
        import importlib

        return getattr(importlib.import_module(f"workbench.engine.{_ERRORS[name]}"), name)
    if name == "RemoteEngine":
        from workbench.serve.remote import RemoteEngine

        return RemoteEngine
    if name == "Encoder":
        from workbench.engine.encoder import Encoder

        return Encoder
    if name in _GRAMMAR:
        from workbench.engine import grammar

        return getattr(grammar, name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
