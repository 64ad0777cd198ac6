"""workbench: a Jupyter-first workbench for local AI inference.

    from workbench import LLM
    m = LLM.load("smollm2-135m")
    print(m.chat([{"role": "user", "content": "Hello!"}], temperature=0).text)

    from workbench import Encoder
    enc = Encoder.load("minilm-l6")
    print(enc.similarity("A man is eating food.", "Someone is having a meal."))
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from workbench.version import __version__

# NumPy's OpenBLAS (the matrix products of long prompts) keeps its threads spinning for
# 2^28 cycles (~0.1 s) after each call, and the Numba kernels run next (decoding, short
# prompts) wait for the cores those threads hold: on 2 cores a decode step right after
# a prompt took 50 ms instead of 5, and 8 streaming clients got 15-20% fewer tokens/s.
# 2^16 cycles (~25 us) cost long prompts nothing measurable. OpenBLAS reads this once,
# when NumPy loads, so it only acts where workbench is imported first (the CLI, the
# server, `workbench lab`'s kernels, a script that imports workbench before NumPy); a
# value already in the environment is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")

__all__ = ["LLM", "Completion", "TokenEvent", "GenerationOptions", "Encoder", "WhisperModel",
           "Transcript", "serve", "RemoteEngine", "Branch", "BranchStore", "PrefixCache",
           "Grammar", "parse_gbnf", "compile_schema", "UnsupportedSchemaError", "Closing",
           "ClosedEarlyWarning", "GrammarBudgetError", "validate_chat_template",
           "ChatTemplateError", "PrefixCacheError", "GGUFError", "AudioError", "Cancelled",
           "pull", "__version__"]
# name: the module that defines it, imported on first use: the engine imports NumPy and
# Numba, and `import workbench` (and the CLI's `pull`/`list`) should stay light
_LAZY = {
    "LLM": "engine.llm",
    "Completion": "engine.results", "TokenEvent": "engine.results",
    "Transcript": "engine.results",
    "GenerationOptions": "engine.options",
    "Encoder": "engine.encoder",
    "WhisperModel": "engine.whisper",
    "Branch": "engine.branch", "BranchStore": "engine.branch",
    "Closing": "engine.closing", "ClosedEarlyWarning": "engine.closing",
    "GrammarBudgetError": "engine.closing",
    "PrefixCache": "engine.prefix_cache", "PrefixCacheError": "engine.prefix_cache",
    "validate_chat_template": "engine.chat_template", "ChatTemplateError": "engine.chat_template",
    "Grammar": "engine.grammar", "parse_gbnf": "engine.grammar",
    "compile_schema": "engine.grammar", "UnsupportedSchemaError": "engine.grammar",
    "GGUFError": "engine.gguf", "AudioError": "engine.audio", "Cancelled": "engine.cancel",
    "RemoteEngine": "server.remote",
    "pull": "engine.sources",
}

# the server's packages (FastAPI, uvicorn) load when `serve` is called, not here
from workbench.server.runner import serve  # noqa: E402

if TYPE_CHECKING:
    from workbench.engine.audio import AudioError
    from workbench.engine.branch import Branch, BranchStore
    from workbench.engine.cancel import Cancelled
    from workbench.engine.chat_template import ChatTemplateError, validate_chat_template
    from workbench.engine.closing import ClosedEarlyWarning, Closing, GrammarBudgetError
    from workbench.engine.encoder import Encoder
    from workbench.engine.gguf import GGUFError
    from workbench.engine.grammar import Grammar, UnsupportedSchemaError, compile_schema, parse_gbnf
    from workbench.engine.llm import LLM
    from workbench.engine.options import GenerationOptions
    from workbench.engine.prefix_cache import PrefixCache, PrefixCacheError
    from workbench.engine.results import Completion, TokenEvent, Transcript
    from workbench.engine.sources import pull
    from workbench.engine.whisper import WhisperModel
    from workbench.server.remote import RemoteEngine


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"workbench.{_LAZY[name]}"), name)
