"""WhisperModel against its references.

- whisper.cpp's header-only test files parse (hyperparameters, mel filters,
  vocabulary, special-token layout) for the English-only and multilingual vocabularies.
- A tiny random transformers `WhisperForConditionalGeneration`, written to `.bin` by
  tests/whisper_to_bin.py: encoder output and decoder logits match transformers to 1e-4
  relative (max |ours - ref| <= 1e-4 * max |ref|), F32 and F16.
- The real models, pulled from PyPI and converted from CTranslate2 by our converter:
  tiny.en transcribes JFK word for word (greedy and beam 5), espeak-ng speech with word
  error rate <= 0.15, long audio in chunks with silence skipped; base detects English
  and French and translates French as CTranslate2 does. whisper.cpp itself loads the
  converted file.
- The peers' answers (transformers, CTranslate2, whisper.cpp) are stored goldens
  (tests/goldens/data/whisper-*, made by tests/goldens/make_whisper.py): no peer runs here.
- Bad input: stereo 44.1 kHz files, empty audio, NaN samples, truncated files.

The fidelity checks run on every device: the NumPy engine ("cpu"), the MLX backend
("mlx", `mlx[cpu]` here) and, for the tiny model and one short transcription, the CuPy
backend's code with NumPy standing in for CuPy ("cuda-on-numpy"). Off the cpu a
transcript must be the cpu's token for token (synthetic French on base: within 10% of
its words, a float32 near tie being reported as a warning), and the logits of a real
model must stay within 1e-4 relative of the cpu's.
"""

from __future__ import annotations

import hashlib
import warnings
import wave

import numpy as np
import pytest

from tests.goldens import digest, load
from tests.support.devices import DEVICES, cuda_on_numpy, require_device
from tests.support.shared import reference, shared_file
from tests.support.speech import FRENCH, JFK, espeak_wav, jfk_pcm, wer, words
from tests.support.tiny_encoders import random_mel

RTOL = 1e-4


def _backend(device: str):
    """The `Backend` of a test device other than "cpu"."""
    from workbench.engine.runtime.backend import get_backend

    require_device(device)
    return cuda_on_numpy() if device == "cuda-on-numpy" else get_backend(device)


def net_on(net, device: str):
    """A loaded `Whisper` as it runs on `device`: itself on the cpu, else a `DeviceWhisper`."""
    from workbench.engine.models.whisper import DeviceWhisper

    return net if device == "cpu" else DeviceWhisper(net, _backend(device))


def golden_mel(golden) -> np.ndarray:
    """The random spectrogram a tiny-model golden was made on (checked by its sha256)."""
    mel = random_mel(golden.inputs["mel_seed"])
    assert hashlib.sha256(mel.tobytes()).hexdigest() == golden.inputs["mel_sha256"], \
        "numpy's generator no longer draws the golden's spectrogram"
    return mel


# -- the file format -------------------------------------------------------------------------

@pytest.mark.parametrize("name,n_vocab,multilingual", [
    ("for-tests-ggml-tiny.en.bin", 51864, False), ("for-tests-ggml-tiny.bin", 51865, True)])
def test_header_only_files_parse(name, n_vocab, multilingual):
    from workbench.engine.formats.convert import mel_filters
    from workbench.engine.formats.whisper_file import WhisperFile, WhisperFileError
    from workbench.engine.text.tokenizers.whisper import WhisperTokenizer

    f = WhisperFile(shared_file("data", "whisper", name))
    h = f.hparams
    assert (h.n_vocab, h.n_audio_ctx, h.n_audio_state, h.n_audio_head, h.n_audio_layer) == \
        (n_vocab, 1500, 384, 6, 4)
    assert (h.n_text_ctx, h.n_text_state, h.n_text_head, h.n_text_layer, h.n_mels) == \
        (448, 384, 6, 4, 80)
    assert f.multilingual is multilingual and not f.tensors
    assert f.mel_filters.shape == (80, 201)
    np.testing.assert_array_equal(f.mel_filters, mel_filters(80))  # bit for bit
    assert len(f.tokens) == 50257 and f.tokens[:3] == [b"!", b'"', b"#"]
    tok = WhisperTokenizer(f.tokens, h.n_vocab)
    if multilingual:
        assert (tok.eot, tok.sot, tok.transcribe, tok.no_timestamps, tok.timestamp_begin) == \
            (50257, 50258, 50359, 50363, 50364)
        assert len(tok.languages) == 99 and tok.language_token("fr") == 50265
        assert tok.sot_sequence("fr") == [50258, 50265, 50359, 50363]
    else:
        assert (tok.eot, tok.sot, tok.no_timestamps, tok.timestamp_begin) == \
            (50256, 50257, 50362, 50363)
        assert tok.sot_sequence("en", timestamps=True) == [50257]
        with pytest.raises(ValueError, match="English-only"):
            tok.language_token("fr")
    ids = [f.tokens.index(t) for t in (b"The", b" quick", b" brown")]
    assert tok.decode(ids + [tok.eot, tok.timestamp_begin]) == "The quick brown"
    assert tok.token_text(tok.timestamp_begin + 50) == "<|1.00|>"
    from workbench.engine.whisper import WhisperModel

    with pytest.raises(WhisperFileError, match="holds no tensors"):
        WhisperModel(f)


def test_bad_files_give_clear_errors(tmp_path):
    from workbench.engine.formats.whisper_file import WhisperFile, WhisperFileError

    data = shared_file("data", "whisper", "for-tests-ggml-tiny.en.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:5000])
    with pytest.raises(WhisperFileError, match="truncated inside the mel filters"):
        WhisperFile(tmp_path / "cut.bin")
    (tmp_path / "cut2.bin").write_bytes(data[: len(data) - 1000])
    with pytest.raises(WhisperFileError, match="truncated inside the vocabulary"):
        WhisperFile(tmp_path / "cut2.bin")
    (tmp_path / "gguf.bin").write_bytes(b"GGUF" + data[4:100])
    with pytest.raises(WhisperFileError, match="load it with LLM or Encoder"):
        WhisperFile(tmp_path / "gguf.bin")
    with pytest.raises(FileNotFoundError):
        WhisperFile(tmp_path / "missing.bin")


# -- a tiny random Whisper from transformers ------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("f16", [False, True], ids=["f32", "f16"])
def test_tiny_whisper_matches_transformers(f16, device):
    """The goldens whisper-tiny-random-f32/-f16 hold the tiny model's .bin and
    transformers' encoder output and logits at every position of `tokens`."""
    from workbench.engine.formats.whisper_file import WhisperFile
    from workbench.engine.models.whisper import Whisper

    golden = load(f"whisper-tiny-random-{'f16' if f16 else 'f32'}")
    net = net_on(Whisper(WhisperFile(golden.file("tiny.bin"))), device)
    mel, tokens = golden_mel(golden), golden.inputs["tokens"]
    ref_enc, ref_logits = golden.arrays["encoder_output"], golden.arrays["logits"]
    enc = net.encode(mel)
    if device != "cpu":  # the encoder output stays on the device
        assert not isinstance(enc, np.ndarray) or device == "cuda-on-numpy"
        enc = net.backend.to_host(enc)
    assert np.abs(enc - ref_enc).max() <= RTOL * np.abs(ref_enc).max()
    # the whole sequence in one call
    logits = net.decode(np.array([tokens]), net.new_cache(enc), all_logits=True)[0]
    assert np.abs(logits - ref_logits).max() <= RTOL * np.abs(ref_logits).max()
    # a 3-token prompt, then one token at a time through the KV cache
    cache = net.new_cache(enc)
    steps = [net.decode(np.array([tokens[:3]]), cache)[0]]
    steps += [net.decode(np.array([[t]]), cache)[0] for t in tokens[3:]]
    assert np.abs(np.stack(steps) - ref_logits[2:]).max() <= RTOL * np.abs(ref_logits).max()
    # three sequences at once, reordered as beam search does
    other = [1, 13, 11, 17]
    cache = net.new_cache(enc, batch=3)
    net.decode(np.array([tokens[:4], [1, 9, 7, 5], other]), cache)
    cache.reorder([2, 0, 0])
    out = net.decode(np.array([[tokens[4]]] * 3), cache)
    assert np.abs(out[1:] - ref_logits[4]).max() <= RTOL * np.abs(ref_logits).max()
    alone = net.decode(np.array([other + [tokens[4]]]), net.new_cache(enc))[0]
    assert np.abs(out[0] - alone).max() <= RTOL * np.abs(alone).max()
    with pytest.raises(ValueError, match="token ids must lie in"):
        net.decode(np.array([[120]]), net.new_cache(enc))


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_whisper_q8_0(device):
    """Q8_0 matrices (whisper.cpp's quantized files) run on the quantized kernels. The
    golden whisper-tiny-random-q8_0 holds the model's Q8_0 .bin and the F32 model's
    transformers logits at the last token."""
    from gguf import GGMLQuantizationType

    from workbench.engine.formats.whisper_file import WhisperFile
    from workbench.engine.models.whisper import Whisper

    golden = load("whisper-tiny-random-q8_0")
    f = WhisperFile(golden.file("q8_0.bin"))
    assert f.tensors["encoder.blocks.0.mlp.0.weight"].qtype == GGMLQuantizationType.Q8_0
    net = Whisper(f)
    assert net.encoder_blocks[0].up.qtype == GGMLQuantizationType.Q8_0
    net = net_on(net, device)
    mel, tokens = golden_mel(golden), golden.inputs["tokens"]
    ref = golden.arrays["last_logits"]
    ours = net.decode(np.array([tokens]), net.new_cache(net.encode(mel)))[0]
    cos = float(ours @ ref / np.linalg.norm(ours) / np.linalg.norm(ref))
    assert cos >= 0.999 and int(np.argmax(ours)) == int(np.argmax(ref))


def test_log_mel_matches_transformers_feature_extractor():
    """The golden whisper-log-mel-jfk holds transformers' `WhisperFeatureExtractor` on
    jfk.wav."""
    from workbench.engine.audio.mel import N_SAMPLES, log_mel_spectrogram
    from workbench.engine.formats.convert import mel_filters

    golden = load("whisper-log-mel-jfk")
    assert digest(shared_file("data", "whisper", "jfk.wav")) == golden.inputs["audio_sha256"]
    ours = log_mel_spectrogram(jfk_pcm(), mel_filters(80), padding=N_SAMPLES)[:, :3000]
    ref = golden.arrays["features"]
    assert ours.shape == ref.shape == (80, 3000)
    assert np.abs(ours - ref).max() < 2e-3  # float32 STFT (theirs) against float64 (ours)


# -- the real models --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def whisper():
    """`whisper(alias, device)`: the model, loaded once per alias and device in this module."""
    from workbench import WhisperModel
    from workbench.engine.formats import sources
    from workbench.engine.formats.whisper_file import WhisperFile

    models = {}

    def get(alias: str, device: str = "cpu") -> WhisperModel:
        if (alias, device) not in models:
            if device == "cuda-on-numpy":
                models[alias, device] = WhisperModel(WhisperFile(sources.resolve(alias)),
                                                     backend=_backend(device))
            else:
                require_device(device)
                models[alias, device] = WhisperModel.load(alias, device=device)
        return models[alias, device]

    yield get
    for m in models.values():
        m.close()


@pytest.fixture(scope="module")
def tiny_en(whisper):
    return whisper("whisper-tiny.en")


_CPU_TRANSCRIPTS: dict[tuple, object] = {}  # the cpu's transcripts, made once per input


class DeviceTranscriptDivergence(UserWarning):
    """A device's transcript parts from the cpu's at a near tie (reported, not failed)."""


def transcribe(whisper, alias: str, device: str, audio_id: str, audio, *, exact: bool = True,
               **options):
    """`whisper(alias, device).transcribe(audio, **options)`; off the cpu the transcript must
    be the cpu's, token for token and segment for segment. `exact=False` (for audio where
    the model hesitates between words, as on synthetic French) lets float32 rounding pick
    the other side of a near tie: at most 10% of the words may then differ from the
    cpu's, and the difference is reported as a warning."""
    t = whisper(alias, device).transcribe(audio, **options)
    key = (alias, audio_id, tuple(sorted(options.items())))
    if device == "cpu":
        _CPU_TRANSCRIPTS[key] = t
        return t
    if key not in _CPU_TRANSCRIPTS:
        _CPU_TRANSCRIPTS[key] = whisper(alias).transcribe(audio, **options)
    cpu = _CPU_TRANSCRIPTS[key]
    same = (t, t.tokens, t.segments) == (cpu, cpu.tokens, cpu.segments)
    if exact or same:
        assert same, f"{device}: {str(t)!r}\ncpu: {str(cpu)!r}"
    else:
        assert wer(t, cpu) <= 0.1, f"{device}: {str(t)!r}\ncpu: {str(cpu)!r}"
        warnings.warn(DeviceTranscriptDivergence(f"{alias} on {device}: {str(t)!r}; "
                                                 f"cpu: {str(cpu)!r}"))
    return t


# the real models' long runs (the slow cuda-on-numpy stand-in: one short one, below)
REAL_DEVICES = tuple(d for d in DEVICES if d != "cuda-on-numpy")


@pytest.mark.slow
@pytest.mark.parametrize("device", REAL_DEVICES)
@pytest.mark.parametrize("beam_size", [1, 5])
def test_jfk_word_for_word(whisper, beam_size, device):
    t = transcribe(whisper, "whisper-tiny.en", device, "jfk",
                   shared_file("data", "whisper", "jfk.wav"), beam_size=beam_size)
    assert wer(t, JFK) == 0, str(t)
    assert t.language == "en" and len(t.segments) == 1
    assert t.segments[0].start == 0 and t.segments[0].end == pytest.approx(11.0, abs=0.02)
    assert t.tokens[0] == whisper("whisper-tiny.en").tokenizer.sot


@pytest.mark.slow
@pytest.mark.parametrize("device", REAL_DEVICES)
def test_jfk_timestamps(whisper, device):
    t = transcribe(whisper, "whisper-tiny.en", device, "jfk", jfk_pcm(), timestamps=True)
    assert wer(t, JFK) == 0
    assert len(t.segments) >= 2
    starts = [s.start for s in t.segments]
    assert starts == sorted(starts) and starts[0] <= 1.0
    assert all(s.start < s.end <= 11.0 for s in t.segments)


@pytest.mark.slow
@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
def test_device_logits_match_cpu(whisper, device):
    """tiny.en on JFK: the encoder output and the decoder's logits along the cpu's greedy
    path (one call, and step by step with beams reordered) against the cpu's."""
    cpu, dev = whisper("whisper-tiny.en"), whisper("whisper-tiny.en", device)
    mel = cpu.log_mel(jfk_pcm())[:, :3000]
    ref_enc = cpu.net.encode(mel)
    enc = dev.net.encode(mel)
    assert np.abs(dev.backend.to_host(enc) - ref_enc).max() <= RTOL * np.abs(ref_enc).max()
    path = cpu.transcribe_mel(mel, 1100).tokens  # the prompt, the text, EOT
    ref = cpu.net.decode(np.array([path]), cpu.net.new_cache(ref_enc), all_logits=True)[0]
    ours = dev.net.decode(np.array([path]), dev.net.new_cache(enc), all_logits=True)[0]
    assert np.abs(ours - ref).max() <= RTOL * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    cache = dev.net.new_cache(enc, batch=2)
    dev.net.decode(np.array([path[:3], path[:2] + [path[5]]]), cache)
    cache.reorder([0, 0])
    steps = [dev.net.decode(np.array([[t], [t]]), cache) for t in path[3:8]]
    assert np.abs(np.stack(steps)[:, 1] - ref[3:8]).max() <= RTOL * np.abs(ref).max()


@pytest.mark.slow
def test_cuda_backend_on_numpy_transcribes_like_cpu(whisper):
    """The CuPy backend's code path (NumPy standing in for CuPy) gives the cpu's transcript."""
    t = transcribe(whisper, "whisper-tiny.en", "cuda-on-numpy", "jfk", jfk_pcm(), max_tokens=8)
    assert words(t)[:4] == ["and", "so", "my", "fellow"]


def _espeak(text: str, voice: str, tmp_path) -> np.ndarray:
    """Speech from espeak-ng, as 16 kHz mono samples."""
    from workbench.engine.audio.pcm import load_audio

    return load_audio(espeak_wav(text, voice, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("device", REAL_DEVICES)
def test_espeak_sentences_beam5(whisper, tmp_path, device):
    base = whisper("whisper-base", device)
    text = reference("whisper_tiny_en_faster_whisper.json")["espeak_text"]
    pcm = _espeak(text, "en-us", tmp_path)
    t = transcribe(whisper, "whisper-tiny.en", device, "espeak", pcm, beam_size=5)
    assert wer(t, text) <= 0.15, str(t)
    language, p = base.detect_language(pcm)
    assert language == "en" and p > 0.5
    french = _espeak(FRENCH, "fr", tmp_path)
    language, p = base.detect_language(french)
    assert language == "fr" and p > 0.5
    assert base.detect_language_from_encoder(base.encode(french)) == (language, p)
    with pytest.raises(ValueError, match="encoder's output has shape"):
        base.detect_language_from_encoder(np.zeros((4, 4), np.float32))
    t = transcribe(whisper, "whisper-base", device, "espeak-fr", french, language="auto",
                   exact=False)
    assert t.language == "fr" and "paris" in words(t)
    with pytest.raises(ValueError, match="unknown language 'xx'"):
        base.transcribe(french, language="xx")


@pytest.mark.slow
@pytest.mark.parametrize("device", REAL_DEVICES)
def test_translate_french_speech_to_english(whisper, device):
    """whisper-base translates French espeak speech into English token for token as
    CTranslate2 does (greedy, same spectrogram), its logits along the way within float32
    rounding; the language may be given or detected.

    The golden whisper-base-translate-fr-ct2 holds the speech (espeak-ng's french.wav),
    CTranslate2's tokens after the prompt and, of its logits (steps, n_vocab), every 8th
    vocabulary column and each step's 16 largest (the whole array is 5 MB), with the
    largest magnitude of the whole array, which the tolerance is relative to."""
    from workbench.engine.audio.pcm import load_audio

    golden = load("whisper-base-translate-fr-ct2")
    base = whisper("whisper-base")
    french = load_audio(golden.file("french.wav"))
    prompt = base.tokenizer.sot_sequence("fr", "translate", False)
    assert prompt == golden.inputs["prompt"]
    tokens = golden.outputs["tokens"]
    t = transcribe(whisper, "whisper-base", device, "espeak-fr-translate", french,
                   task="translate", language="fr", exact=False)
    if device == "cpu":
        assert t.tokens == prompt + tokens + [base.tokenizer.eot], (str(t),
                                                                   base.tokenizer.decode(tokens))
        net = base.net
        mel = base.log_mel(french)[:, :3000]  # (n_mels, 3000): one 30 s window, as the peer's
        ours = net.decode(np.array([prompt + tokens]), net.new_cache(net.encode(mel)),
                          all_logits=True)[0][len(prompt) - 1:]  # (steps, n_vocab)
        ours = ours[:, golden.arrays["logit_columns"]]
        peer = golden.arrays["logits"]
        kept = np.abs(peer) < 1e30  # the peer writes -FLT_MAX where it suppressed a token
        assert np.abs(ours - peer)[kept].max() <= RTOL * golden.outputs["logit_scale"]
    assert t.language == "fr"
    heard = base.transcribe(french, language="fr")  # the same speech, not translated
    assert "bonjour" in words(heard) and "bonjour" not in words(t), (str(heard), str(t))
    auto = transcribe(whisper, "whisper-base", device, "espeak-fr-translate-auto", french,
                      task="translate", language="auto", exact=False)
    assert auto.language == "fr" and str(auto) == str(t)


@pytest.mark.slow
@pytest.mark.parametrize("device", REAL_DEVICES)
def test_long_audio_in_chunks_skips_silence(whisper, device):
    pcm = jfk_pcm()
    gap = np.zeros(30 * 16000 - len(pcm), np.float32)
    audio = np.concatenate([pcm, gap, pcm, gap, np.zeros(5 * 16000, np.float32)])
    assert len(audio) == 65 * 16000
    t = transcribe(whisper, "whisper-tiny.en", device, "jfk-long", audio)
    assert [(s.start, round(s.end)) for s in t.segments] == [(0.0, 30), (30.0, 60)]
    for segment in t.segments:
        assert wer(segment.text, JFK) == 0, segment.text
    assert wer(t, JFK + " " + JFK) == 0


@pytest.mark.slow
def test_bad_audio(tiny_en, tmp_path):
    import soundfile

    from workbench.engine.audio.pcm import AudioError, load_audio
    from workbench.engine.formats.whisper_file import WhisperFile, WhisperFileError

    # stereo 44.1 kHz: converted, not rejected
    pcm = jfk_pcm()
    import soxr

    stereo = soxr.resample(pcm, 16000, 44100)
    soundfile.write(tmp_path / "stereo.wav", np.stack([stereo, stereo * 0.5], axis=1), 44100)
    with wave.open(str(tmp_path / "stereo.wav")) as w:
        assert (w.getnchannels(), w.getframerate()) == (2, 44100)
    assert len(load_audio(tmp_path / "stereo.wav")) == pytest.approx(len(pcm), abs=2)
    assert wer(tiny_en.transcribe(tmp_path / "stereo.wav"), JFK) == 0
    # empty audio: empty text
    t = tiny_en.transcribe(np.zeros(0, np.float32))
    assert t == "" and t.segments == []
    assert tiny_en.transcribe(np.zeros(16000, np.float32)) == ""  # silence
    # NaN samples: a clear error
    bad = pcm.copy()
    bad[1234] = np.nan
    with pytest.raises(AudioError, match="NaN or infinite samples .* sample 1234"):
        tiny_en.transcribe(bad)
    # not audio
    (tmp_path / "text.wav").write_text("hello")
    with pytest.raises(AudioError):
        tiny_en.transcribe(tmp_path / "text.wav")
    # a truncated model file
    data = tiny_en.path.read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(WhisperFileError, match="truncated"):
        WhisperFile(tmp_path / "cut.bin")
    with pytest.raises(ValueError, match="English-only model; it cannot transcribe .*'fr'"):
        tiny_en.transcribe(pcm, language="fr")
    with pytest.raises(ValueError, match="English-only model; it cannot translate"):
        tiny_en.transcribe(pcm, task="translate")


@pytest.mark.slow
def test_annotations_are_removed():
    from workbench.engine.whisper import clean_text

    assert clean_text(" [BLANK_AUDIO]") == ""
    assert clean_text("Hello [Music] world (inaudible) [silent]!") == "Hello world!"
    assert clean_text("a [note] b") == "a [note] b"


@pytest.mark.slow
def test_whisper_cpp_loads_the_converted_file(tmp_path):
    """whisper.cpp (pywhispercpp) loaded the file our converter writes from whisper-tiny.en
    and transcribed JFK word for word: the golden whisper-cpp-tiny-en-jfk holds that
    file's sha256 and the transcript, and the converter must still write those bytes."""
    from workbench import registry
    from workbench.engine.formats.convert import ct2_whisper_to_bin

    golden = load("whisper-cpp-tiny-en-jfk")
    assert digest(shared_file("data", "whisper", "jfk.wav")) == golden.inputs["audio_sha256"]
    path = ct2_whisper_to_bin(registry.source_folder("whisper-tiny.en", progress=False),
                              tmp_path / "ggml-tiny.en.bin")
    assert digest(path) == golden.outputs["bin_sha256"], \
        "the converter no longer writes the file whisper.cpp loaded: regenerate the golden " \
        "with `python -m tests.goldens whisper-cpp` (needs the [peers] extra)"
    text = golden.outputs["transcript"]
    assert wer(text, JFK) == 0, text


@pytest.mark.slow
def test_cli_transcribe(capsys):
    from workbench.cli import main

    assert main(["transcribe", str(shared_file("data", "whisper", "jfk.wav"))]) == 0
    assert wer(capsys.readouterr().out, JFK) == 0
