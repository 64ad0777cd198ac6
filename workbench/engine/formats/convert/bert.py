"""Hugging Face / sentence-transformers BERT folder -> `bert` GGUF.

    >>> from workbench.engine.formats.convert import hf_bert_to_gguf
    >>> hf_bert_to_gguf("all-MiniLM-L6-v2/", "minilm.gguf", dtype="q8_0")

Reads `config.json` (a `BertModel` with absolute positions and GELU), the
weights (`model.safetensors` or `pytorch_model.bin`, read without torch), the
vocabulary (`vocab.txt` or `tokenizer.json`) and its normalization
(`tokenizer.json`'s BertNormalizer, else `tokenizer_config.json`), and, for a
sentence-transformers folder, the pooling mode (`modules.json` ->
`1_Pooling/config.json`) and `max_seq_length` (`sentence_bert_config.json`).

The file follows llama.cpp's conventions, so llama.cpp can load it too:
tensor names `token_embd`, `blk.N.attn_q` ...; the vocabulary in "phantom
space" form (word-initial pieces get a leading U+2581, `##` continuations lose
their prefix); `[CLS]` as BOS and `[SEP]` as EOS, both added. Two keys of our
own record the normalization (`tokenizer.ggml.lowercase`,
`tokenizer.ggml.strip_accents`), and a third sentence-transformers'
`max_seq_length` (`sentence_transformers.max_seq_length`: the `Encoder`
truncates there, as sentence-transformers does). `bert.context_length` is
`max_position_embeddings`, the rows of the position table, as llama.cpp
requires.

Tensor types: "f32"; "f16" or "q8_0" for the matrices of the blocks and the
token embedding, with biases, norms and the position and token-type tables
kept in F32.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, PoolingType, TokenType
from gguf.quants import quantize

from workbench.engine.formats.convert.checkpoint import CheckpointError, read_tensors

DTYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16,
          "q8_0": GGMLQuantizationType.Q8_0}
_FILE_TYPES = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
               "q8_0": LlamaFileType.MOSTLY_Q8_0}

# Hugging Face BertModel names (after "bert." is dropped) -> GGUF names; N is the layer
_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.position_embeddings.weight": "position_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
}
_LAYER = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_UNUSED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")
_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class ConversionError(ValueError):
    """The folder is not a BERT checkpoint this converter understands."""


def hf_bert_to_gguf(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "f32",
                    name: str | None = None) -> Path:
    """Convert the BERT checkpoint folder `src` to the GGUF file `dst`; return `dst`.

    dtype: "f32", "f16" or "q8_0" (see the module docstring). name: the
    `general.name` to record (default: the folder's name).
    Raises `ConversionError` for anything that is not a supported BERT model.
    """
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if not src.is_dir():
        raise ConversionError(f"{src} is not a folder (expected a Hugging Face model folder)")
    config = _read_json(src / "config.json", required=True)
    _check_config(config, src)
    vocab = _read_vocab(src)
    normalizer = _read_normalizer(src)
    pooling, max_seq_length = _read_sentence_transformers(src)

    n_layer = int(config["num_hidden_layers"])
    partial = dst.with_name(dst.name + ".partial")
    writer = GGUFWriter(str(partial), "bert")
    writer.add_name(name or src.resolve().name)
    writer.add_file_type(_FILE_TYPES[dtype])
    writer.add_context_length(int(config["max_position_embeddings"]))
    if max_seq_length:
        writer.add_uint32("sentence_transformers.max_seq_length", max_seq_length)
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_block_count(n_layer)
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_layer_norm_eps(float(config.get("layer_norm_eps", 1e-12)))
    writer.add_causal_attention(False)
    writer.add_pooling_type(pooling)
    _add_vocab(writer, vocab, normalizer, int(config.get("type_vocab_size", 2)))

    written = set()
    try:
        for hf_name, array in read_tensors(src):
            gguf_name = _gguf_name(hf_name, n_layer)
            if gguf_name is None:
                continue
            _add_tensor(writer, gguf_name, np.asarray(array, dtype=np.float32), dtype)
            written.add(gguf_name)
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from exc
    missing = _expected_names(n_layer) - written
    if missing:
        raise ConversionError(f"{src}: the checkpoint lacks {', '.join(sorted(missing)[:5])}"
                              + (" ..." if len(missing) > 5 else ""))
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, dst)  # a failed conversion leaves no half-written dst behind
    finally:
        partial.unlink(missing_ok=True)
    return dst


def _read_json(path: Path, required: bool = False) -> Any:
    if not path.is_file():
        if required:
            raise ConversionError(f"{path.parent} has no {path.name}")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path} is not valid JSON: {exc}") from exc


def _check_config(config: dict, src: Path) -> None:
    model_type = config.get("model_type")
    if model_type != "bert":
        raise ConversionError(f"{src}: model_type {model_type!r} is not supported (only 'bert')")
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "max_position_embeddings"):
        if key not in config:
            raise ConversionError(f"{src}/config.json lacks {key!r}")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError(f"{src}: position_embedding_type "
                              f"{config['position_embedding_type']!r} is not supported")
    if config.get("hidden_act", "gelu") != "gelu":
        raise ConversionError(f"{src}: hidden_act {config['hidden_act']!r} is not supported "
                              "(only the exact 'gelu')")
    if config["hidden_size"] % config["num_attention_heads"]:
        raise ConversionError(f"{src}: hidden_size is not a multiple of num_attention_heads")


def _read_vocab(src: Path) -> list[str]:
    """Token texts by id, from vocab.txt or else tokenizer.json's WordPiece model."""
    vocab_txt = src / "vocab.txt"
    if vocab_txt.is_file():
        tokens = vocab_txt.read_text(encoding="utf-8").split("\n")
        if tokens and tokens[-1] == "":
            tokens.pop()
        return tokens
    tok = _read_json(src / "tokenizer.json")
    model = (tok or {}).get("model") or {}
    if model.get("type") != "WordPiece":
        raise ConversionError(f"{src} has no vocab.txt and no WordPiece tokenizer.json")
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise ConversionError(f"{src}/tokenizer.json: the vocabulary ids are not 0..n-1")
    return [t for t, _ in by_id]


def _read_normalizer(src: Path) -> dict[str, bool]:
    """{"lowercase": ..., "strip_accents": ...} as the tokenizer files say."""
    tok = _read_json(src / "tokenizer.json")
    norm = (tok or {}).get("normalizer") or {}
    if norm.get("type") == "BertNormalizer":
        lower = bool(norm.get("lowercase", True))
        strip = norm.get("strip_accents")
        return {"lowercase": lower, "strip_accents": lower if strip is None else bool(strip)}
    cfg = _read_json(src / "tokenizer_config.json") or {}
    lower = bool(cfg.get("do_lower_case", True))
    strip = cfg.get("strip_accents")
    return {"lowercase": lower, "strip_accents": lower if strip is None else bool(strip)}


def _read_sentence_transformers(src: Path) -> tuple[PoolingType, int | None]:
    """Pooling mode and max_seq_length of a sentence-transformers folder (CLS pooling and no
    limit for a plain transformers folder)."""
    modules = _read_json(src / "modules.json") or []
    pooling = PoolingType.CLS
    for module in modules:
        if module.get("type", "").endswith("models.Pooling"):
            cfg = _read_json(src / module.get("path", "") / "config.json", required=True)
            if cfg.get("pooling_mode_mean_tokens"):
                pooling = PoolingType.MEAN
            elif cfg.get("pooling_mode_cls_token"):
                pooling = PoolingType.CLS
            elif cfg.get("pooling_mode_lasttoken"):
                pooling = PoolingType.LAST
            else:
                modes = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
                raise ConversionError(f"{src}: pooling {modes} is not supported "
                                      "(mean, cls and last token are)")
    st = _read_json(src / "sentence_bert_config.json") or {}
    max_seq = st.get("max_seq_length")
    return pooling, int(max_seq) if max_seq else None


def _add_vocab(writer: GGUFWriter, vocab: list[str], normalizer: dict[str, bool],
               n_token_types: int) -> None:
    ids = {t: i for i, t in enumerate(vocab)}
    for special in ("[UNK]", "[CLS]", "[SEP]"):
        if special not in ids:
            raise ConversionError(f"the vocabulary has no {special} token")

    def phantom(token: str) -> str:  # llama.cpp's spelling of WordPiece pieces
        if token.startswith("[") and token.endswith("]"):
            return token
        return token[2:] if token.startswith("##") else "\u2581" + token

    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([phantom(t) for t in vocab])
    writer.add_token_types([TokenType.CONTROL if t in _SPECIALS else TokenType.NORMAL
                            for t in vocab])
    writer.add_token_type_count(n_token_types)
    writer.add_bos_token_id(ids["[CLS]"])
    writer.add_eos_token_id(ids["[SEP]"])
    writer.add_sep_token_id(ids["[SEP]"])
    writer.add_unk_token_id(ids["[UNK]"])
    if "[PAD]" in ids:
        writer.add_pad_token_id(ids["[PAD]"])
    if "[MASK]" in ids:
        writer.add_mask_token_id(ids["[MASK]"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    writer.add_bool("tokenizer.ggml.lowercase", normalizer["lowercase"])
    writer.add_bool("tokenizer.ggml.strip_accents", normalizer["strip_accents"])


def _gguf_name(hf_name: str, n_layer: int) -> str | None:
    """The GGUF name of a checkpoint tensor; None for tensors an encoder does not use."""
    name = hf_name.removeprefix("bert.")
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight")
    name = name.replace("LayerNorm.beta", "LayerNorm.bias")
    if name.startswith(_UNUSED_PREFIXES):
        return None
    if name in _EMBEDDINGS:
        return _EMBEDDINGS[name]
    if name.startswith("encoder.layer."):
        layer, _, rest = name[len("encoder.layer."):].partition(".")
        module, _, kind = rest.rpartition(".")
        if layer.isdigit() and int(layer) < n_layer and module in _LAYER:
            return f"blk.{layer}.{_LAYER[module]}.{kind}"
    raise ConversionError(f"unexpected tensor {hf_name!r} in the checkpoint")


def _expected_names(n_layer: int) -> set[str]:
    names = set(_EMBEDDINGS.values()) - {"token_types.weight"}
    for i in range(n_layer):
        names.update(f"blk.{i}.{t}.{k}" for t in _LAYER.values() for k in ("weight", "bias"))
    return names


def _add_tensor(writer: GGUFWriter, name: str, array: np.ndarray, dtype: str) -> None:
    quantizable = (array.ndim == 2 and name not in ("position_embd.weight", "token_types.weight")
                   and (name.startswith("blk.") or name == "token_embd.weight"))
    qtype = DTYPES[dtype] if quantizable else GGMLQuantizationType.F32
    if qtype == GGMLQuantizationType.Q8_0 and array.shape[-1] % 32:
        qtype = GGMLQuantizationType.F16  # rows that do not fill whole Q8_0 blocks
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float16))
    else:
        writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)  # (rows, bytes per row)
