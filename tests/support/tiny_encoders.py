"""Tiny random-weight transformers encoders: a BERT saved as users download one (the
gate copies its files from the golden `encoder-tiny-bert` with `tiny_bert`), and a
Whisper model for tests/whisper_to_bin.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.goldens import load

TINY_WORDS = ["the", "quick", "brown", "fox", "jump", "over", "lazy", "dog", "hello", "world",
              "un", "##ed", "##ing", "##ly", ",", ".", "!", "?", "'"]


def spread_weights(model, norm: str, wide: str | None = None) -> None:
    """Draw every parameter from torch's global generator (seed it first) with some spread,
    so that attention is far from uniform: parameters named with `norm` get weights
    1 + N(0, 0.2^2) and biases N(0, 0.1^2), those named with `wide` N(0, 0.5^2), the
    rest N(0, 0.15^2)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if norm in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("weight")
                        else 0.1 * torch.randn_like(p))
            elif wide is not None and wide in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)


TINY_BERT_GOLDEN = "encoder-tiny-bert"
# the tiny BERT's folder besides its weights (model.safetensors or pytorch_model.bin)
TINY_BERT_FILES = ("config.json", "tokenizer_config.json", "vocab.txt")


def tiny_bert(folder: Path, *, safetensors: bool = True) -> Path:
    """The tiny random BERT's folder as users download one, written to `folder`: the files
    `build_tiny_bert` saved, stored in the golden `encoder-tiny-bert` (no peer needed), with
    its weights as `model.safetensors` or, without `safetensors`, `pytorch_model.bin`."""
    golden = load(TINY_BERT_GOLDEN)
    folder.mkdir(parents=True, exist_ok=True)
    weights = "model.safetensors" if safetensors else "pytorch_model.bin"
    for name in (*TINY_BERT_FILES, weights):
        shutil.copyfile(golden.file(name), folder / name)
    return folder


def build_tiny_bert(folder, *, safetensors: bool = True):
    """A transformers BertModel with seeded random weights, saved with its vocabulary (the
    producer of `encoder-tiny-bert` runs it; the tests copy its files with `tiny_bert`)."""
    import torch
    from transformers import BertConfig, BertModel

    vocab = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + TINY_WORDS
             + list("abcdefghijklmnopqrstuvwxyz0123456789")
             + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"])
    config = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=64, type_vocab_size=2,
                        attn_implementation="eager")
    torch.manual_seed(0)
    model = BertModel(config).eval()
    spread_weights(model, norm="LayerNorm")
    model.save_pretrained(folder)
    if not safetensors:  # the older format, as torch.save writes it (a zip of pickles)
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    return model


def tiny_whisper(f16: bool):
    """A transformers Whisper model (vocab 120, 80 mels, width 64, 2 + 2 layers) with seeded
    random weights; with `f16` its matrices hold the values an F16 file stores."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=120, num_mel_bins=80, d_model=64, encoder_layers=2,
                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=1500,
                        max_target_positions=64, attn_implementation="eager",
                        decoder_start_token_id=1, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg).eval()
    spread_weights(model, norm="layer_norm", wide="embed_positions")
    if f16:  # the reference sees the weights the file stores
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim >= 2 and "embed_positions" not in name:
                    p.copy_(p.half().float())
    return model


def random_mel(seed: int):
    """The spectrogram the tiny Whisper is fed: (80, 3000) float32 standard normal draws
    from `numpy.random.default_rng(seed)`."""
    import numpy as np

    return np.random.default_rng(seed).standard_normal((80, 3000)).astype(np.float32)
