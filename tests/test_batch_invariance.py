"""Batch invariance: a sequence's tokens and logits do not depend on what else is in its
batch. Alone or beside other sequences, a greedy or seeded generation gets the very same
logits, bit for bit, so the same tokens: a batched run can be checked against a stored
solo one (the JSONSchemaBench sample in test_grammar.py is).

What makes it so (the CPU engine):

- decode steps of up to `cpu.ROWS_MAX_T` (8, the default `max_batch`) sequences, on the
  fused stack and layer by layer: every matrix goes through the one-row gemv or the
  multi-row kernel, which give a row of x the same bits (`simd`: each row's arithmetic
  written out without reassociation); norms, activations and attention run per row;
- prefill passes over several prompts (`LlamaModel.hidden_batch`): each prompt's rows get
  the kernel its own chunk length picks (`cpu.matmul_chunks`), and every kernel computes a
  row the same way whatever the other rows (the two-stage kernel pads x to four rows at a
  time; OpenBLAS's sgemm does for two rows or more); attention runs per prompt;
- the scheduler cuts a prompt into the same chunks whatever else is running.

Not covered, and by how much they differ (SmolLM2-135M's logits, measured):

- decode steps of more than 8 sequences (`max_batch` above 8): the rows go through the
  two-stage kernel, whose sums run in another order than the gemv's (up to 4e-5); the
  multi-row kernel there cost 20-40% of those steps' matrix time on Q4_1;
- a prompt whose beginning is read from a cache another sequence left (a slot's cached
  prompt continued in place or forked, a prefix cache): its remaining tokens are read as
  a chunk of another length than alone, so with other kernels (up to 7.5e-5; the tokens
  of the runs measured stayed the same). The generations below share no beginning;
- formats without a multi-row kernel (Q5_K, F16, BF16) in decode steps of 3 to 8
  sequences, mixture-of-experts layers in prefill, and the GPU backends.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tests.test_kernels import random_weight
from workbench.kernels import cpu

# Prompts with no shared first token (SmolLM2 adds no BOS), of mixed lengths: a batch's
# later sequences take slots that others used, and must not continue their prompts there.
SUBJECT = "The old lighthouse keeper climbed the stairs every evening and"
NEIGHBOURS = [
    "Once upon a time",
    "def fibonacci(n):\n    ",
    "Paris is the capital of",
    "1, 2, 3, 5, 8, 13,",
    ("A long report on the harvest: the wheat came in early this year, the barley late, "
     "and the rain that fell in the last week of August kept the farmers from the fields "
     "for nine days, so that the oats were cut wet and had to be dried in the barns. "
     "The cattle did well on the late grass. In the village the talk was all of"),
    "Q: What is the boiling point of water?\nA:",
    "Dear Sir, I write to inform you that",
    "import numpy as np\nx =",
    "Roses are red, violets are",
    "In 1969 the first men",
    "Ingredients: two eggs, a cup of flour,",
    "SELECT name FROM users WHERE",
    "Mount Everest is",
    "Step 1: open the box. Step 2:",
    "Hello",
]
OPTIONS = {"greedy": dict(temperature=0), "seeded": dict(temperature=0.9, top_p=0.95)}
SEED = 7
MAX_TOKENS = 24


@pytest.fixture
def path(request, smollm2):
    """The session's SmolLM2 on the fused decode stack or layer by layer (restored after),
    its cached prompts forgotten before and after."""
    model = smollm2.model
    was = model.fused_decode
    model.fused_decode = request.param == "fused"
    smollm2.reset()
    yield request.param
    model.fused_decode = was
    smollm2.reset()


class LogitsRecorder:
    """A logits processor that keeps a copy of every row of logits it is shown, by the
    prompt of the sequence (ids: the prompt, then the tokens so far)."""

    def __init__(self, prompts: list[list[int]]):
        self.prompts = [np.asarray(p) for p in prompts]
        self.rows: dict[int, list[np.ndarray]] = {i: [] for i in range(len(prompts))}

    def __call__(self, ids, logits):
        for i, p in enumerate(self.prompts):
            if len(ids) >= len(p) and np.array_equal(ids[: len(p)], p):
                self.rows[i].append(logits.copy())
                break
        return logits


def generate(llm, prompts: list[str], kind: str, seeds: list[int]):
    """`generate_batch` of `prompts` (sequence i seeded with seeds[i]): their token ids and
    the logits each token was picked from. The model's cached prompts are forgotten
    first: every prompt is read from its first token."""
    rec = LogitsRecorder([llm.tokenize(p) for p in prompts])
    llm.reset()
    runs = llm.generate_batch(prompts, seed=seeds, max_tokens=MAX_TOKENS,
                              logits_processors=[rec], **OPTIONS[kind])
    return [c.token_ids for c in runs], [rec.rows[i] for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [2, 5, 16])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("path", ["fused", "layers"], indirect=True)
def test_a_generation_is_the_same_alone_and_in_a_batch(smollm2, path, kind, batch):
    """A greedy and a seeded generation alone, then amid 1, 4 and 15 neighbours of mixed
    lengths (through the scheduler, `max_batch` 8: of 16, the later ones wait for a place,
    the generation among them): the same token ids, each picked from bit-identical
    logits."""
    at = batch // 2  # its place in the batch
    prompts = NEIGHBOURS[: batch - 1]
    prompts.insert(at, SUBJECT)
    seeds = [SEED + i for i in range(batch)]
    alone_ids, alone_logits = generate(smollm2, [SUBJECT], kind, [seeds[at]])
    ids, logits = generate(smollm2, prompts, kind, seeds)
    assert ids[at] == alone_ids[0]
    assert len(logits[at]) == len(alone_logits[0]) == len(ids[at]) > 0
    for step, (a, b) in enumerate(zip(alone_logits[0], logits[at])):
        assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max():.3g}"


# -- the model's passes, one at a time --------------------------------------------------------
def prompt_ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, 20_000, size=n)


@pytest.mark.slow
def test_prefill_passes_are_batch_invariant(smollm2):
    """`hidden_batch` over prompts whose lengths straddle every kernel switch (1, 2, 3, 8,
    9, 64, 65 and 130 tokens): each prompt's hidden states are bit-identical to those of
    a pass over it alone."""
    model = smollm2.model
    lengths = [1, 130, 3, 9, 64, 2, 65, 8, 1, 40]
    prompts = [prompt_ids(n, i) for i, n in enumerate(lengths)]

    def prefill(which: list[int]) -> list[np.ndarray]:
        caches = model.new_pool(len(which), 256).caches()
        return model.hidden_batch([(prompts[i], c) for i, c in zip(which, caches)])

    alone = [prefill([i])[0] for i in range(len(prompts))]
    for which in (list(range(len(prompts))), [0, 8], [2, 7, 5], [1, 6, 3, 4]):
        for i, h in zip(which, prefill(which)):
            assert np.array_equal(h, alone[i]), (which, lengths[i])


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "layers"])
def test_decode_steps_are_batch_invariant(smollm2, fused):
    """Eight sequences at their own positions, each fed the same tokens: the logits of a
    sequence's steps alone and in steps of 2, 5 and 8 sequences are bit-identical (the
    fused stack and the layer-by-layer path)."""
    model = smollm2.model
    was = model.fused_decode
    model.fused_decode = fused
    try:
        lengths = [5, 70, 17, 1, 33, 9, 120, 48]
        prompts = [prompt_ids(n, 10 + i) for i, n in enumerate(lengths)]
        fed = np.random.default_rng(3).integers(100, 20_000, size=(len(prompts), 4))

        def steps(which: list[int]) -> np.ndarray:
            caches = model.new_pool(len(which), 256).caches()
            for i, c in zip(which, caches):
                model.hidden(prompts[i], c)
            return np.stack([model.logits(model.decode(fed[which, s], caches))
                             for s in range(fed.shape[1])], axis=1)  # (N, steps, n_vocab)

        alone = [steps([i])[0] for i in range(len(prompts))]
        for which in ([3, 6], [0, 2, 4, 5, 7], list(range(8))):
            for i, row in zip(which, steps(which)):
                assert np.array_equal(row, alone[i]), (which, i)
    finally:
        model.fused_decode = was


# -- the kernels ------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", list(cpu.ROWS_KERNELS), ids=lambda t: t.name)
def test_decode_kernels_give_a_row_the_same_bits_whatever_the_batch(qtype):
    """`matmul` of 1 to `cpu.ROWS_MAX_T` rows (gemv, then the multi-row kernel: passes of 8,
    4, 2 and 1 rows, zero rows added): row i has the bits of row i alone, over K = 4864
    (Qwen's feed-forward width) and N = 13."""
    rng = np.random.default_rng(int(qtype) + 7)
    n, k = 13, 4864
    raw = random_weight(qtype, n, k, rng)
    x = rng.standard_normal((cpu.ROWS_MAX_T, k)).astype(np.float32)
    alone = [cpu.matmul(x[i : i + 1].copy(), raw, qtype)[0] for i in range(len(x))]
    for T in range(2, cpu.ROWS_MAX_T + 1):
        y = cpu.matmul(x[:T].copy(), raw, qtype)
        for i in range(T):
            assert np.array_equal(y[i], alone[i]), (T, i)


@pytest.mark.parametrize("qtype", list(cpu.KERNEL_TYPES), ids=lambda t: t.name)
def test_chunked_matmul_gives_each_chunk_its_own_bits(qtype, monkeypatch):
    """`matmul_chunks` over chunks of 1, 2, 3, 8, 9, 30, 64 and 65 rows in one x (every
    kernel `matmul` picks): each chunk's rows have the bits of `matmul` of that chunk
    alone; and the two-stage kernel (in either form) gives a row the same bits wherever
    it sits among 9 to 64 rows, the outer-product form among any number."""
    monkeypatch.setattr(cpu, "TILE_WEIGHTS", 16 * 768)  # several tiles, the last partial
    rng = np.random.default_rng(int(qtype) + 11)
    n, k = 37, 768
    raw = random_weight(qtype, n, k, rng)
    counts = [3, 65, 1, 9, 2, 64, 30, 8, 1]
    x = rng.standard_normal((sum(counts), k)).astype(np.float32)
    y = cpu.matmul_chunks(x, raw, qtype, counts)
    start = 0
    for c in counts:
        assert np.array_equal(y[start : start + c], cpu.matmul(x[start : start + c], raw, qtype)), c
        start += c
    for kernel in (cpu.gemv_dequant_rows, cpu.gemv_outer):
        z = kernel(x[:64], raw, qtype)
        for a, b in ((0, 9), (5, 18), (30, 63)):
            assert np.array_equal(kernel(x[a:b].copy(), raw, qtype), z[a:b])
    z = cpu.gemv_outer(x, raw, qtype)  # 183 rows: passes of 64, 64 and 55
    for a, b in ((0, 1), (60, 70), (100, 183)):
        assert np.array_equal(cpu.gemv_outer(x[a:b].copy(), raw, qtype), z[a:b])


def test_fp32_weights_run_one_row_chunks_alone():
    """F32 matrices go through NumPy's BLAS, whose one-row product (a gemv) has other bits
    than the same row among others: `matmul(counts=...)` runs one-row chunks alone."""
    from workbench.kernels.linear import QuantizedWeight

    rng = np.random.default_rng(5)
    w = rng.standard_normal((40, 64)).astype(np.float32)
    weight = QuantizedWeight.from_gguf_tensor(w, Q.F32, (40, 64))
    counts = [1, 5, 1, 3]
    x = rng.standard_normal((10, 64)).astype(np.float32)
    y = weight.matmul(x, counts)
    start = 0
    for c in counts:
        assert np.array_equal(y[start : start + c], weight.matmul(x[start : start + c])), c
        start += c
