"""The `workbench` command line: pull, list, chat, generate, batch, embed, transcribe, convert,
serve, bench, lab."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from workbench import registry
from workbench.engine import load_engine
from workbench.engine.formats import sources
from workbench.engine.options import DEFAULTS, GenerationOptions
from workbench.lab import lab_command  # noqa: F401 (part of this module's API)
from workbench.server import limits

DEFAULT_SYSTEM = "You are helpful and concise."
LAB_NOTEBOOK = "00_tour.ipynb"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser (argparse cannot forward "--option" arguments)
        from workbench import bench

        return bench.main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with _observed(args):
            return args.func(args) or 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `workbench list | head`: the reader has gone, say nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (OSError, ValueError, registry.PullError) as exc:  # a file, a port, a value
        print(f"workbench: error: {_hint(exc)}", file=sys.stderr)
        return 1


def _hint(exc: BaseException) -> str:
    """The error's message, naming the command line's option where the engine names its
    own keyword."""
    from workbench.engine.runtime.kv_cache import ContextFullError

    if isinstance(exc, ContextFullError):
        return f"{exc} (on the command line: --ctx)"
    return str(exc)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench", description=__doc__)
    sub = p.add_subparsers(title="commands", metavar="COMMAND")

    pull = sub.add_parser("pull", help="download models and prepare their CPU kernels",
                          description="Download registered models (see `workbench list`) into "
                          f"the cache ({registry.cache_dir()}, or $WORKBENCH_CACHE) and compile "
                          "the CPU kernels they run (kept in the kernel cache).")
    pull.add_argument("aliases", nargs="*", default=[registry.DEFAULT_MODEL], metavar="ALIAS",
                      help=f"model aliases (default: {registry.DEFAULT_MODEL})")
    pull.add_argument("--all", action="store_true",
                      help="every registered model (what the notebooks use: about 1.1 GB)")
    pull.add_argument("--force", action="store_true", help="download again even if cached")
    pull.add_argument("--no-kernels", action="store_true",
                      help="do not prepare the models' CPU kernels (compiled on first use)")
    pull.set_defaults(func=_pull)

    ls = sub.add_parser("list", help="list registered models and what is cached",
                        description="List the registered model aliases and which are cached, "
                        "and the user's aliases.")
    ls.set_defaults(func=_list)

    alias = sub.add_parser("alias", help="name a model source (a path, hf:// file or "
                           "owner/repo[:QUANT])",
                           description="User aliases: short names for model sources, usable "
                           "wherever a model is named, kept in the cache folder.")
    alias_sub = alias.add_subparsers(title="actions", metavar="ACTION", required=True)
    add = alias_sub.add_parser("add", help="make NAME stand for SOURCE")
    add.add_argument("name", metavar="NAME")
    add.add_argument("source", metavar="SOURCE")
    add.set_defaults(func=_alias_add)
    rm = alias_sub.add_parser("remove", help="forget the alias NAME")
    rm.add_argument("name", metavar="NAME")
    rm.set_defaults(func=_alias_remove)
    alias_ls = alias_sub.add_parser("list", help="list the user's aliases")
    alias_ls.set_defaults(func=_alias_list)

    chat = sub.add_parser("chat", help="chat with a model (interactive, streaming)",
                          description="Chat with a model in the terminal. With MESSAGE, answer "
                          "it once and exit; without, start an interactive session "
                          "(/reset clears the history, /exit or Ctrl-D leaves).")
    chat.add_argument("message", nargs="?", help="answer this one message and exit")
    chat.add_argument("--system", default=DEFAULT_SYSTEM,
                      help=f'system prompt (default: "{DEFAULT_SYSTEM}"; "" for none)')
    _generation_options(chat)
    _profiling_options(chat)
    chat.set_defaults(func=_chat)

    gen = sub.add_parser("generate", help="complete a prompt (no chat template)",
                         description="Continue PROMPT with the model, streaming to stdout.")
    gen.add_argument("prompt", help="the text to continue")
    _generation_options(gen)
    _profiling_options(gen)
    gen.set_defaults(func=_generate)

    batch = sub.add_parser("batch", help="answer a file of prompts, batched, resumably",
                           description="Answer every line of IN (JSONL: {\"prompt\": ...} or "
                           "{\"messages\": [...]}, with an optional \"id\" and per-line "
                           "options such as max_tokens, temperature, seed, stop, grammar, "
                           "schema) and append one JSON line per answer to OUT as it "
                           "finishes. The model decodes the lines together. Run again with "
                           "the same OUT to resume: lines already answered are skipped. The "
                           "flags set the defaults the lines override. A plain text IN (not "
                           "JSONL) holds one prompt per line; OUT is then text too, one "
                           "answer per line in IN's order (newlines written as \\n).")
    batch.add_argument("-i", "--input", required=True, metavar="IN",
                       help="the input: JSONL, or plain text with one prompt per line")
    batch.add_argument("-o", "--output", required=True, metavar="OUT",
                       help="the output (JSONL: appended to, what it answers is skipped; "
                            "for a text input, one answer per line)")
    batch.add_argument("--use-template", action="store_true",
                       help="plain text prompts go through the chat template (each a user "
                            "message); without it they are continued as they are")
    batch.add_argument("--max-batch", type=int, default=None, metavar="N",
                       help="sequences decoded together (default: the model's, 8)")
    _draft_options(batch, "every line (a line's \"draft\" field overrides it: \"ngram\", "
                   "this MODEL or null)")
    _generation_options(batch)
    _profiling_options(batch)
    batch.set_defaults(func=_batch)

    emb = sub.add_parser("embed", help="sentence embeddings (one JSON vector per line)",
                         description="Embed each TEXT with an encoder (or a decoder model) and "
                         "print one JSON array per line, or with --similarity the matrix of "
                         "cosine similarities.")
    emb.add_argument("texts", nargs="+", metavar="TEXT")
    emb.add_argument("-m", "--model", default="minilm-l6",
                     help="encoder alias, .gguf path or hf://repo/file (default: minilm-l6); "
                          "a decoder GGUF embeds with its last hidden state")
    emb.add_argument("--pool", choices=("mean", "cls", "last"), default=None,
                     help="pooling (default: the model's own)")
    emb.add_argument("--no-normalize", action="store_true", help="do not scale to unit length")
    emb.add_argument("--similarity", action="store_true",
                     help="print the cosine similarity matrix instead of the vectors")
    emb.set_defaults(func=_embed)

    tr = sub.add_parser("transcribe", help="speech to text with Whisper",
                        description="Transcribe audio files (anything soundfile or FFmpeg "
                        "reads; resampled to 16 kHz mono) and print the text.")
    tr.add_argument("files", nargs="+", metavar="FILE")
    tr.add_argument("-m", "--model", default="whisper-tiny.en",
                    help="alias or whisper.cpp .bin path (default: whisper-tiny.en)")
    tr.add_argument("-l", "--language", default="en",
                    help='language code, or "auto" to detect it (default: en)')
    tr.add_argument("--translate", action="store_true", help="translate into English")
    tr.add_argument("--beam-size", type=int, default=1, help="1 = greedy (default)")
    tr.add_argument("--timestamps", action="store_true", help="print timed segments")
    _profiling_options(tr)
    tr.set_defaults(func=_transcribe)

    conv = sub.add_parser("convert", help="convert a BERT or Whisper checkpoint folder",
                          description="Convert a Hugging Face / sentence-transformers BERT "
                          "folder to a GGUF file the Encoder loads, or a CTranslate2 "
                          "(faster-whisper) Whisper folder to a whisper.cpp .bin file. "
                          "SOURCE may also be a converted alias (minilm-l6, whisper-base).")
    conv.add_argument("source", help="checkpoint folder, or a converted alias")
    conv.add_argument("output", help="the .gguf (BERT) or .bin (Whisper) file to write")
    conv.add_argument("--type", dest="dtype", choices=("f32", "f16", "q8_0"), default=None,
                      help="tensor type of the weight matrices (default: f32 for BERT, "
                           "f16 for Whisper; q8_0 is BERT only)")
    conv.set_defaults(func=_convert)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                         description="Serve models with OpenAI's API (/v1/chat/completions, "
                         "/v1/completions, /v1/embeddings, /v1/audio/transcriptions, "
                         "/v1/models) until Ctrl-C. Each MODEL is an alias, a .gguf or "
                         "whisper.cpp .bin path, or ID=SOURCE to name it; decoder GGUFs "
                         "chat, BERT GGUFs embed, .bin files transcribe.")
    srv.add_argument("models", nargs="*", default=[registry.DEFAULT_MODEL], metavar="MODEL",
                     help=f"what to serve (default: {registry.DEFAULT_MODEL})")
    srv.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (this machine)")
    srv.add_argument("--port", type=int, default=11434, help="default: 11434")
    srv.add_argument("--api-key", default=os.environ.get("WORKBENCH_API_KEY") or None,
                     help="require 'Authorization: Bearer KEY' ($WORKBENCH_API_KEY); it "
                          "also guards /docs, /redoc, /openapi.json and /health's details")
    srv.add_argument("--open-docs", action="store_true",
                     help="with --api-key, leave /docs, /redoc, /openapi.json and /health's "
                          "details open")
    srv.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                     help="let web pages from ORIGIN call the API from a browser (repeat "
                          "for several; '*' for any); none by default")
    srv.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                     help="a name requests may give in their Host header besides "
                          "localhost and 127.0.0.1 (repeat for several; '*' for any); "
                          "by default a loopback server answers to those only, against "
                          "DNS rebinding, and one on other interfaces to any")
    srv.add_argument("--max-concurrent", type=int, default=limits.MAX_CONCURRENT,
                     help="engine calls at once; a chat model decodes them together "
                          f"(default: {limits.MAX_CONCURRENT})")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="requests waiting for a slot before 429 (default: 64)")
    srv.add_argument("--ctx", type=int, default=4096,
                     help="context length of chat models in tokens (default 4096)")
    _draft_options(srv, "the first chat model")
    srv.add_argument("--max-tokens-limit", type=int, default=limits.MAX_TOKENS_LIMIT,
                     metavar="N", help="the most tokens one request may generate per choice "
                     "(default %(default)s; 0: no limit)")
    srv.add_argument("--request-timeout", type=float, default=limits.REQUEST_TIMEOUT,
                     metavar="SECONDS", help="cancel a request still running after this "
                     "long, answering 504 (default %(default)g; 0: none)")
    srv.add_argument("--body-timeout", type=float, default=limits.BODY_TIMEOUT,
                     metavar="SECONDS", help="answer 408 to a client that takes longer to "
                     "send its request body (default %(default)g; 0: none)")
    srv.add_argument("--max-body-mb", type=float, default=limits.MAX_BODY_BYTES / 2**20,
                     metavar="MB", help="the largest request body in MiB (default "
                     "%(default)g; more: 413)")
    srv.add_argument("--max-audio-seconds", type=float, default=limits.MAX_AUDIO_SECONDS,
                     metavar="SECONDS", help="the longest audio transcribed (default "
                     "%(default)g; 0: no limit)")
    srv.add_argument("--max-embedding-tokens", type=int, default=limits.MAX_EMBEDDING_TOKENS,
                     metavar="N", help="the most tokens one embeddings request may hold "
                     "(default %(default)s; 0: no limit)")
    srv.set_defaults(func=_serve)

    sub.add_parser("bench", add_help=False,
                           help="speed and memory against llama.cpp, side by side",
                           description="See `workbench bench --help`.")

    lab = sub.add_parser("lab", help="open the notebooks in JupyterLab",
                         description="Pull the default model, then run JupyterLab on the "
                         "repository's notebooks/ directory, opening the tour notebook. "
                         "Runs until Ctrl-C.")
    lab.add_argument("--port", type=int, default=None,
                     help="port to listen on (default: JupyterLab's, 8888 or the next free)")
    lab.add_argument("--no-browser", action="store_true", help="do not open a browser")
    lab.add_argument("--notebook", default=LAB_NOTEBOOK, metavar="PATH",
                     help=f"notebook to open, relative to notebooks/ (default: {LAB_NOTEBOOK})")
    lab.set_defaults(func=_lab)
    return p


# the generation options the commands offer as flags: name -> (short flag, type, what it
# does); their defaults are `GenerationOptions`'s
_OPTION_FLAGS = {
    "max_tokens": ("-n", int, "tokens to write at most"),
    "temperature": ("-t", float, "0 = greedy"),
    "top_k": (None, int, "0 = off"),
    "top_p": (None, float, "1.0 = off"),
    "min_p": (None, float, "0 = off"),
    "repeat_penalty": (None, float, "1.0 = off"),
    "seed": (None, int, "random seed (same seed, same text)"),
}


def _generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=registry.DEFAULT_MODEL,
                   help=f"alias, .gguf path or hf://repo/file (default: {registry.DEFAULT_MODEL})")
    for name, (short, kind, note) in _OPTION_FLAGS.items():
        default = getattr(DEFAULTS, name)
        flags = ([short] if short else []) + [f"--{name.replace('_', '-')}"]
        shown = "" if default is None else f" (default: {default})"
        p.add_argument(*flags, type=kind, default=default, help=note + shown)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ctx", type=int, default=4096, help="context length in tokens (default 4096)")
    p.add_argument("--device", default="auto",
                   help="auto (metal, then cuda, then cpu), cpu, cuda, metal or mlx "
                        "(default: auto)")
    p.add_argument("--dtype", choices=("f16", "bf16"), default=None,
                   help="on a device (cuda, metal), upload the weights widened to this "
                        "float format (default: the file's own formats)")
    p.add_argument("--grammar", metavar="FILE", default=None,
                   help="constrain the output with the GBNF grammar in FILE")
    p.add_argument("--schema", metavar="FILE", default=None,
                   help="constrain the output to JSON valid under the JSON Schema in FILE")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on CUDA, launch each kernel instead of replaying recorded decode "
                        "steps (as WORKBENCH_CUDA_GRAPHS=0)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no loading output (kernel preparation, progress)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print the startup timing (model load, kernels) to stderr")


def _profiling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", action="store_true",
                   help="print the time per phase (load, tokenize, prefill, decode, sample, "
                        "grammar, detokenize ...) and tokens/s to stderr at the end")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="write a Chrome trace-event JSON of the phases and tokens, per "
                        "thread, to FILE (open it at https://ui.perfetto.dev)")


@contextmanager
def _observed(args) -> Iterator[None]:
    """Record the command's phases when it asked for --profile or --trace; afterwards (on
    an error or Ctrl-C too) print the table and write the trace."""
    profile, trace = getattr(args, "profile", False), getattr(args, "trace", None)
    if not (profile or trace):
        yield
        return
    from workbench.engine.runtime import profiling

    if trace and not Path(trace).resolve().parent.is_dir():
        raise FileNotFoundError(f"no directory for the trace file {trace}")
    with profiling.recording() as rec:
        try:
            yield
        finally:
            rec.stop()
            if trace:
                rec.write_trace(trace)
                print(f"workbench: trace written to {trace} (open it at "
                      "https://ui.perfetto.dev)", file=sys.stderr)
            if profile:
                print(rec.table(), file=sys.stderr)


def _constraint(args):
    """The `Grammar` of --grammar FILE or --schema FILE (None without), compiled before the
    model loads; a file that cannot be read or compiled is a ValueError naming it."""
    if args.grammar is None and args.schema is None:
        return None
    if args.grammar is not None and args.schema is not None:
        raise ValueError("--grammar and --schema exclude each other: pass one")
    import json

    from workbench.engine.decoding.grammar import Grammar, GrammarError

    path = args.grammar if args.grammar is not None else args.schema
    what = "grammar" if args.grammar is not None else "JSON Schema"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the {what} file {path}: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    try:
        if args.grammar is not None:
            return Grammar.from_gbnf(text)
        return Grammar.from_json_schema(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    except GrammarError as exc:
        raise ValueError(f"{path} is not a valid {what}: {exc}") from None


def _options(args) -> GenerationOptions:
    """The generation options the command line set (the others at their defaults)."""
    return GenerationOptions(stop=args.stop,
                             **{name: getattr(args, name) for name in _OPTION_FLAGS})


def _draft_options(p: argparse.ArgumentParser, what: str) -> None:
    """--draft and --draft-tokens: speculative decoding (`LLM.generate(draft=)`)."""
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help=f"speculative decoding for {what}: a smaller model with its "
                        "vocabulary (alias or .gguf path), or 'ngram' (prompt lookup, no "
                        "second model)")
    p.add_argument("--draft-tokens", type=int, default=None, metavar="N",
                   help="proposals the target checks per pass (default: 4)")


def _load_draft(args, source: str):
    """A draft model for the generation commands' `--draft`, on the target's device."""
    from workbench.engine.llm import LLM

    return _prepared(LLM.load(source, kv_cache_size=args.ctx, device=args.device,
                              dtype=args.dtype), quiet=args.quiet)


def _load(args, **kwargs):
    """The LLM the generation commands' flags name, its kernels ready (`-v`: the time each
    took; `--no-cuda-graphs` before the model loads)."""
    from workbench.engine.llm import LLM
    from workbench.engine.runtime.backend import DeviceUnavailableError

    if args.no_cuda_graphs:
        os.environ["WORKBENCH_CUDA_GRAPHS"] = "0"
    start = time.perf_counter()
    try:
        m = LLM.load(args.model, kv_cache_size=args.ctx, device=args.device, dtype=args.dtype,
                     **kwargs)
    except DeviceUnavailableError as exc:
        raise ValueError(str(exc)) from None
    loaded = time.perf_counter()
    _prepared(m, quiet=args.quiet)
    if args.verbose:
        print(f"workbench: {m.path.name} loaded on {m.device.peek()} in "
              f"{loaded - start:.2f} s; kernels ready {time.perf_counter() - loaded:.2f} s "
              "later", file=sys.stderr)
    return m


def _prepared(engine, quiet: bool = False):
    """`engine` once its CPU kernels are ready, with a status line on stderr meanwhile
    ("preparing kernels for this CPU (3/5): ..."; only the first run on a machine waits),
    or silently (`quiet`)."""
    from workbench.engine.runtime.profiling import span
    from workbench.engine.runtime.warmup import show_progress

    with span("warmup"):
        if quiet:
            engine.warmup.wait()
        else:
            show_progress(engine.warming, file=sys.stderr)
    return engine


def _stream(completion) -> None:
    try:
        for piece in completion:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C stops this answer, not the program
        completion.close()
    sys.stdout.write("\n")


def _pull(args) -> int:
    if args.all and args.aliases != [registry.DEFAULT_MODEL]:
        raise ValueError("pass either aliases or --all, not both")
    for alias in list(registry.MODELS) if args.all else args.aliases:
        path = sources.pull(alias, force=args.force)
        print(f"{alias}: {path}")
        if not args.no_kernels:  # compile them now, not in the user's first call
            engine = _prepared(load_engine(alias))
            print(f"{alias}: kernels ready for this CPU ({engine.warmup.seconds:.1f} s)")
    return 0


def _list(args) -> int:
    print(f"cache: {registry.cache_dir()}")
    for alias, entry in registry.MODELS.items():
        mark = "*" if registry.cached_path(alias) else " "
        default = " (default)" if alias == registry.DEFAULT_MODEL else ""
        print(f" {mark} {alias:<22} {entry.description}{default}")
    print("(* = cached)")
    for name, source in registry.user_aliases().items():
        print(f"   {name:<22} -> {source} (user alias)")
    return 0


def _alias_add(args) -> int:
    registry.register_alias(args.name, args.source)
    print(f"{args.name} -> {registry.user_aliases()[args.name]}")
    return 0


def _alias_remove(args) -> int:
    try:
        registry.unregister_alias(args.name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    print(f"{args.name} removed")
    return 0


def _alias_list(args) -> int:
    table = registry.user_aliases()
    for name, source in table.items():
        print(f"{name:<24} {source}")
    if not table:
        print("no user aliases (workbench alias add NAME SOURCE)")
    return 0


def _embed(args) -> int:
    import json

    from workbench.engine.encoder import Encoder, cosine_similarity

    model = _prepared(load_engine(args.model))
    if isinstance(model, Encoder):
        vectors = model.embed_batch(args.texts, pool=args.pool,
                                    normalize=not args.no_normalize)
    elif hasattr(model, "embed_batch"):
        vectors = model.embed_batch(args.texts, pool=args.pool or "last",
                                    normalize=not args.no_normalize)
    else:
        raise ValueError(f"{args.model} is not a text model: it cannot embed")
    if args.similarity:
        sims = cosine_similarity(vectors, vectors)
        width = max(len(t) for t in args.texts[:50])
        for text, row in zip(args.texts, sims):
            print(f"{text[:50]:<{min(width, 50)}}  " + " ".join(f"{v:6.3f}" for v in row))
    else:
        for v in vectors:
            print(json.dumps([round(float(x), 6) for x in v]))
    return 0


def _transcribe(args) -> int:
    from workbench.engine.whisper import WhisperModel

    model = _prepared(WhisperModel.load(args.model))
    for path in args.files:
        t = model.transcribe(path, language=args.language, beam_size=args.beam_size,
                             task="translate" if args.translate else "transcribe",
                             timestamps=args.timestamps)
        prefix = f"{path}: " if len(args.files) > 1 else ""
        if args.timestamps:
            for s in t.segments:
                print(f"{prefix}[{s.start:7.2f} -> {s.end:7.2f}] {s.text}")
        else:
            print(prefix + t)
    return 0


def _convert(args) -> int:
    from workbench.engine.formats.convert import ct2_whisper_to_bin, hf_bert_to_gguf

    source = Path(args.source)
    if args.source in registry.MODELS:
        source = registry.source_folder(args.source)
    if (source / "model.bin").is_file() and (source / "vocabulary.txt").is_file():
        if args.dtype == "q8_0":
            raise ValueError("Whisper folders convert to f16 or f32, not q8_0")
        dtype = args.dtype or "f16"
        path = ct2_whisper_to_bin(source, args.output, f16=dtype == "f16")
    else:
        dtype = args.dtype or "f32"
        path = hf_bert_to_gguf(source, args.output, dtype=dtype)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {dtype})")
    return 0


def _serve(args) -> int:
    from workbench.server import serve
    from workbench.server.jobs import check_api_key

    check_api_key(args.api_key)  # before the models load
    engines = {}
    for spec in args.models:
        name, sep, source = spec.partition("=")
        if not sep:
            name, source = spec, spec
            if spec not in registry.MODELS:
                name = Path(spec).stem
        engines[name] = _prepared(load_engine(source, ctx=args.ctx,
                                              max_batch=args.max_concurrent))
    draft = None
    if args.draft is not None:
        target = next((n for n, e in engines.items() if callable(getattr(e, "chat", None))),
                      None)
        if target is None:
            raise ValueError("--draft needs a chat model among the models served")
        small = args.draft if args.draft == "ngram" else _prepared(
            load_engine(args.draft, ctx=args.ctx, max_batch=args.max_concurrent))
        draft = {target: small}
        print(f"workbench: {target} decodes with the draft {args.draft}", file=sys.stderr)
    print(f"workbench: serving {', '.join(engines)} at http://{args.host}:{args.port}/v1 "
          "(Ctrl-C stops)", file=sys.stderr)
    serve(engines, host=args.host, port=args.port, api_key=args.api_key,
          max_concurrent=args.max_concurrent, max_queue=args.max_queue,
          max_body_bytes=int(args.max_body_mb * 1024 * 1024),
          max_tokens_limit=args.max_tokens_limit or None,
          request_timeout=args.request_timeout or None, body_timeout=args.body_timeout or None,
          max_audio_seconds=args.max_audio_seconds or None,
          max_embedding_tokens=args.max_embedding_tokens or None, cors_origins=args.cors_origin,
          allowed_hosts=args.allowed_host,
          protect_docs=False if args.open_docs else None, draft=draft,
          draft_tokens=args.draft_tokens, background=False)
    return 0


def _generate(args) -> int:
    options, grammar = _options(args), _constraint(args)  # checked before the model loads
    m = _load(args)
    _stream(m.generate(args.prompt, options=options, grammar=grammar))
    return 0


def _batch(args) -> int:
    from workbench import batch

    options, grammar = _options(args), _constraint(args)
    extra = {} if args.max_batch is None else {"max_batch": args.max_batch}
    drafts = batch.Drafts(args.draft, args.draft_tokens, lambda name: _load_draft(args, name))
    return batch.run_file(lambda: _load(args, **extra), args.input, args.output, options,
                          grammar, use_template=args.use_template, quiet=args.quiet,
                          drafts=drafts)


def _chat(args) -> int:
    options, grammar = _options(args), _constraint(args)  # checked before the model loads
    m = _load(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    if args.message is not None:
        question = {"role": "user", "content": args.message}
        _stream(m.chat(system + [question], options=options, grammar=grammar))
        return 0
    history: list[dict] = []
    print(f"{m.path.name} - /reset clears the conversation, /exit leaves", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history.clear()
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            completion = m.chat(system + history, options=options, grammar=grammar)
        except ValueError as exc:  # the conversation outgrew the context ...: keep the session
            history.pop()
            print(f"workbench: error: {_hint(exc)}; /reset starts over", file=sys.stderr)
            continue
        _stream(completion)
        history.append({"role": "assistant", "content": completion.text})


def notebooks_dir() -> Path:
    """The repository's notebooks/ directory (beside the package in a source checkout)."""
    import workbench

    return Path(workbench.__file__).resolve().parents[1] / "notebooks"


def _lab(args) -> int:
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        raise FileNotFoundError('JupyterLab is not installed: pip install "workbench-nb[notebook]"'
                                ) from None
    notebooks = notebooks_dir()
    if not notebooks.is_dir():
        raise FileNotFoundError(f"no notebooks directory at {notebooks}: `workbench lab` serves "
                                "the notebooks of a source checkout (pip install -e .)")
    if not (notebooks / args.notebook).is_file():
        raise FileNotFoundError(f"no notebook {args.notebook!r} in {notebooks}")
    sources.pull(registry.DEFAULT_MODEL)  # with a progress bar; a no-op once cached
    from workbench import lab

    return lab.run(notebooks, args.notebook, port=args.port, no_browser=args.no_browser)


if __name__ == "__main__":
    sys.exit(main())
