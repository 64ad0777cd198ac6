"""GGUF reading: our header parser against gguf.GGUFReader, and clear errors on bad files."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from workbench import LLM
from workbench.engine.formats.gguf import GGUFError, UnsupportedArchitectureError, open_gguf
from workbench.engine.formats.sources import pull
from workbench.registry import ModelNotFoundError


@pytest.fixture(scope="module")
def smollm2_path():
    return pull("smollm2-135m")


@pytest.mark.slow
def test_parser_agrees_with_gguf_reader(smollm2_path):
    ours = open_gguf(smollm2_path)
    ref = GGUFReader(smollm2_path)
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == t.tensor_type
        assert mine.shape == tuple(reversed([int(d) for d in t.shape]))
        assert np.array_equal(np.asarray(mine.data), np.asarray(t.data)), t.name
    for name, field in ref.fields.items():
        if name.startswith("GGUF."):
            continue
        value, expected = ours.metadata[name], field.contents()
        if isinstance(value, np.ndarray):
            assert np.array_equal(value, np.asarray(expected)), name
        elif isinstance(value, float):
            assert value == pytest.approx(expected, rel=1e-7), name
        else:
            assert value == expected, name


def _write_gguf(path, arch: str) -> None:
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        LLM.load(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError, match="Known aliases"):
        LLM.load("no-such-model-alias")


def test_random_bytes_are_not_gguf(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(GGUFError, match="not a GGUF file"):
        LLM.load(path)


def test_empty_file_is_not_gguf(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        open_gguf(path)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_truncated_gguf(tmp_path, smollm2_path, keep):
    data = smollm2_path.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFError, match="truncated"):
        LLM.load(path)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba9.gguf"
    _write_gguf(path, "mamba9")
    with pytest.raises(UnsupportedArchitectureError,
                       match="'mamba9'.*llama, qwen2, qwen3, qwen2moe, qwen3moe, phi3, gemma3"):
        LLM.load(path)
    assert issubclass(UnsupportedArchitectureError, ValueError)


def test_small_file_metadata(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama")
    g = open_gguf(path)
    assert g.architecture == "llama"
    assert g.metadata["llama.block_count"] == 1
    t = g.tensor("token_embd.weight")
    assert t.qtype == GGMLQuantizationType.F32 and t.shape == (4, 8)
    with pytest.raises(GGUFError, match="no tensor 'output.weight'"):
        g.tensor("output.weight")


def test_unsupported_tensor_type_names_the_tensor(tmp_path):
    from workbench.engine.formats.gguf import UnsupportedTensorTypeError
    from workbench.engine.models.weights import linear

    path = tmp_path / "iq4.gguf"
    w = GGUFWriter(str(path), "llama")
    # IQ4_NL: 32 weights in 18 bytes per block; 2 rows of 64 weights
    w.add_tensor("blk.0.attn_q.weight", np.zeros((2, 36), dtype=np.uint8),
                 raw_dtype=GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = open_gguf(path)
    assert g.tensor("blk.0.attn_q.weight").shape == (2, 64)
    with pytest.raises(UnsupportedTensorTypeError, match="'blk.0.attn_q.weight'.*IQ4_NL"):
        linear(g, "blk.0.attn_q.weight")
