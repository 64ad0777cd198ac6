"""`python -m llama_cpp.server ARGS`, run by bench/serve.py in a child process.

    python bench/llama_cpp_server.py [--no-extra-buffers] ARGS

With --no-extra-buffers, llama.cpp loads the model without its extra buffer types (its
AMX repacking), which crash llama-cpp-python 0.3.36 at the first prompt on CPUs with AMX
(`workbench.bench.load_llama_cpp` does the same in-process). This file imports llama_cpp
only, not workbench: importing workbench sets thread-pool environment variables
(workbench/__init__.py) that would change the peer's speed.
"""

import runpy
import sys

import llama_cpp

if sys.argv[1:2] == ["--no-extra-buffers"]:
    del sys.argv[1]
    _defaults = llama_cpp.llama_cpp.llama_model_default_params

    def _without_extra_buffers():
        params = _defaults()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = _without_extra_buffers

sys.argv[0] = "llama_cpp.server"
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
