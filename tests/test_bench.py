"""`workbench bench`'s limits: the bytes a decoded token reads and the host's bandwidth."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from workbench.bench import bytes_per_token, read_bandwidth


def _model(tensors: dict[str, tuple[int, ...]]) -> SimpleNamespace:
    """The parts of an `LLM` bytes_per_token reads: 2 layers of 3 KV heads of size 8."""
    infos = {name: SimpleNamespace(shape=shape, data=np.zeros(shape, np.float32))
             for name, shape in tensors.items()}
    return SimpleNamespace(_gguf=SimpleNamespace(tensors=infos),
                           config=SimpleNamespace(n_layer=2, n_head_kv=3, head_dim=8))


def test_a_token_reads_every_weight_and_its_context():
    kv = 2 * 2 * 3 * 8  # keys and values of one position, all layers, one byte each
    tied = _model({"token_embd.weight": (100, 16), "blk.0.ffn_up.weight": (32, 16)})
    assert bytes_per_token(tied, 0) == (100 * 16 + 32 * 16) * 4  # the embedding is the head
    assert bytes_per_token(tied, 10) == bytes_per_token(tied, 0) + 10 * kv * 4
    assert bytes_per_token(tied, 10, 2) == bytes_per_token(tied, 0) + 10 * kv * 2
    untied = _model({"token_embd.weight": (100, 16), "output.weight": (100, 16)})
    assert bytes_per_token(untied, 0) == (16 + 100 * 16) * 4  # one embedding row is looked up


def test_the_bandwidth_is_measured_in_gb_per_second():
    gb_s = read_bandwidth(1, size_mb=64, rounds=2)
    assert 0.1 < gb_s < 1000  # a host reads between 100 MB/s and 1 TB/s
