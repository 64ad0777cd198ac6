"""Producers of the Whisper goldens (tests/test_whisper.py compares against them).

- `whisper-tiny-random-f32`, `-f16`: a tiny random transformers
  `WhisperForConditionalGeneration` (tests/support/tiny_encoders.tiny_whisper) written to
  `.bin` by tests/whisper_to_bin.py, with transformers' encoder output and decoder logits
  on a seeded random spectrogram;
- `whisper-tiny-random-q8_0`: the same model written with Q8_0 matrices, and the F32
  model's logits at the last of a few tokens;
- `whisper-log-mel-jfk`: transformers' `WhisperFeatureExtractor` on ../shared's jfk.wav;
- `whisper-base-translate-fr-ct2`: CTranslate2 (faster-whisper's engine) translating
  espeak-ng French speech with whisper-base, greedy, fed our spectrogram: its tokens and
  a fixed subset of its logits (the full array is 5 MB);
- `whisper-cpp-tiny-en-jfk`: whisper.cpp (pywhispercpp) transcribing JFK from the
  whisper-tiny.en file our converter writes, with that file's sha256.

The peers are imported inside the producers only.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np

from tests.goldens import Golden, digest, peer_versions
from tests.support.shared import shared_file
from tests.support.speech import FRENCH, espeak_wav, jfk_pcm
from tests.support.tiny_encoders import random_mel, tiny_whisper
from tests.whisper_to_bin import F16, F32, Q8_0, write_bin

JFK_WAV = ("data", "whisper", "jfk.wav")
# the tiny model's vocabulary as written to its .bin: one byte per token
TINY_TOKENS = [bytes([i]) for i in range(100)]
# The French translation's logits kept: every LOGIT_STRIDE-th vocabulary column, and the
# columns of the peer's TOP_K largest logits at each step (where greedy decoding decides).
LOGIT_STRIDE = 8
TOP_K = 16


def _tiny_bin(model, matrix_type: int) -> bytes:
    """The bytes tests/whisper_to_bin.py writes for `model`."""
    from workbench.engine.formats.convert import mel_filters

    with tempfile.TemporaryDirectory() as tmp:
        path = write_bin(model, Path(tmp) / "tiny.bin", mel_filters(80), TINY_TOKENS,
                         matrix_type)
        return path.read_bytes()


def tiny_random(f16: bool) -> Golden:
    """transformers' encoder output (1500, 64) and the decoder's logits (8, 120) at every
    position of a token sequence, on `random_mel(0)`, and the .bin of the same weights."""
    import torch

    model = tiny_whisper(f16)
    mel, tokens = random_mel(0), [1, 5, 7, 9, 11, 13, 17, 19]
    with torch.no_grad():
        features = torch.from_numpy(mel)[None]
        encoder_output = model.model.encoder(features).last_hidden_state[0].numpy()
        logits = model(input_features=features,
                       decoder_input_ids=torch.tensor([tokens])).logits[0].numpy()
    return Golden(
        peer=peer_versions("torch", "transformers"),
        inputs={"model": f"tests/support/tiny_encoders.tiny_whisper(f16={f16})",
                "file": "tiny.bin", "matrix_type": "F16" if f16 else "F32",
                "mel_seed": 0, "mel_sha256": _sha256(mel), "tokens": tokens},
        arrays={"encoder_output": encoder_output.astype(np.float32),
                "logits": logits.astype(np.float32)},
        files={"tiny.bin": _tiny_bin(model, F16 if f16 else F32)})


def tiny_random_f32() -> Golden:
    return tiny_random(False)


def tiny_random_f16() -> Golden:
    return tiny_random(True)


def tiny_random_q8_0() -> Golden:
    """The F32 model's logits (120,) after four tokens on `random_mel(1)`, and the model
    written with Q8_0 matrices (what the engine runs)."""
    import torch

    model = tiny_whisper(False)
    mel, tokens = random_mel(1), [1, 5, 7, 9]
    with torch.no_grad():
        logits = model(input_features=torch.from_numpy(mel)[None],
                       decoder_input_ids=torch.tensor([tokens])).logits[0, -1].numpy()
    return Golden(
        peer=peer_versions("torch", "transformers"),
        inputs={"model": "tests/support/tiny_encoders.tiny_whisper(f16=False)",
                "file": "q8_0.bin", "matrix_type": "Q8_0",
                "mel_seed": 1, "mel_sha256": _sha256(mel), "tokens": tokens},
        arrays={"last_logits": logits.astype(np.float32)},
        files={"q8_0.bin": _tiny_bin(model, Q8_0)})


def log_mel_jfk() -> Golden:
    """`WhisperFeatureExtractor(feature_size=80)` on jfk.wav: (80, 3000) float32."""
    from transformers import WhisperFeatureExtractor

    features = WhisperFeatureExtractor(feature_size=80)(
        jfk_pcm(), sampling_rate=16000, return_tensors="np").input_features[0]
    return Golden(
        peer=peer_versions("transformers"),
        inputs={"audio": "/".join(JFK_WAV), "audio_sha256": digest(shared_file(*JFK_WAV)),
                "feature_size": 80, "sampling_rate": 16000},
        arrays={"features": features.astype(np.float32)})


def _version(*command: str) -> str:
    """The first line a tool prints for its version, without its data paths."""
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return " ".join(out.splitlines()[0].split(" Data at:")[0].split())


def _french_speech(folder: Path) -> Path:
    """The tests' espeak-ng recipe (tests/support/speech.espeak_wav) on FRENCH, with sox's
    dither seeded (`SOX_OPTS=-R`): sox otherwise dithers its 16-bit output afresh on each
    run, and the stored file would change on every regeneration."""
    with mock.patch.dict("os.environ", {"SOX_OPTS": "-R"}):
        return espeak_wav(FRENCH, "fr", folder)


def base_translate_french() -> Golden:
    """CTranslate2's greedy translation of espeak-ng French (stored as french.wav) with
    whisper-base, fed our spectrogram of it: the tokens after the prompt and the logits
    (steps, n_vocab) along them, of which only a subset is stored (LOGIT_STRIDE, TOP_K)
    with the largest magnitude of the whole array (what the test's tolerance scales)."""
    import ctranslate2

    from workbench import WhisperModel, registry
    from workbench.engine.audio.pcm import load_audio

    with tempfile.TemporaryDirectory() as tmp:
        path = _french_speech(Path(tmp))
        wav, french = path.read_bytes(), load_audio(path)
    base = WhisperModel.load("whisper-base")
    try:
        mel = base.log_mel(french)[:, :3000]  # (n_mels, 3000): one 30 s window
        prompt = base.tokenizer.sot_sequence("fr", "translate", False)
        max_length = base.config.n_text_ctx // 2
    finally:
        base.close()
    peer = ctranslate2.models.Whisper(str(registry.source_folder("whisper-base")),
                                      device="cpu", compute_type="float32", intra_threads=2)
    features = ctranslate2.StorageView.from_array(np.ascontiguousarray(mel[None], np.float32))
    r = peer.generate(features, [prompt], beam_size=1, suppress_blank=True, suppress_tokens=[],
                      return_logits_vocab=True, max_length=max_length)[0]
    tokens = list(r.sequences_ids[0])
    logits = np.stack([np.asarray(x).reshape(-1) for x in r.logits[0]]).astype(np.float32)
    kept = np.abs(logits) < 1e30  # the peer writes -FLT_MAX where it suppressed a token
    top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K]
    columns = np.union1d(np.arange(0, logits.shape[1], LOGIT_STRIDE), top.reshape(-1))
    return Golden(
        peer=peer_versions("ctranslate2"),
        inputs={"alias": "whisper-base", "audio": "french.wav", "text": FRENCH,
                "voice": "fr", "espeak": _version("espeak-ng", "--version"),
                "sox": _version("sox", "--version") + " (SOX_OPTS=-R)", "prompt": prompt,
                "compute_type": "float32", "beam_size": 1, "suppress_blank": True,
                "suppress_tokens": [], "max_length": max_length,
                "logit_columns": f"every {LOGIT_STRIDE}th and each step's top {TOP_K}"},
        outputs={"tokens": tokens, "n_vocab": int(logits.shape[1]),
                 "logit_scale": float(np.abs(logits[kept]).max())},
        arrays={"logits": logits[:, columns], "logit_columns": columns.astype(np.int32)},
        files={"french.wav": wav})


def whisper_cpp_jfk() -> Golden:
    """whisper.cpp's transcript of jfk.wav from the file our converter writes from
    whisper-tiny.en's CTranslate2 folder, and that file's sha256."""
    from pywhispercpp.model import Model

    from workbench import registry
    from workbench.engine.formats.convert import ct2_whisper_to_bin

    with tempfile.TemporaryDirectory() as tmp:
        path = ct2_whisper_to_bin(registry.source_folder("whisper-tiny.en"),
                                  Path(tmp) / "ggml-tiny.en.bin")
        model = Model(str(path), n_threads=2, print_progress=False, print_realtime=False)
        text = " ".join(s.text for s in model.transcribe(str(shared_file(*JFK_WAV))))
        bin_sha256 = digest(path)
    return Golden(
        peer=peer_versions("pywhispercpp"),
        inputs={"alias": "whisper-tiny.en", "converter": "ct2_whisper_to_bin(f16=True)",
                "audio": "/".join(JFK_WAV), "audio_sha256": digest(shared_file(*JFK_WAV)),
                "n_threads": 2},
        outputs={"bin_sha256": bin_sha256, "transcript": text})


def _sha256(array: np.ndarray) -> str:
    """sha256 of an array's bytes (to check that a test regenerates the same input)."""
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


GOLDENS = {
    "whisper-tiny-random-f32": tiny_random_f32,
    "whisper-tiny-random-f16": tiny_random_f16,
    "whisper-tiny-random-q8_0": tiny_random_q8_0,
    "whisper-log-mel-jfk": log_mel_jfk,
    "whisper-base-translate-fr-ct2": base_translate_french,
    "whisper-cpp-tiny-en-jfk": whisper_cpp_jfk,
}
