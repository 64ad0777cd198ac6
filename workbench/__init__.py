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
import sys
from typing import TYPE_CHECKING

from workbench.version import __version__

# How the thread pools of NumPy's OpenBLAS and of Numba's OpenMP layer (libgomp) wait
# between parallel calls. They read these variables once, when they load, so they act
# where workbench is imported before NumPy and before any Numba kernel runs (the CLI,
# the server, `workbench lab`'s kernels, a script or notebook that imports workbench
# first); a value already in the environment is kept. Measured on 2 cores:
# - OpenBLAS (long prompts' matrix products) keeps its threads spinning 2^28 cycles
#   (~0.1 s) after each call, and the Numba kernels that follow (decoding, short
#   prompts) wait for the cores they hold: a decode step right after a prompt took
#   50 ms instead of 5, and 8 streaming clients got 15-20% fewer tokens/s. 2^16 cycles
#   (~25 us) cost long prompts nothing measurable.
# - libgomp gives each thread that starts parallel regions its own team of threads, and
#   once there are more of them than cores it cuts their spinning to a few cycles, so
#   every region then wakes a sleeping thread: ~20 us instead of ~1 us a region. LLM
#   decode steps (over a hundred regions each) on the scheduler's thread took 16 ms
#   instead of 7 once the notebook's own thread had run `m.embed(...)`.
#   OMP_WAIT_POLICY=active with a GOMP_SPINCOUNT keeps libgomp's usual spin (300,000
#   pauses, then sleep) in that case too; idle pools still use no CPU. The price: two
#   threads decoding at the same moment made 105 steps/s together instead of 152 (the
#   spinning teams share 2 cores), which is rarer and lasts only while both run.
#   LLVM's and Intel's OpenMP (MKL builds of NumPy) would read "active" as "spin
#   forever": KMP_BLOCKTIME keeps their default of 200 ms.
# (Where NumPy came first, the timeout comes too late: `cores.quiet_blas` then keeps
# OpenBLAS to one thread while the Numba kernels run parallel regions on few rows.)
if "numpy" in sys.modules and "OPENBLAS_THREAD_TIMEOUT" not in os.environ:
    from workbench.engine.runtime import cores as _cores

    _cores.blas_loaded_first()
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ.update(OMP_WAIT_POLICY="active", GOMP_SPINCOUNT="300000")
    os.environ.setdefault("KMP_BLOCKTIME", "200")

__all__ = ["LLM", "Completion", "TokenEvent", "GenerationOptions", "Encoder", "WhisperModel",
           "Transcript", "serve", "RemoteEngine", "Branch", "BranchStore", "PrefixCache",
           "Grammar", "parse_gbnf", "compile_schema", "UnsupportedSchemaError", "Closing",
           "ClosedEarlyWarning", "GrammarBudgetError", "validate_chat_template",
           "ChatTemplateError", "PrefixCacheError", "GGUFError", "AudioError", "Cancelled",
           "Trace", "TraceTooLargeError", "ContextFullError", "IncompleteOutputError",
           "TooManyTokensError", "GrammarError", "WhisperFileError", "DeviceUnavailableError",
           "UnsupportedArchitectureError", "TruncationWarning", "ModelNotFoundError",
           "PullError",
           "pull", "register_alias", "unregister_alias", "resolve_alias", "architectures",
           "__version__"]
# name: the module that defines it, imported on first use: the engine imports NumPy and
# Numba, and `import workbench` (and the CLI's `pull`/`list`) should stay light
_LAZY = {
    "LLM": "engine.llm",
    "Completion": "engine.results", "TokenEvent": "engine.results",
    "Transcript": "engine.results",
    "GenerationOptions": "engine.options",
    "Encoder": "engine.encoder",
    "WhisperModel": "engine.whisper",
    "Branch": "engine.explore.branch", "BranchStore": "engine.explore.branch",
    "Closing": "engine.decoding.closing", "ClosedEarlyWarning": "engine.decoding.closing",
    "GrammarBudgetError": "engine.decoding.closing",
    "PrefixCache": "engine.runtime.prefix_cache",
    "PrefixCacheError": "engine.runtime.prefix_cache",
    "validate_chat_template": "engine.text.chat_template",
    "ChatTemplateError": "engine.text.chat_template",
    "Grammar": "engine.decoding.grammar", "parse_gbnf": "engine.decoding.grammar",
    "compile_schema": "engine.decoding.grammar",
    "UnsupportedSchemaError": "engine.decoding.grammar",
    "GGUFError": "engine.formats.gguf", "AudioError": "engine.audio.pcm",
    "Cancelled": "engine.cancel",
    "Trace": "engine.models.trace", "TraceTooLargeError": "engine.models.trace",
    "ContextFullError": "engine.runtime.kv_cache",
    "IncompleteOutputError": "engine.results", "TooManyTokensError": "engine.results",
    "GrammarError": "engine.decoding.grammar",
    "WhisperFileError": "engine.formats.whisper_file",
    "DeviceUnavailableError": "engine.runtime.backend",
    "UnsupportedArchitectureError": "engine.formats.gguf",
    "TruncationWarning": "engine.encoder",
    "RemoteEngine": "server.remote",
    "pull": "engine.formats.sources", "architectures": "engine.models.families",
}

# the server's packages (FastAPI, uvicorn) load when `serve` is called, not here
from workbench.registry import (  # noqa: E402
    ModelNotFoundError,
    PullError,
    register_alias,
    resolve_alias,
    unregister_alias,
)
from workbench.server.runner import serve  # noqa: E402

if TYPE_CHECKING:
    from workbench.engine.audio.pcm import AudioError
    from workbench.engine.cancel import Cancelled
    from workbench.engine.decoding.closing import ClosedEarlyWarning, Closing, GrammarBudgetError
    from workbench.engine.decoding.grammar import (
        Grammar,
        GrammarError,
        UnsupportedSchemaError,
        compile_schema,
        parse_gbnf,
    )
    from workbench.engine.encoder import Encoder, TruncationWarning
    from workbench.engine.explore.branch import Branch, BranchStore
    from workbench.engine.formats.gguf import GGUFError, UnsupportedArchitectureError
    from workbench.engine.formats.sources import pull
    from workbench.engine.formats.whisper_file import WhisperFileError
    from workbench.engine.llm import LLM
    from workbench.engine.models.families import architectures
    from workbench.engine.models.trace import Trace, TraceTooLargeError
    from workbench.engine.options import GenerationOptions
    from workbench.engine.results import (
        Completion,
        IncompleteOutputError,
        TokenEvent,
        TooManyTokensError,
        Transcript,
    )
    from workbench.engine.runtime.backend import DeviceUnavailableError
    from workbench.engine.runtime.kv_cache import ContextFullError
    from workbench.engine.runtime.prefix_cache import PrefixCache, PrefixCacheError
    from workbench.engine.text.chat_template import ChatTemplateError, validate_chat_template
    from workbench.engine.whisper import WhisperModel
    from workbench.server.remote import RemoteEngine


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"workbench.{_LAZY[name]}"), name)
