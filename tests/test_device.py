"""Devices: the probe, explicit choices, and what crosses between host and device.

- `resolve_device("auto")` takes the first of metal, cuda, cpu that this machine has;
  an explicit device that is absent is a `DeviceUnavailableError` naming what to
  install; "mlx" runs MLX on any platform; the choice is the `device` signal.
- Traffic: the CuPy backend's code runs with a counting stand-in for CuPy (NumPy
  underneath; device arrays are a subclass of `np.ndarray` so that every implicit
  copy to the host, `int()`, `float()`, `bool()`, `.item()`, `.tolist()`, is
  counted as well as `asarray` / `asnumpy`). After the prompt, each decode step
  copies one token id to the host and nothing to the device, greedy or sampled.
"""

from __future__ import annotations

import types
import warnings
from collections import Counter

import numpy as np
import pytest

from tests import goldens
from tests.goldens.make_tiny_llama import DEVICE_QWEN3
from tests.support.devices import DEVICES, cuda_on_numpy, open_llm, require_device
from tests.support.tiny_llama import VOCAB

PROMPT = [266, 55, 3, 201, 87, 260, 12, 140, 99, 7, 265, 33]


# -- the probe --------------------------------------------------------------------------------

def test_auto_takes_the_first_device_present(monkeypatch):
    from workbench.engine.runtime import backend

    present = backend.available_devices()
    assert backend.resolve_device("auto") == next(d for d in backend.PROBE_ORDER
                                                  if d in present)
    assert "mlx" in present  # a dev dependency; "auto" still never picks it off a Mac
    monkeypatch.setattr(backend, "_has_metal", lambda: False)
    monkeypatch.setattr(backend, "_has_cuda", lambda: True)
    assert backend.resolve_device("auto") == "cuda"
    monkeypatch.setattr(backend, "_has_metal", lambda: True)
    assert backend.resolve_device("auto") == "metal"
    monkeypatch.setattr(backend, "_has_metal", lambda: False)
    monkeypatch.setattr(backend, "_has_cuda", lambda: False)
    assert backend.resolve_device("auto") == "cpu"


def test_an_absent_device_is_a_clear_error(monkeypatch):
    from workbench.engine.runtime import backend

    monkeypatch.setattr(backend, "_has_cuda", lambda: False)
    monkeypatch.setattr(backend, "_has_metal", lambda: False)
    with pytest.raises(backend.DeviceUnavailableError, match="cupy"):
        backend.resolve_device("cuda")
    with pytest.raises(backend.DeviceUnavailableError, match="mlx"):
        backend.resolve_device("metal")
    with pytest.raises(ValueError, match="unknown device .tpu.; choose one of auto"):
        backend.resolve_device("tpu")


@pytest.fixture(scope="module")
def tiny_path():
    """A tiny random-weight qwen3 (tests/support/tiny_llama.py's variant, weight seed 99),
    from the golden `tiny-llama-device-qwen3`."""
    return goldens.load(DEVICE_QWEN3).file("model.gguf")


def test_mlx_is_the_device_signal(tiny_path):
    require_device("mlx")
    with open_llm(tiny_path, "mlx") as m:
        assert m.device.peek() == "mlx"
        assert type(m.backend).__name__ == "MLXBackend"
        assert m.generate(PROMPT, max_tokens=4, temperature=0).token_ids == \
            open_llm(tiny_path, "cpu").generate(PROMPT, max_tokens=4, temperature=0).token_ids


# -- traffic ----------------------------------------------------------------------------------

class DeviceArray(np.ndarray):
    """A NumPy array standing for one in GPU memory: reading it on the host is counted."""

    traffic: list | None = None

    def _read(self, what: str):
        if DeviceArray.traffic is not None:
            DeviceArray.traffic.append(("down", what, self.nbytes))

    def __int__(self):
        self._read("int")
        return int(np.asarray(self))

    def __float__(self):
        self._read("float")
        return float(np.asarray(self))

    def __bool__(self):
        self._read("bool")
        return bool(np.asarray(self))

    def __index__(self):
        self._read("index")
        return np.asarray(self).__index__()

    def item(self, *args):
        self._read("item")
        return np.asarray(self).item(*args)

    def tolist(self):
        self._read("tolist")
        return np.asarray(self).tolist()


def _on_device(x):
    """What the module returned, as CuPy would: a device array (0-d for a reduction)."""
    if isinstance(x, np.generic):
        return np.asarray(x).view(DeviceArray)
    return x.view(DeviceArray) if isinstance(x, np.ndarray) and not isinstance(
        x, DeviceArray) else x


class CountingNumPy(types.SimpleNamespace):
    """NumPy as a CuPy stand-in: what `asarray` takes from the host and `asnumpy` gives
    back is logged; everything the module makes is a `DeviceArray`."""

    def __init__(self):
        super().__init__()
        self.log: list = []

    def __getattr__(self, name):
        value = getattr(np, name)
        if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, np.ufunc)) or (
                callable(value) and type(value).__name__ == "_ArrayFunctionDispatcher"):
            def device_call(*args, **kwargs):
                out = value(*args, **kwargs)
                return tuple(map(_on_device, out)) if isinstance(out, tuple) else _on_device(out)
            return device_call
        return value

    def asarray(self, a, dtype=None):
        if not isinstance(a, DeviceArray):
            self.log.append(("up", "asarray", np.asarray(a).nbytes))
        return np.asarray(a, dtype=dtype).view(DeviceArray)

    def asnumpy(self, a):
        self.log.append(("down", "asnumpy", np.asarray(a).nbytes))
        return np.array(a)


@pytest.mark.parametrize("graphs", [True, False], ids=["recorded", "unrecorded"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_k=40,
                                                                 top_p=0.9, seed=3)],
                         ids=["greedy", "sampled"])
def test_decode_copies_one_token_id_per_step(tiny_path, sampling, graphs):
    """Both decode paths: the one CUDA graphs record (token and position in device
    buffers) and the one run op by op."""
    from workbench import LLM
    from workbench.engine.formats.gguf import open_gguf
    from workbench.engine.runtime.backend import CupyBackend
    from workbench.kernels.cuda import ReferenceKernels

    xp = CountingNumPy()
    backend = CupyBackend(xp, ReferenceKernels(), graphs=graphs)
    with LLM(open_gguf(tiny_path), backend=backend) as m:
        DeviceArray.traffic = xp.log
        try:  # (the scheduler's thread runs ahead of the reader: the log is the whole run's)
            run = m.generate(PROMPT, max_tokens=9, logit_bias={VOCAB.eos_id: -100.0},
                             **sampling)
            assert len(run.token_ids) == 9
        finally:
            DeviceArray.traffic = None
        assert bool(m._cache.pool.recordings) == graphs
        # a fused step's new recording is checked against the unfused step: two floats
        checks = len(m._cache.pool.recordings) if graphs and m.model._fused else 0
    log = list(xp.log)
    first_down = next(i for i, (d, _, _) in enumerate(log) if d == "down")
    assert any(d == "up" for d, _, _ in log[:first_down])  # the prompt went up
    after = log[first_down:]  # then each token: one id down, nothing up
    assert len(after) == 9 + checks and all(d == "down" and n <= 8 for d, _, n in after), after


def _raises(step):
    raise RuntimeError("cudaErrorStreamCaptureUnsupported")


def _off_by_one(step):
    return lambda: step() + 1.0


@pytest.mark.parametrize("capture, message", [
    (_raises, "cudaErrorStreamCaptureUnsupported"),
    (_off_by_one, "disagrees with the direct one"),
], ids=["capture-raises", "replay-differs"])
def test_a_failed_recording_falls_back_to_the_unrecorded_step(tiny_path, capture, message):
    """A backend that cannot record the decode step (CuPy raising while capturing), or
    whose recording replays to other logits than the step run directly, warns once and
    decodes the same tokens without recordings."""
    from workbench import LLM
    from workbench.engine.formats.gguf import open_gguf

    opts = dict(max_tokens=6, temperature=0, logit_bias={VOCAB.eos_id: -100.0})
    want = open_llm(tiny_path, "cpu").generate(PROMPT, **opts).token_ids
    backend = cuda_on_numpy()
    backend.capture = capture
    with LLM(open_gguf(tiny_path), backend=backend) as m, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert m.generate(PROMPT, **opts).token_ids == want
        assert m.generate(PROMPT[2:], **opts).token_ids == \
            open_llm(tiny_path, "cpu").generate(PROMPT[2:], **opts).token_ids
        assert not m.model._recording and not m._cache.pool.recordings
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "recording the decode step failed" in messages[0]
    assert message in messages[0]


@pytest.mark.parametrize("n_seq", [3, 40])
def test_batched_decode_copies_the_token_ids_once_per_step(tiny_path, n_seq):
    """`generate_batch` on the device, greedy: each step the sequences' picks come down in
    one copy of their ids (one argmax over their rows, with each one's logit bias, not an
    argmax and a wait for the device each), 3 sequences or 40 (one recorded step of 64
    rows); what goes up does not grow with the number of steps; each sequence gets the
    tokens it gets alone."""
    from workbench import LLM
    from workbench.engine.formats.gguf import open_gguf
    from workbench.engine.runtime.backend import CupyBackend
    from workbench.kernels.cuda import ReferenceKernels

    xp = CountingNumPy()
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:]]
    prompts += [PROMPT[i % 7 :] + [i] for i in range(n_seq - len(prompts))]
    bias = {VOCAB.eos_id: -100.0, int(PROMPT[0]): 3.0}
    ups = []
    with LLM(open_gguf(tiny_path), backend=CupyBackend(xp, ReferenceKernels()),
             max_batch=n_seq) as m:
        alone = [m.generate(p, max_tokens=7, temperature=0, logit_bias=bias).token_ids
                 for p in prompts]
        # its recordings first (each new one is checked against the unfused step: two
        # floats come down then), the prompts' tails after what the slots cached included
        for _ in range(2):
            m.generate_batch(prompts, max_tokens=2, temperature=0, logit_bias=bias)
        DeviceArray.traffic = xp.log
        try:
            step_logits, steps, inside = m.model.step_logits, [], []

            def counted(tokens, *args):
                steps.append(len(tokens))
                before = len(xp.log)
                out = step_logits(tokens, *args)
                inside.extend(xp.log[before:])  # what a decode step itself moves
                del xp.log[before:]
                return out

            m.model.step_logits = counted
            for n in (3, 7):
                xp.log.clear()
                steps.clear()
                inside.clear()
                outs = m.generate_batch(prompts, max_tokens=n, temperature=0,
                                        logit_bias=bias)
                # inside the steps: nothing up, and down only the two floats that check
                # a new recording (one per number of rows not recorded before)
                assert all(e == ("down", "asnumpy", 8) for e in inside), inside
                assert len(inside) <= len(set(steps)), (inside, steps)
                assert [o.token_ids for o in outs] == [a[:n] for a in alone]
                # the prompts are read in chunks between decode steps, so the first
                # sequences may decode before the last join: one copy per step, of the
                # ids of the sequences in it (the first token of each comes from its
                # prompt's last chunk, also one copy)
                down = [b for d, _, b in xp.log if d == "down"]
                assert sum(down) == n_seq * n * 8 and len(down) <= len(steps) + n_seq, xp.log
                if n_seq <= 8:
                    assert down == [n_seq * 8] * n, xp.log
                # the last prompts may join after the first sequences finished: many
                # sequences in one step, past the unfused step's 8, not always all 40
                assert max(steps) == n_seq if n_seq <= 8 else max(steps) > 8, steps
                ups.append(sum(d == "up" for d, _, _ in xp.log))
        finally:
            DeviceArray.traffic = None
    if n_seq <= 8:  # (more join in passes that depend on the scheduler thread's timing)
        assert ups[0] == ups[1]


def _host_calls_per_step(tiny_path, n_seq: int, monkeypatch) -> list[int]:
    """generate_batch of n_seq greedy sequences on the CuPy stand-in: for each step that
    decodes, the array calls the scheduler's pick and feed make outside the recorded step
    (each call of the array module, plus each array in a list it is given, and each
    slice or index of a device array)."""
    from workbench import LLM
    from workbench.engine.decoding.scheduler import Scheduler
    from workbench.engine.formats.gguf import open_gguf
    from workbench.engine.runtime.backend import CupyBackend
    from workbench.kernels.cuda import ReferenceKernels

    class CallCountingNumPy(CountingNumPy):
        def __getattr__(self, name):
            value = super().__getattr__(name)
            if not callable(value) or name in ("float32", "int32", "int64"):
                return value

            def call(*args, **kwargs):
                if counting:
                    counted[-1] += 1 + sum(len(a) for a in args if isinstance(a, (list, tuple)))
                return value(*args, **kwargs)
            return call

    counting, counted, decoded = [], [], []
    real_getitem = DeviceArray.__getitem__

    def getitem(self, key):
        if counting:
            counted[-1] += 1
        return real_getitem(self, key)

    backend = CupyBackend(CallCountingNumPy(), ReferenceKernels(), graphs=True)

    def capture(step):
        def replay():  # the recorded step: one launch on a GPU, not counted
            held = counting.copy()
            counting.clear()
            try:
                return step()
            finally:
                counting.extend(held)
        return replay

    backend.capture = capture
    prompts = [PROMPT[i % 7 :] + [i] for i in range(n_seq)]
    with monkeypatch.context() as patch:
        patch.setattr(DeviceArray, "__getitem__", getitem)
        for method in ("_pick_together", "_decode"):
            real = getattr(Scheduler, method)

            def counted_method(self, *args, _real=real, _name=method):
                if _name == "_pick_together":
                    counted.append(0)
                    decoded.append(False)
                else:
                    decoded[-1] = True
                counting.append(True)
                try:
                    return _real(self, *args)
                finally:
                    counting.pop()
            patch.setattr(Scheduler, method, counted_method)
        with LLM(open_gguf(tiny_path), backend=backend, max_batch=n_seq) as m:
            outs = m.generate_batch(prompts, max_tokens=8, temperature=0, stop_tokens=[])
    assert all(len(o.token_ids) == 8 for o in outs)
    return [c for c, d in zip(counted, decoded) if d]


def test_a_running_batch_steps_with_as_many_host_calls_for_40_sequences_as_for_5(
        tiny_path, monkeypatch):
    """Once a batch runs (each step's rows picked and fed back in order), a step's host
    work outside the recording does not grow with the batch: the picks come from the
    step's logits as they are and the ids go back whole (`BatchRow`, `stack_rows`), not
    sliced, stacked and concatenated per sequence (on CuPy each slice is a few
    microseconds of Python: at 64 sequences those were ~0.5 ms a step). The steps where
    the batch changes (sequences joining from their prompts, or leaving at different
    steps, as the scheduler thread's timing has it) stack their rows."""
    five = _host_calls_per_step(tiny_path, 5, monkeypatch)  # on the recording of 8 rows
    forty = _host_calls_per_step(tiny_path, 40, monkeypatch)  # of 64
    steady = Counter(forty).most_common(1)[0][0]  # the running batch's steps
    assert steady < 10 and forty.count(steady) >= 3 and five.count(steady) >= 3, (five, forty)


# -- sampling on the device ---------------------------------------------------------------------

def _backend(device: str):
    from workbench.engine.runtime.backend import get_backend

    require_device(device)
    return cuda_on_numpy() if device == "cuda-on-numpy" else get_backend(device)


GPU_DEVICES = [d for d in DEVICES if d != "cpu"]
HISTORY = [3, 3, 7, 11, 3, 20]


@pytest.mark.parametrize("device", GPU_DEVICES)
def test_device_greedy_equals_the_host_sampler(device):
    from workbench.engine.decoding.sampling import DeviceSampler, Sampler, SamplingParams

    be = _backend(device)
    rng = np.random.default_rng(0)
    mask = rng.random(300) < 0.3
    for i in range(20):
        logits = (rng.standard_normal(300) * 3).astype(np.float32)
        params = SamplingParams(temperature=0, repeat_penalty=1.3, frequency_penalty=0.4,
                                presence_penalty=0.2, logit_bias={5: 2.5, 9: -100.0})
        allowed = mask if i % 2 else None
        want = Sampler(params, 300).sample(logits, HISTORY, allowed)
        got, token = DeviceSampler(params, 300, be).sample_device(be.asarray(logits), HISTORY,
                                                                   allowed)
        assert got == want and int(be.to_host(token)[0]) == got


@pytest.mark.parametrize("device", GPU_DEVICES)
@pytest.mark.parametrize("params", [
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    dict(temperature=1.5, top_k=0, top_p=0.7, min_p=0.0),
    dict(temperature=0.5, top_k=5, top_p=1.0, min_p=0.0, repeat_penalty=1.5),
    dict(temperature=0.7, min_p=0.1),
], ids=["defaults", "top-p", "top-k", "min-p"])
def test_device_sampling_draws_from_the_host_distribution(device, params):
    """Many draws on the device and on the host: the same tokens, with frequencies within
    a total variation distance of 0.05 (2000 draws each; the seeds are fixed)."""
    from workbench.engine.decoding.sampling import DeviceSampler, Sampler, SamplingParams

    be = _backend(device)
    logits = (np.random.default_rng(1).standard_normal(64) * 2).astype(np.float32)
    p = SamplingParams(**params, seed=11)
    host, dev = Sampler(p, 64), DeviceSampler(p, 64, be)
    on_device = be.asarray(logits)
    n = 2000
    a = np.bincount([host.sample(logits, HISTORY) for _ in range(n)], minlength=64) / n
    b = np.bincount([dev.sample_device(on_device, HISTORY)[0] for _ in range(n)],
                    minlength=64) / n
    assert set(np.flatnonzero(b)) <= set(np.flatnonzero(a))
    assert 0.5 * np.abs(a - b).sum() < 0.05, (a, b)


@pytest.mark.parametrize("device", GPU_DEVICES)
def test_rows_picked_together_draw_as_each_alone(device):
    """`DeviceSampler.pick_rows` (the scheduler's pick of a batch's plain sequences) over
    a greedy row with a bias and sampled rows with different top-k / top-p / min-p /
    temperature: the greedy row is its argmax; each sampled row's tokens follow the host
    sampler's distribution (total variation < 0.05 over 2000 draws), drawn from its own
    generator; the ids come down in one copy."""
    from workbench.engine.decoding.sampling import DeviceSampler, Sampler, SamplingParams

    be = _backend(device)
    rng = np.random.default_rng(1)
    logits = [(rng.standard_normal(64) * 2).astype(np.float32) for _ in range(3)]
    params = [SamplingParams(temperature=0, logit_bias={5: 4.0}),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=11),
              SamplingParams(temperature=1.5, top_k=0, top_p=0.7, seed=12)]
    samplers = [DeviceSampler(p, 64, be) for p in params]
    rows = [be.asarray(x) for x in logits]
    n = 2000
    picks = np.array([DeviceSampler.pick_rows(samplers, rows)[0] for _ in range(n)])  # (n, 3)
    bias = np.zeros(64, np.float32)
    bias[5] = 4.0  # the greedy sampler's
    assert (picks[:, 0] == np.argmax(logits[0] + bias)).all()
    for j in (1, 2):
        host = Sampler(params[j], 64)
        a = np.bincount([host.sample(logits[j]) for _ in range(n)], minlength=64) / n
        b = np.bincount(picks[:, j], minlength=64) / n
        assert set(np.flatnonzero(b)) <= set(np.flatnonzero(a))
        assert 0.5 * np.abs(a - b).sum() < 0.05, (j, a, b)
    ids, on_device = DeviceSampler.pick_rows(samplers[:1] * 2, rows[:2])
    assert ids == [int(np.argmax(logits[0] + bias)), int(np.argmax(logits[1] + bias))]
    assert [int(t) for t in be.to_host(on_device)] == ids


@pytest.mark.parametrize("device", GPU_DEVICES)
def test_without_top_k_or_top_p_the_device_draws_the_host_tokens(device, monkeypatch):
    """Without top-k or top-p nothing is sorted (on the host, 152k logits took 16 ms a
    token to sort): the device draws through the vocabulary in its order, as the host
    sampler does, from the same one uniform number a token. So the same seed gives the
    host's tokens on the device, alone (`sample_device`) and in a batch's pick
    (`pick_rows`), with a bias, min-p and masked tokens: all but the few draws (1 to 3
    in 600 here) that fall within the device's float32 rounding of the boundary between
    two tokens, where the host sums in float64."""
    from workbench.engine.decoding.sampling import DeviceSampler, Sampler, SamplingParams

    be = _backend(device)

    def no_sort(*args, **kwargs):
        raise AssertionError("the vocabulary was sorted")

    monkeypatch.setattr(be.xp, "argsort", no_sort)
    monkeypatch.setattr(np, "argsort", no_sort)
    n_vocab = 5000
    rng = np.random.default_rng(2)
    logits = [(rng.standard_normal(n_vocab) * s).astype(np.float32) for s in (1.0, 3.0)]
    logits[1][rng.random(n_vocab) < 0.5] = -np.inf
    params = [SamplingParams(temperature=1.0, seed=4, logit_bias={7: 3.0}),
              SamplingParams(temperature=0.6, min_p=0.02, seed=5)]
    for p, x in zip(params, logits):
        host, dev = Sampler(p, n_vocab), DeviceSampler(p, n_vocab, be)
        on_device = be.asarray(x)
        want = [host.sample(x) for _ in range(300)]
        got = [dev.sample_device(on_device)[0] for _ in range(300)]
        assert sum(a == b for a, b in zip(got, want)) >= 285, (got, want)
        assert len(set(want)) > 20  # they really are draws
    hosts = [Sampler(p, n_vocab) for p in params]
    devs = [DeviceSampler(p, n_vocab, be) for p in params]
    rows = be.asarray(np.stack(logits))
    picks = [DeviceSampler.pick_rows(devs, [rows[0], rows[1]])[0] for _ in range(300)]
    want = [[h.sample(x) for h, x in zip(hosts, logits)] for _ in range(300)]
    assert sum(a == b for a, b in zip(np.ravel(picks), np.ravel(want))) >= 570


def test_sampled_batches_copy_the_token_ids_once_per_step(tiny_path):
    """`generate_batch` sampling on the device: one copy of the sequences' ids per step,
    as greedy batches; the tokens are each seed's own (a rerun gives the same)."""
    from workbench import LLM
    from workbench.engine.formats.gguf import open_gguf
    from workbench.engine.runtime.backend import CupyBackend
    from workbench.kernels.cuda import ReferenceKernels

    xp = CountingNumPy()
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:]]
    opts = dict(max_tokens=6, temperature=0.9, top_p=0.9, seed=5,
                logit_bias={VOCAB.eos_id: -100.0})
    with LLM(open_gguf(tiny_path), backend=CupyBackend(xp, ReferenceKernels())) as m:
        first = [o.token_ids for o in m.generate_batch(prompts, **opts)]
        # once more first: the prompts' tails, read after what the slots cached, make
        # recordings of their own (each new one checked with a copy of two floats)
        assert [o.token_ids for o in m.generate_batch(prompts, **opts)] == first
        DeviceArray.traffic = xp.log
        try:
            xp.log.clear()
            again = [o.token_ids for o in m.generate_batch(prompts, **opts)]
        finally:
            DeviceArray.traffic = None
    assert again == first and all(len(t) == 6 for t in first)
    down = [b for d, _, b in xp.log if d == "down"]
    assert down == [3 * 8] * 6, xp.log


# -- branches and prefix caches on a device cache -------------------------------------------

@pytest.mark.parametrize("device", GPU_DEVICES)
def test_branches_and_prefixes_on_a_device(tiny_path, device):
    """A fork of a device cache (copied on the device) continues like a fresh run; a
    prefix cache saved from it (via the host) restores into another."""
    from workbench.engine.explore.branch import Branch, BranchStore

    with open_llm(tiny_path, device) as m, open_llm(tiny_path, "cpu") as ref:
        store = BranchStore(m, max_active=3)
        root = Branch.create(m, {"temperature": 0}, store=store)
        root.prefill(PROMPT)
        child = root.fork()
        child.commit(int(np.argsort(-child.logits)[1]))  # off the greedy path
        for b in (root, child):
            history = b.tokens
            got = []
            for _ in range(6):
                token, stop, _ = b.produce()
                if stop:
                    break
                b.commit(token)
                got.append(token)
            assert got == ref.generate(history, temperature=0, max_tokens=len(got)).token_ids
        prefix = m.prefix(PROMPT[:8])
        opts = dict(max_tokens=5, temperature=0)
        assert m.generate(PROMPT, prefix=prefix, **opts).token_ids == \
            ref.generate(PROMPT, **opts).token_ids


# -- CUDA graphs, with a stand-in for cupy.cuda ---------------------------------------------------

class _FakeCudaModule:
    """What `CudaGraph` uses of `cupy.cuda`, logging the calls: streams that capture, a
    memory pool, the allocator in force, graph launches."""

    def __init__(self):
        self.log, self.allocator, self.current = [], None, "legacy"
        cuda = self

        class Stream:
            def __init__(self, non_blocking=False):
                self.name = "capture-stream" if non_blocking else "blocking-stream"

            def __enter__(self):
                self.outer, cuda.current = cuda.current, self.name

            def __exit__(self, *exc):
                cuda.current = self.outer

            def begin_capture(self):
                cuda.log.append(("begin", self.name))

            def end_capture(self):
                cuda.log.append(("end", self.name))
                return Graph()

        class Graph:
            def launch(self, stream):
                cuda.log.append(("launch", stream))

        class MemoryPool:
            def malloc(self, size):
                return size

        class _Using:
            def __init__(self, allocator):
                self.allocator = allocator

            def __enter__(self):
                self.outer, cuda.allocator = cuda.allocator, self.allocator

            def __exit__(self, *exc):
                cuda.allocator = self.outer

        self.Stream, self.MemoryPool, self.using_allocator = Stream, MemoryPool, _Using

    def get_current_stream(self):
        return self.current


def test_cuda_graph_captures_on_its_own_stream_and_pool():
    from workbench.engine.runtime.backend import CudaGraph

    cp = types.SimpleNamespace(cuda=_FakeCudaModule())
    seen = []

    def step():
        seen.append((cp.cuda.current, cp.cuda.allocator))
        return "logits"

    graph = CudaGraph(cp, step)
    assert seen == [("capture-stream", graph.pool.malloc)]  # once, recorded, in its pool
    assert cp.cuda.log == [("begin", "capture-stream"), ("end", "capture-stream")]
    assert cp.cuda.allocator is None and cp.cuda.current == "legacy"
    assert graph() == "logits" and graph() == "logits"
    assert cp.cuda.log[2:] == [("launch", "legacy")] * 2  # on the caller's stream


def test_cuda_graph_ends_a_broken_capture_and_reports_its_error():
    from workbench.engine.runtime.backend import CudaGraph

    cp = types.SimpleNamespace(cuda=_FakeCudaModule())

    def step():
        raise ValueError("a bug in the step")

    with pytest.raises(ValueError, match="a bug in the step"):
        CudaGraph(cp, step)
    assert cp.cuda.log == [("begin", "capture-stream"), ("end", "capture-stream")]
    assert cp.cuda.allocator is None and cp.cuda.current == "legacy"


# -- dtype: the device weights' format ---------------------------------------------------------

@pytest.mark.parametrize("device", GPU_DEVICES)
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_dtype_widens_every_device_matrix(tiny_path, device, dtype, monkeypatch):
    """`dtype="f16"` / `"bf16"` (binfer's --dtype): every matrix goes to the device in that
    format, each weight the file's value rounded to it; the logits stay within the
    format's rounding of the file's own (host) logits and greedy decoding picks the same
    tokens. The CPU refuses a dtype, and an unknown one is refused everywhere."""
    from workbench import LLM
    from workbench.engine.runtime import backend
    from workbench.engine.runtime.backend import WEIGHT_DTYPES, widened

    uploaded = []  # the format of each matrix as the device backend receives it
    for cls in (backend.CupyBackend, backend.MLXBackend):
        def spy(self, w, upload=cls._weight):
            uploaded.append(w.qtype)
            return upload(self, w)
        monkeypatch.setattr(cls, "_weight", spy)
    with LLM.load(tiny_path, device="cpu", kv_cache_size=64) as host, \
            open_llm(tiny_path, device, kv_cache_size=64, dtype=dtype) as m:
        n_blocks = len(host.model.blocks)
        assert len(uploaded) >= 2 * n_blocks + 1
        assert set(uploaded) == {WEIGHT_DTYPES[dtype]}
        w = host.model.blocks[0].attn.wqkv
        exact = w.dequantize()
        rounded = widened(w, dtype).dequantize()
        # one rounding of each weight: half a unit in the last place of the format
        ulp = 2.0 ** -10 if dtype == "f16" else 2.0 ** -7
        assert np.all(np.abs(rounded - exact) <= ulp / 2 * np.abs(exact) + 1e-7)
        assert not np.array_equal(rounded, exact)  # (the test sees the format)
        want = host.forward(PROMPT, host.new_cache())[-1]
        got = m.forward(PROMPT, m.new_cache())[-1]
        spread = float(want.max() - want.min())
        assert np.abs(got - want).max() < (0.01 if dtype == "f16" else 0.05) * spread
        assert not np.array_equal(got, want)
        greedy = dict(temperature=0, max_tokens=12)
        assert m.generate(PROMPT, **greedy).token_ids == host.generate(PROMPT, **greedy).token_ids
    with pytest.raises(ValueError, match="the CPU engine runs the file's own formats"):
        LLM.load(tiny_path, device="cpu", dtype=dtype)
    with pytest.raises(ValueError, match="dtype must be one of f16, bf16"):
        open_llm(tiny_path, device, dtype="fp8")
