"""Golden runs on the real models against llama.cpp's outputs (../shared/reference).

llama.cpp quantizes activations to 8 bits inside quantized matmuls and keeps
its KV cache in fp16, so its logits differ from exact fp32 arithmetic by a few
tenths and close calls can flip. We do not imitate that. The arbiter at every
disagreement is transformers running the same dequantized weights in fp32
(tests/gguf_to_hf.py): our logits must match it to 1e-4 relative, and wherever
we part from llama.cpp where its top-2 gap is >= 0.05, the fp32 reference must
part from llama.cpp the same way. Each such divergence is reported as a warning
with its gap.

The fp32 reference is stored, not run: the goldens `fp32-arbiter-<case>`
(tests/goldens/make_llamacpp.py) keep, along each of llama.cpp's paths, its argmax at
every position, the scale of its logits and its logits at the ids the checks read (the
top 64 and bottom 16 of each position and a fixed sample across the vocabulary), made from
the model file whose sha256 they name.

Every check runs on the NumPy engine and on the MLX backend (`LLM(device="mlx")`), or
on the devices `WORKBENCH_TEST_DEVICES` names (tests/support/devices.py; "cuda" on a GPU). The
CuPy backend's code on NumPy is left to the tiny models: its reference kernels
dequantize every matrix at every product, too slow for these long runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pytest

from tests.goldens import load
from tests.goldens.make_llamacpp import ALIASES, CASES, golden_name, reference_inputs
from tests.support.devices import DEVICES, open_llm
from tests.support.shared import reference

pytestmark = pytest.mark.slow

NEAR_TIE = 0.05  # top-2 gaps below this may flip between correct implementations


class LlamaCppDivergence(UserWarning):
    """We and the fp32 reference pick another token than llama.cpp at a clear (>= 0.05) gap."""


@dataclass
class Fp32Reference:
    """The fp32 reference along one of llama.cpp's paths, as its golden keeps it: not the
    whole (positions, vocabulary) logits array but what the checks read of it."""

    scale: float  # max |logit| over the whole array
    argmax: np.ndarray  # (T,) the argmax at every position
    ids: np.ndarray  # (T, K) per position: its top 64 and bottom 16 ids, a fixed vocabulary sample
    logits: np.ndarray  # (T, K) its logits at those ids
    top10_first: np.ndarray  # (10,) its logits at llama.cpp's first-step top-10 ids

    def entries(self, logits: np.ndarray) -> np.ndarray:
        """The entries of a (T, vocabulary) `logits` array that this reference keeps."""
        return np.take_along_axis(logits, self.ids, axis=1)


_EXACT: dict[str, list[Fp32Reference]] = {}  # the fp32 reference per model, loaded once


def _exact_logits(name: str, m, ref: dict) -> list[Fp32Reference]:
    """The fp32 reference along each of `ref`'s paths, from the golden made on `m`'s file."""
    if name not in _EXACT:
        golden = load(golden_name(name))
        assert golden.inputs["model_sha256"] == m.file_sha256, (
            f"{golden_name(name)} was made from another {golden.inputs['model_file']}: "
            f"regenerate it with `python -m tests.goldens {golden_name(name)}`")
        read = reference_inputs(ref)
        assert {k: golden.inputs[k] for k in read} == read, (
            f"{golden_name(name)} was made from another {CASES[name]}: "
            f"regenerate it with `python -m tests.goldens {golden_name(name)}`")
        a = golden.arrays
        starts = np.cumsum([0] + [len(p) for p in golden.inputs["paths"]])
        _EXACT[name] = []
        for g, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
            sample = np.broadcast_to(a["sample_ids"], (hi - lo, len(a["sample_ids"])))
            _EXACT[name].append(Fp32Reference(
                scale=float(a["scale"][g]), argmax=a["argmax"][lo:hi],
                ids=np.concatenate([a["top_ids"][lo:hi], a["bottom_ids"][lo:hi], sample], axis=1),
                logits=np.concatenate([a["top_logits"][lo:hi], a["bottom_logits"][lo:hi],
                                       a["sample_logits"][lo:hi]], axis=1),
                top10_first=a["top10_first_logits"][g]))
    return _EXACT[name]


@pytest.fixture(scope="module", params=[(name, device) for name in CASES
                                        for device in DEVICES if device != "cuda-on-numpy"],
                ids=lambda p: f"{p[0]}-{p[1]}")
def golden(request):
    """Our logits, greedy runs and the fp32 reference along llama.cpp's paths."""
    name, device = request.param
    if device == "cpu":
        m = request.getfixturevalue(name)  # the smollm2 / qwen / gemma3 session fixtures
    else:
        m = open_llm(ALIASES[name], device, kv_cache_size=512)
    ref = reference(CASES[name])
    exact = _exact_logits(name, m, ref)
    runs = []
    for gen, ex in zip(ref["generations"], exact):
        path = gen["prompt_ids"] + gen["ids"]
        ours = m.forward(path, m.new_cache(len(path)))
        greedy = m.generate(gen["prompt_ids"], temperature=0, max_tokens=len(gen["ids"]))
        greedy.wait()
        runs.append(dict(gen=gen, ours=ours, exact=ex, greedy=greedy))
    yield f"{name} on {device}", m, runs
    if device != "cpu":
        m.close()


def _fp32_explains(case: str, step: int, ours, theirs, gap: float, exact) -> None:
    """At `step` of `case` we pick `ours` and llama.cpp `theirs` at a clear top-2 `gap`: the
    fp32 reference must pick `ours` too (`exact`), and the divergence is reported as a
    `LlamaCppDivergence` warning."""
    where = f"{case} step {step}: ours {ours}, llama.cpp {theirs} (its top-2 gap {gap:.3f})"
    assert exact == ours, f"{where}, but the fp32 reference {exact}"
    warnings.warn(LlamaCppDivergence(f"{where}; the fp32 reference agrees with ours"))


def _step_logits(run, logits):
    """The rows of `logits` (or of per-position argmaxes) that predict the generated steps."""
    P = len(run["gen"]["prompt_ids"])
    return logits[P - 1 : P - 1 + len(run["gen"]["ids"])]  # row i predicts generated step i


def test_logits_match_fp32_reference(golden):
    """Within 1e-4 of the largest |logit| of the whole fp32 reference, at the entries its
    golden keeps: each position's top 64 and bottom 16 ids (the largest |logit| among them)
    and a fixed sample across the vocabulary (its first and last id and one in each 1/512)."""
    _, _, runs = golden
    for run in runs:
        ours, exact = run["ours"], run["exact"]
        err = np.max(np.abs(exact.entries(ours) - exact.logits))
        assert err <= 1e-4 * exact.scale, (run["gen"]["prompt"], err)


def test_teacher_forced_argmax_matches_llamacpp(golden):
    name, _, runs = golden
    for run in runs:
        gen = run["gen"]
        ours = _step_logits(run, run["ours"]).argmax(-1)
        exact = _step_logits(run, run["exact"].argmax)
        for i, (want, gap) in enumerate(zip(gen["ids"], gen["top2_gap"])):
            if gap < NEAR_TIE or ours[i] == want:
                continue
            case = gen.get("prompt") or gen["messages"][-1]["content"]
            _fp32_explains(f"{name} {gen['kind']} case {case!r}", i, ours[i], want, gap, exact[i])


def test_first_step_top10_logits(golden):
    name, _, runs = golden
    for run in runs:
        gen = run["gen"]
        ids, theirs = np.array(gen["top10_first"]).T
        ids = ids.astype(int)
        P = len(gen["prompt_ids"])
        ours, exact = run["ours"][P - 1, ids], run["exact"].top10_first
        # within 0.25 of llama.cpp, or no further from it than exact arithmetic is
        bound = np.maximum(0.25, np.abs(exact - theirs) + 1e-3)
        assert np.all(np.abs(ours - theirs) <= bound), (name, gen["kind"], ours - theirs)
        if np.abs(ours - theirs).max() > 0.25:
            warnings.warn(LlamaCppDivergence(
                f"{name} {gen['kind']} first-step top-10 logits differ from llama.cpp by up to "
                f"{np.abs(ours - theirs).max():.3f}; fp32 reference: "
                f"{np.abs(exact - theirs).max():.3f}"))


def test_greedy_generation_matches_llamacpp(golden):
    name, m, runs = golden
    for run in runs:
        gen, completion = run["gen"], run["greedy"]
        want = list(gen["ids"])
        got = completion.token_ids
        ends_turn = bool(want) and want[-1] in m.tokenizer.eot_ids
        if ends_turn:  # llama.cpp lists the end-of-turn token; we stop on it
            want = want[:-1]
        n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if n is None:
            if len(got) == len(want):  # the same run
                assert completion.finish_reason == ("stop" if ends_turn else "length")
                continue
            n = min(len(got), len(want))  # one run ended its turn earlier
        near_tie = next((i for i, g in enumerate(gen["top2_gap"]) if g < NEAR_TIE), len(want))
        if n >= near_tie:
            continue
        # a clear-gap divergence: the paths agree up to n, so the fp32 reference
        # along llama.cpp's path sees the same context as we did
        exact = int(_step_logits(run, run["exact"].argmax)[n])
        ours = got[n] if n < len(got) else "end of turn"
        if ours == "end of turn" and exact in m.tokenizer.eot_ids:
            exact = ours  # the reference ends the turn there too
        _fp32_explains(f"{name} greedy {gen['kind']} case", n, ours, gen["ids"][n],
                       gen["top2_gap"][n], exact)


def test_greedy_text_of_agreeing_prefix(golden):
    """Where our greedy run equals llama.cpp's, our text equals its text."""
    _, m, runs = golden
    for run in runs:
        gen, completion = run["gen"], run["greedy"]
        if completion.token_ids == [t for t in gen["ids"] if t not in m.tokenizer.eot_ids]:
            assert completion.text == gen["text"]


def test_qwen_knows_the_capital_of_france(qwen):
    answer = qwen.chat([{"role": "user", "content": "What is the capital of France?"}],
                       temperature=0).text
    assert answer == "The capital of France is Paris."


def test_smollm2_knows_it_with_a_system_prompt(smollm2):
    answer = smollm2.chat([{"role": "system", "content": "You are helpful and concise."},
                           {"role": "user", "content": "What is the capital of France?"}],
                          temperature=0, max_tokens=32).text
    assert answer == "The capital of France is Paris."
