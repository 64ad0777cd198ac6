"""LLM speed and memory: workbench against llama.cpp (llama-cpp-python), side by side.

    pip install llama-cpp-python     # builds llama.cpp from source (~10 min on 2 cores)
    python bench/llm.py [--model smollm2-135m] [--threads 2] [--rounds 3]

Same as `workbench bench`; see `workbench/bench.py` for what is measured.
"""

import sys

from workbench.bench import main

if __name__ == "__main__":
    sys.exit(main())
