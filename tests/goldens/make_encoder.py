"""Producers of the encoder goldens (tests/test_encoder.py compares against them).

- `encoder-tiny-bert`: a tiny random transformers `BertModel`
  (tests/support/tiny_encoders.build_tiny_bert) saved as users download one: its folder's
  files (config.json, tokenizer_config.json, vocab.txt, the weights both as
  model.safetensors and as pytorch_model.bin), so that the tests still run our converter
  on them; `BertTokenizerFast`'s ids of `TINY_TEXTS` (`input_ids`), the last hidden state
  of each text run alone (`last_hidden_state_<i>.npy`, (tokens, 64)) and of the padded
  batch pooled by hand over its attention mask (`batch_mean.npy`, `batch_cls.npy`, (4, 64));
- `encoder-minilm-l6`: transformers' `BertModel` and `AutoTokenizer` on all-MiniLM-L6-v2
  (the registry's `minilm-l6` folder, its model.safetensors' sha256 kept): the ids of
  `TOKENIZER_STRINGS` truncated to 256 tokens (`input_ids`) and the normalized mean-pooled
  vectors (384,) of "" (`empty.npy`) and of `OVERLONG_TEXT` cut to 256 and to 512 tokens
  (`overlong_256.npy`, `overlong_512.npy`).

This module holds the inputs (the tests import them); the peers (torch, transformers) are
imported inside the producers only.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import numpy as np

from tests.goldens import Golden, digest, peer_versions
from tests.support.tiny_encoders import TINY_BERT_FILES, TINY_BERT_GOLDEN, build_tiny_bert

MINILM_GOLDEN = "encoder-minilm-l6"

TINY_TEXTS = ["The quick brown fox jumps over the lazy dog!", "hello, world", "unjumped foxes?",
              "x"]

# 50 strings for tokenizer agreement: accents, punctuation, numbers, CJK, scripts,
# control and invisible characters, special-token texts, over-long words and inputs
TOKENIZER_STRINGS = [
    "hello world", "Héllo Wörld! Ça va?", "naïve café résumé", "$3.50 + 20% = ???",
    "2024-11-22T10:00:00Z", "中文测试，你好世界", "日本語のテキストです", "한국어 문장입니다",
    "emoji 😀👍🏽 test", "tabs\tand\nnewlines\r\n", "  leading and trailing  ",
    "UPPER lower MiXeD", "don't won't it's", "e-mail: someone@example.com",
    "https://example.org/path?q=1&b=2", "[CLS] inside [SEP] text [MASK]",
    "[cls] lowercase special", "a" * 150, "supercalifragilisticexpialidocious",
    "ﬁnancial ligature", "İstanbul ŞEHİR", "Ελληνικά κείμενο", "Русский текст", "עברית",
    "العربية", "zero\u200bwidth", "soft\u00adhyphen", "nbsp\u00a0space", "em—dash – en",
    "«quotes» “curly” ‘single’", "x\x00y\ufffdz", "control\x07char", "math ∑ ∫ √ ≈",
    "1,000,000.00", "v1.2.3-beta+build", "C++ and C#", "under_score snake_case",
    "CamelCaseWord", "#hashtag @mention", "...!!!???", "", " ", "ß straße", "Ǆ digraph",
    "x̧ combining", "ｆｕｌｌｗｉｄｔｈ", "ⅷ roman", "℃ degrees", "\u2028line sep",
    "tokenization " * 400,  # over-long: truncated to 256 tokens
]

# 10,000 words, far over the model's 512 positions (kept in the golden as its sha256)
OVERLONG_TEXT = " ".join(f"word{i % 97}" for i in range(10_000))


def text_sha256(text: str) -> str:
    """sha256 of a text's UTF-8 bytes, to tie a golden to a long input text."""
    return hashlib.sha256(text.encode()).hexdigest()


def minilm_inputs() -> dict:
    """The inputs `encoder-minilm-l6` is made from, less the checkpoint's sha256."""
    return {"strings": TOKENIZER_STRINGS, "max_length": 256,
            "overlong_text_sha256": text_sha256(OVERLONG_TEXT)}


def tiny_bert() -> Golden:
    """transformers on the tiny random BERT: the tokenizer's ids and the last hidden states
    of `TINY_TEXTS` one at a time, the mean and CLS pooled states of their padded batch,
    and the model's folder (its weights in both formats)."""
    import torch
    from transformers import BertTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        folder, bin_folder = Path(tmp) / "tiny", Path(tmp) / "tiny-bin"
        model = build_tiny_bert(folder)
        build_tiny_bert(bin_folder, safetensors=False)  # the same weights, torch.save'd
        for name in TINY_BERT_FILES:
            assert (folder / name).read_bytes() == (bin_folder / name).read_bytes(), name
        files = {name: (folder / name).read_bytes()
                 for name in (*TINY_BERT_FILES, "model.safetensors")}
        files["pytorch_model.bin"] = (bin_folder / "pytorch_model.bin").read_bytes()
        tok = BertTokenizerFast(str(folder / "vocab.txt"), do_lower_case=True)

    input_ids, arrays = [], {}
    for i, text in enumerate(TINY_TEXTS):  # one text at a time
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0].numpy()
        input_ids.append(ids)
        arrays[f"last_hidden_state_{i}"] = h.astype(np.float32)
    # a padded batch: transformers with an attention mask, pooled by hand
    batch = tok(TINY_TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state.numpy()
    mask = batch["attention_mask"].numpy()[..., None]
    arrays["batch_mean"] = ((h * mask).sum(1) / mask.sum(1)).astype(np.float32)
    arrays["batch_cls"] = h[:, 0].astype(np.float32)
    return Golden(
        peer=peer_versions("torch", "transformers", "tokenizers"),
        inputs={"model": "tests/support/tiny_encoders.build_tiny_bert",
                "tokenizer": "BertTokenizerFast(vocab.txt, do_lower_case=True)",
                "texts": TINY_TEXTS},
        outputs={"input_ids": input_ids}, arrays=arrays, files=files)


def minilm_l6() -> Golden:
    """transformers on all-MiniLM-L6-v2: the ids of `TOKENIZER_STRINGS` and the
    normalized mean of the last hidden state for "" and `OVERLONG_TEXT`."""
    import torch
    from transformers import AutoTokenizer, BertModel

    from workbench import registry

    folder = registry.source_folder("minilm-l6", progress=False)
    model = BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(folder)

    def embed(text: str, max_length: int = 256) -> np.ndarray:
        enc = tok(text, truncation=True, max_length=max_length, return_tensors="pt")
        with torch.no_grad():
            h = model(**enc).last_hidden_state[0].numpy()
        v = h.mean(0)
        return (v / np.linalg.norm(v)).astype(np.float32)

    return Golden(
        peer=peer_versions("torch", "transformers", "tokenizers"),
        inputs={"model_safetensors_sha256": digest(folder / "model.safetensors"),
                **minilm_inputs()},
        outputs={"input_ids": [tok(s, truncation=True, max_length=256)["input_ids"]
                               for s in TOKENIZER_STRINGS]},
        arrays={"empty": embed(""), "overlong_256": embed(OVERLONG_TEXT),
                "overlong_512": embed(OVERLONG_TEXT, 512)})


GOLDENS = {TINY_BERT_GOLDEN: tiny_bert, MINILM_GOLDEN: minilm_l6}
