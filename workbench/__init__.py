"""workbench: a Jupyter-first workbench for local AI inference.

    from workbench import LLM
    m = LLM.load("smollm2-135m")
    print(m.chat([{"role": "user", "content": "Hello!"}], temperature=0).text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "Completion", "TokenEvent", "__version__"]

if TYPE_CHECKING:
    from workbench.engine.llm import LLM, Completion, TokenEvent


def __getattr__(name: str):
    # the engine imports NumPy and Numba; keep `import workbench` (and the CLI's
    # `pull`/`list`) light by loading it on first use
    if name in ("LLM", "Completion", "TokenEvent"):
        from workbench.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
