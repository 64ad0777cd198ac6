"""`python -m tests.goldens [NAME ...]`: regenerate goldens from the live peers.

With no names, every golden; a name that ends a family prefix (`tiny-llama`) picks all
goldens whose name starts with it. `--list` prints the names and their producers;
`--check` compares the live peers with the stored goldens instead of writing (what the
`peers` test tier runs). Needs the `[peers]` extra (`pip install -e '.[peers]'`).
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.goldens import DATA, save
from tests.goldens.registry import compare, load_stored, producers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.goldens", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="goldens (or name prefixes) to regenerate")
    parser.add_argument("--list", action="store_true", help="list the goldens and stop")
    parser.add_argument("--check", action="store_true",
                        help="compare the live peers with the stored goldens; write nothing")
    args = parser.parse_args(argv)

    every = producers()
    chosen = [n for n in every if not args.names or any(n.startswith(p) for p in args.names)]
    unknown = [p for p in args.names if not any(n.startswith(p) for n in every)]
    if unknown:
        parser.error(f"no golden named {', '.join(unknown)} (see --list)")
    if args.list:
        for name in chosen:
            print(f"{name:40} {every[name].__module__}.{every[name].__name__}")
        return 0
    failed = 0
    for name in chosen:
        t0 = time.perf_counter()
        live = every[name]()
        if args.check:
            problems = compare(load_stored(name), live)
            failed += bool(problems)
            status = "differs: " + "; ".join(problems) if problems else "same"
        else:
            save(name, live, DATA)
            status = "written"
        print(f"{name:40} {status} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
