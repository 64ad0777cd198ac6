"""Branches on the real SmolLM2: forks continue exactly like fresh runs on the same token
history, share their prefix without copying it, draw different continuations when
reseeded, and run together in one forward pass (decode steps and prompts alike). The
batched prefill under them (`hidden_batch`) is checked against `hidden` per chunk on tiny
random-weight llama and Gemma 3 models (fast)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.devices import DEVICES
from workbench.engine.explore.branch import Branch, BranchStore
from workbench.engine.llm import PREFILL_CHUNK

PROMPT = "The capital of France is"


def _greedy(branch: Branch, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token, stop, _ = branch.produce()
        if stop:
            break
        branch.commit(token)
        out.append(token)
    return out


def _fresh(m, history: list[int], n: int) -> list[int]:
    m.reset()
    return m.generate(history, temperature=0, max_tokens=n).token_ids


@pytest.mark.slow
def test_fork_continues_like_a_fresh_run(smollm2):
    store = BranchStore(smollm2, max_active=4)
    root = Branch.create(smollm2, {"temperature": 0}, store=store)
    root.prefill(smollm2.tokenize(PROMPT))
    _greedy(root, 3)
    child = root.fork()
    grandchild = child.fork()
    assert store.available == 1 and root.children == [child] and child.parent is root
    second_best = int(np.argsort(-child.logits)[1])
    child.commit(second_best)  # the child leaves the greedy path at once
    history = {b: b.tokens for b in (root, child, grandchild)}
    continued = {b: _greedy(b, 10) for b in (root, grandchild, child)}
    for b in (root, child, grandchild):
        assert continued[b] == _fresh(smollm2, history[b], len(continued[b])), b
    assert grandchild.tokens[: len(history[root])] == history[root]


def test_produce_gives_the_token_its_stop_and_its_text(smollm2):
    """lloyal's `produce()`: {token, isStop}, here with the token's text."""
    store = BranchStore(smollm2, max_active=2)
    root = Branch.create(smollm2, {"temperature": 0}, store=store)
    root.prefill(smollm2.tokenize(PROMPT))
    produced = root.produce()
    assert produced.token == int(np.argmax(root.logits)) and produced.is_stop is False
    assert produced.text == smollm2.detokenize([produced.token]) == " Paris"
    end = next(iter(smollm2.tokenizer.eot_ids))
    assert root.is_stop(end) and root.produce() == produced  # greedy: the same again
    root.prune()


@pytest.mark.slow
def test_store_commit_runs_all_branches_in_one_pass(smollm2):
    store = BranchStore(smollm2, max_active=4)
    root = Branch.create(smollm2, {"temperature": 0}, store=store)
    root.prefill(smollm2.tokenize(PROMPT))
    branches = [root] + [root.fork() for _ in range(2)]
    for i, b in enumerate(branches):  # three different first tokens
        b.commit(int(np.argsort(-b.logits)[i]))
    starts = [b.tokens for b in branches]
    before = store.forward_passes
    steps = 8
    for _ in range(steps):
        store.commit([(b, b.produce()[0]) for b in branches])
    assert store.forward_passes - before == steps  # one pass per step for all three
    for b, history in zip(branches, starts):
        assert b.tokens[len(history):] == _fresh(smollm2, history, steps)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.slow
def test_a_fork_of_a_long_prefix_costs_far_less_than_a_copy(smollm2):
    cfg = smollm2.config
    store = BranchStore(smollm2, max_active=4, max_len=2048)
    root = Branch.create(smollm2, {"temperature": 0}, store=store)
    prefix = smollm2.tokenize(" ".join(f"Item {i} is on the list." for i in range(110)))
    assert 950 <= len(prefix) <= 1100
    root.prefill(prefix)
    full_copy = 2 * cfg.n_layer * cfg.n_head_kv * len(prefix) * cfg.head_dim * 4  # bytes
    warm = root.fork()  # the first forked decode compiles its kernel: not what we measure
    _greedy(warm, 1)
    warm.prune()
    before = _rss()
    child = root.fork()
    _greedy(child, 8)
    grown = _rss() - before
    assert grown < 0.1 * full_copy, (grown, full_copy)
    # and the child still equals a fresh run
    assert child.generated == _fresh(smollm2, prefix, len(child.generated))


@pytest.mark.slow
def test_sampler_state_forks_too(smollm2):
    root = Branch.create(smollm2, {"temperature": 1.0, "seed": 3, "top_k": 0, "top_p": 1.0,
                                   "min_p": 0.0})
    root.prefill(smollm2.tokenize(PROMPT))
    twin = root.fork()
    draws = [(root.produce()[0], twin.produce()[0]) for _ in range(20)]
    assert all(a == b for a, b in draws)  # same random state, same logits, same tokens
    assert len({a for a, _ in draws}) > 1  # and they really are random draws


@pytest.mark.slow
def test_prune_retain_only_and_leases(smollm2):
    store = BranchStore(smollm2, max_active=3)
    root = Branch.create(smollm2, {"temperature": 0}, store=store)
    root.prefill(smollm2.tokenize(PROMPT))
    a, b = root.fork(), root.fork()
    assert store.available == 0
    with pytest.raises(RuntimeError, match="slots are in use"):
        root.fork()
    with pytest.raises(RuntimeError, match="live children"):
        root.prune()
    b.prune()
    assert store.available == 1 and root.children == [a]
    with pytest.raises(RuntimeError, match="pruned"):
        b.produce()
    a.commit(int(np.argsort(-a.logits)[1]))
    history = a.tokens
    store.retain_only(a)  # a copies root's positions into its own slot; root goes
    assert not root.alive and a.alive and a.parent is None and store.available == 2
    assert a.cache.shared_until == 0
    c = Branch.create(smollm2, {"temperature": 0}, store=store)  # reuses root's old slot
    c.prefill(smollm2.tokenize("Bananas are"))
    assert _greedy(a, 6) == _fresh(smollm2, history, 6)


@pytest.mark.slow
def test_iteration_perplexity_and_grammar(smollm2):
    branch = Branch.create(smollm2, {"temperature": 0}, max_tokens=12, logprobs=3)
    branch.prefill(smollm2.tokenize(PROMPT))
    events = list(branch)
    expected = smollm2.generate(PROMPT, temperature=0, max_tokens=12, logprobs=3)
    assert "".join(e.text for e in events) == expected.text
    logprobs = [e.logprob for e in events if e.id is not None]
    np.testing.assert_allclose(logprobs, [e.logprob for e in expected.events if e.id],
                               atol=1e-4)
    assert branch.perplexity == pytest.approx(np.exp(-np.mean(logprobs)), rel=1e-4)
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    constrained = Branch.create(smollm2, {"temperature": 0}, schema=schema, max_tokens=40)
    constrained.prefill(smollm2.tokenize(smollm2.apply_chat_template(
        [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]),
        add_bos=False))
    text = "".join(e.text for e in constrained)
    assert "city" in json.loads(text)


@pytest.mark.slow
def test_branch_hooks_logits_processors_and_kv_remove(smollm2):
    store = BranchStore(smollm2, max_active=3)
    root = Branch.create(smollm2, {"temperature": 0}, store=store)
    root.prefill(smollm2.tokenize(PROMPT))
    greedy = int(np.argmax(root.logits))

    def ban(ids, logits):
        logits[greedy] = -np.inf
        return logits

    banned = Branch.create(smollm2, {"temperature": 0}, store=store, logits_processors=[ban])
    banned.prefill(smollm2.tokenize(PROMPT))
    token, _, _ = banned.produce()
    assert token != greedy and token == int(np.argsort(-banned.logits)[1])
    assert banned.fork().produce()[0] == token  # a fork keeps the processors
    # kv_remove on a branch: continuing equals a fresh run on the remaining tokens
    ids = smollm2.tokenize("My cat is called Tom. My dog is called Rex. The name of my cat is")
    drop = len(smollm2.tokenize(" My dog is called Rex.", add_bos=False))
    start = len(smollm2.tokenize("My cat is called Tom."))
    root.prune()  # the store is full (root, banned and its fork): free a slot
    b = Branch.create(smollm2, {"temperature": 0}, store=store)
    b.prefill(ids)
    with pytest.raises(RuntimeError, match="children"):
        banned.kv_remove(0, 1)
    b.kv_remove(start, start + drop)
    remaining = ids[:start] + ids[start + drop:]
    assert b.tokens == remaining
    assert _greedy(b, 6) == _fresh(smollm2, remaining, 6)


# -- reseeding, tree state ----------------------------------------------------------------

SAMPLED = {"temperature": 0.9, "seed": 5}
STORY = "Once upon a time, in a small village by the sea, there lived"


def _sample(branch: Branch, n: int) -> str:
    for _ in range(n):
        token, stop, _ = branch.produce()
        if stop:
            break
        branch.commit(token)
    return branch.text


@pytest.mark.slow
def test_reseeded_forks_draw_different_continuations(smollm2):
    store = BranchStore(smollm2, max_active=5, max_len=256)
    root = Branch.create(smollm2, SAMPLED, store=store)
    root.prefill(smollm2.tokenize(STORY))
    forks = [root.fork(seed=s) for s in (11, 22, 33, 44)]
    assert [f.sampler.params.seed for f in forks] == [11, 22, 33, 44]
    for _ in range(24):  # all four in one forward pass per token
        store.commit([(f, f.produce()[0]) for f in forks])
    texts = [f.text for f in forks]
    assert len(set(texts)) >= 3, texts


@pytest.mark.slow
def test_the_same_seed_draws_the_same_text(smollm2):
    store = BranchStore(smollm2, max_active=4, max_len=256)
    root = Branch.create(smollm2, SAMPLED, store=store)
    root.prefill(smollm2.tokenize(STORY))
    a, b = root.fork(seed=11), root.fork(seed=11)
    c = root.fork()
    c.reseed(11)  # reseeding after the fork is the same as fork(seed=11)
    texts = [_sample(x, 24) for x in (a, b, c)]
    assert texts[0] == texts[1] == texts[2] and texts[0]
    assert root.sampler.params.seed == 5  # the parent keeps its own random state


@pytest.mark.slow
def test_is_leaf_and_is_active(smollm2):
    store = BranchStore(smollm2, max_active=3, max_len=64)
    root = Branch.create(smollm2, {"temperature": 0}, store=store)
    assert root.is_leaf and root.is_active
    root.prefill(smollm2.tokenize(PROMPT))
    a = root.fork()
    b = a.fork()
    assert not root.is_leaf and not a.is_leaf and b.is_leaf
    b.prune()
    assert a.is_leaf and not b.is_active and a.is_active
    root.prune_subtree()
    assert not root.is_active and not a.is_active and store.available == 3
    with pytest.raises(RuntimeError, match="pruned"):
        a.reseed(1)


# -- prompts of several branches in one pass ------------------------------------------------

LONG = " ".join(f"Item {i} is on the list." for i in range(70))
MEDIUM = "A recipe for bread: flour, water, salt and yeast. " * 8


def _run(branch: Branch, n: int) -> list:
    """Produce and commit `n` tokens: what each step produced and the logits it saw."""
    out = []
    for _ in range(n):
        logits = branch.logits.copy()
        produced = branch.produce()
        branch.commit(produced.token)
        out.append((produced, logits))
    return out


def test_a_saved_branch_loads_and_goes_on_as_the_original(smollm2, tmp_path):
    """A sampled fork saved mid-way and loaded into another store draws the very tokens
    the original goes on to draw, from bit-identical logits (its positions shared with
    the parent are in the file too); text, perplexity and settings come back."""
    store = BranchStore(smollm2, max_active=4)
    root = Branch.create(smollm2, {"temperature": 0.9, "top_p": 0.95, "seed": 5,
                                   "logit_bias": {11: -2.5}}, store=store, logprobs=3,
                         max_tokens=40)
    root.prefill(smollm2.tokenize("Once upon a time"))
    _run(root, 4)
    child = root.fork(seed=9)
    _run(child, 3)
    path = child.save(tmp_path / "story.wbbranch")
    again = Branch.load(path, smollm2)  # a store of its own
    assert again.store is not store and again.tokens == child.tokens
    assert again.text == child.text and again.perplexity == child.perplexity
    assert (again.max_tokens, again.logprobs) == (40, 3)
    assert again.sampler.params == child.sampler.params
    ahead, loaded = _run(child, 12), _run(again, 12)
    assert [p for p, _ in loaded] == [p for p, _ in ahead]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(ahead, loaded))
    assert again.perplexity == child.perplexity


def test_a_saved_grammar_branch_keeps_its_place_in_the_grammar(smollm2, tmp_path):
    # no other properties: the object closes after "n" whatever the draws (with them
    # allowed, a seed may write keys until the branch's token limit cuts the JSON)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    branch = Branch.create(smollm2, {"temperature": 0.7, "seed": 2}, schema=schema)
    branch.prefill(smollm2.tokenize("JSON: "))
    _run(branch, 3)
    again = Branch.load(branch.save(tmp_path / "json.wbbranch"), smollm2)
    rest = "".join(ev.text for ev in branch)
    assert "".join(ev.text for ev in again) == rest
    assert json.loads(again.text) == json.loads(branch.text)


def test_a_bad_branch_file_is_refused_and_frees_nothing(smollm2, tmp_path):
    from workbench.engine.runtime.prefix_cache import PrefixCache, PrefixCacheError

    store = BranchStore(smollm2, max_active=2)
    branch = Branch.create(smollm2, {"temperature": 0}, store=store)
    with pytest.raises(RuntimeError, match="prefill the branch before saving"):
        branch.save(tmp_path / "empty.wbbranch")
    branch.prefill(smollm2.tokenize(PROMPT))
    path = branch.save(tmp_path / "b.wbbranch")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte of the keys
    broken = tmp_path / "broken.wbbranch"
    broken.write_bytes(bytes(data))
    with pytest.raises(PrefixCacheError, match="checksum"):
        Branch.load(broken, smollm2, store=store)
    prefix = smollm2.prefix(PROMPT).save(tmp_path / "p.wbprefix")
    with pytest.raises(PrefixCacheError, match="not a saved branch"):
        Branch.load(prefix, smollm2, store=store)
    # states that are not what save writes, checksummed as real files: too deep, not flat
    snap = branch.cache.snapshot(smollm2.file_sha256)
    snap.state, snap.arrays = {"kind": "branch-1", "generated": [[[1]]]}, {}
    with pytest.raises(PrefixCacheError, match=r"header is damaged \(nested 5 deep\)"):
        Branch.load(snap.save(tmp_path / "deep.wbbranch"), smollm2, store=store)
    snap.state = {"kind": "branch-1", "generated": {"a": 1}}
    with pytest.raises(PrefixCacheError, match="branch state in its header is damaged"):
        Branch.load(snap.save(tmp_path / "nested.wbbranch"), smollm2, store=store)
    saved = PrefixCache.load(path, smollm2)
    snap.state = {**saved.state, "sampler.temperature": -1}
    snap.arrays = saved.arrays
    with pytest.raises(PrefixCacheError, match="state is damaged.*temperature"):
        Branch.load(snap.save(tmp_path / "bad.wbbranch"), smollm2, store=store)
    snap.state, snap.arrays = saved.state, {**saved.arrays, "grammar": np.zeros(2**25, "u1")}
    with pytest.raises(PrefixCacheError, match="arrays claim 33,7"):
        Branch.load(snap.save(tmp_path / "big.wbbranch"), smollm2, store=store)
    assert store.available == 1  # the refused loads took no slot
    assert smollm2.load_prefix(path).tokens == branch.tokens  # a branch file is a prefix too


@pytest.mark.slow
def test_store_prefill_runs_the_branches_together(smollm2):
    prompts = [smollm2.tokenize(t) for t in (LONG, PROMPT, MEDIUM)]
    assert len(prompts[0]) > PREFILL_CHUNK > len(prompts[2]) > len(prompts[1])
    together = BranchStore(smollm2, max_active=3, max_len=1024)
    batched = [Branch.create(smollm2, {"temperature": 0}, store=together) for _ in prompts]
    together.prefill(list(zip(batched, prompts)))
    assert together.forward_passes == 2  # round 1: all three; round 2: the long one's rest
    alone = BranchStore(smollm2, max_active=3, max_len=1024)
    singles = [Branch.create(smollm2, {"temperature": 0}, store=alone) for _ in prompts]
    for branch, prompt in zip(singles, prompts):
        branch.prefill(prompt)
    assert alone.forward_passes == 4
    diff = max(float(np.abs(a.logits - b.logits).max()) for a, b in zip(batched, singles))
    print(f"max |batched - one by one| over the logits: {diff:.2e}")
    for a, b, prompt in zip(batched, singles, prompts):
        assert a.tokens == b.tokens == prompt
        np.testing.assert_allclose(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(batched, singles):
        assert _greedy(a, 8) == _greedy(b, 8)


@pytest.mark.slow
def test_store_prefill_checks_before_it_runs(smollm2):
    store = BranchStore(smollm2, max_active=2, max_len=64)
    other = BranchStore(smollm2, max_active=1, max_len=64)
    a = Branch.create(smollm2, {"temperature": 0}, store=store)
    b = Branch.create(smollm2, {"temperature": 0}, store=store)
    stranger = Branch.create(smollm2, {"temperature": 0}, store=other)
    ids = smollm2.tokenize(PROMPT)
    with pytest.raises(ValueError, match="once"):
        store.prefill([(a, ids), (a, ids)])
    with pytest.raises(ValueError, match="belong"):
        store.prefill([(a, ids), (stranger, ids)])
    with pytest.raises(ValueError, match="token ids"):
        store.prefill([(a, ids), (b, [smollm2.config.n_vocab])])
    with pytest.raises(ValueError, match="positions"):  # ContextFullError
        store.prefill([(a, ids), (b, ids * 20)])
    assert a.cache.offset == b.cache.offset == store.forward_passes == 0
    store.prefill([(a, ids), (b, [])])  # an empty prompt leaves its branch as it is
    assert store.forward_passes == 1 and b.logits is None and a.logits is not None


def test_store_commit_checks_before_any_branch_changes(smollm2):
    """A token out of the vocabulary or refused by a branch's grammar raises and leaves
    every branch as it was (history, perplexity, grammar state): the branches go on to
    produce what they would have without the bad call."""
    from workbench.engine.decoding.grammar import GrammarError

    store = BranchStore(smollm2, max_active=2, max_len=64)
    free = Branch.create(smollm2, {"temperature": 0}, store=store)
    yes_no = Branch.create(smollm2, {"temperature": 0}, store=store,
                           grammar='root ::= " yes" | " no"')
    prompt = smollm2.tokenize("Is Paris in France? Answer:")
    store.prefill([(free, prompt), (yes_no, prompt)])
    banana = smollm2.tokenize(" banana", add_bos=False)[0]
    before = [(b.generated[:], b.perplexity, b.cache.offset) for b in (free, yes_no)]
    for bad in ([(free, -1)], [(free, smollm2.config.n_vocab)], [(free, 0), (yes_no, banana)]):
        with pytest.raises(ValueError, match="must lie in|not allowed"):  # GrammarError too
            store.commit(bad)
        assert [(b.generated, b.perplexity, b.cache.offset) for b in (free, yes_no)] == before
    with pytest.raises(GrammarError, match="not allowed"):
        yes_no.accept(banana)
    assert store.forward_passes == 1
    answer = "".join(e.text for e in yes_no)
    assert answer in (" yes", " no")
    assert _greedy(free, 4) == _fresh(smollm2, prompt, 4)


# -- hidden_batch against hidden, on tiny models (fast) -------------------------------------

@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    """A tiny random-weight model of the family (Gemma 3: 6 layers, 5 with a sliding
    window of 8 and a rotating cache), as `LLM`; the files are the goldens
    `tiny-llama-llama` and `tiny-llama-branch-gemma3` (tests/goldens/make_tiny_llama.py)."""
    from tests import goldens
    from tests.goldens.make_tiny_llama import BRANCH_GEMMA3
    from tests.support import tiny_llama
    from workbench import LLM

    if request.param == "llama":
        path = tiny_llama.Built("llama", tmp_path_factory.mktemp(request.param)).path
    else:
        path = goldens.load(BRANCH_GEMMA3).file("model.gguf")
    m = LLM.load(path, kv_cache_size=1024, prepare_kernels=False)
    yield m
    m.close()


def _caches(net, rng):
    """Four sequences of one pool: 300 positions (past a rotating cache's ring), empty,
    20 positions, and a fork of the third."""
    V = net.config.n_vocab
    caches = net.new_pool(4, 512).caches()
    net.hidden(rng.integers(0, V - 1, 300), caches[0])
    net.hidden(rng.integers(0, V - 1, 20), caches[2])
    caches[3] = caches[2].fork(3)
    assert not caches[0].pool.ring or caches[0].pool.ring < 300  # Gemma 3's ring wrapped
    return caches


def _assert_batch_equals_per_chunk(net, lengths, to_host=np.asarray) -> None:
    """hidden_batch over `_caches` against hidden per chunk on a copy, twice (the second
    runs on what the first wrote)."""
    V = net.config.n_vocab
    batched, alone = _caches(net, np.random.default_rng(1)), _caches(net, np.random.default_rng(1))
    rng = np.random.default_rng(2)
    for step in range(2):
        chunks = [rng.integers(0, V - 1, n) for n in lengths]
        together = net.hidden_batch(list(zip(chunks, batched)))
        for ids, h, cache in zip(chunks, together, alone):
            np.testing.assert_allclose(to_host(h), to_host(net.hidden(ids, cache)), rtol=1e-4,
                                       atol=1e-5, err_msg=f"step {step}")
        assert [c.tokens for c in batched] == [c.tokens for c in alone]


@pytest.mark.parametrize("lengths", [(17, 40, 1, 64), (5, 3, 9, 1)])
def test_hidden_batch_equals_hidden_per_chunk(tiny, lengths):
    _assert_batch_equals_per_chunk(tiny.model, lengths)


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
def test_device_twin_reads_all_chunks_in_one_pass(tiny, device):
    """The device twin's hidden_batch (one forward pass over every chunk's rows) against
    its hidden per chunk."""
    from tests.support.devices import open_llm

    with open_llm(tiny.path, device, kv_cache_size=1024) as m:
        _assert_batch_equals_per_chunk(m.model, (17, 40, 1, 64), m.backend.to_host)


def test_hidden_batch_checks_its_chunks(tiny):
    net = tiny.model
    a, b = net.new_pool(2, 16).caches()
    with pytest.raises(ValueError, match="its own"):
        net.hidden_batch([(np.array([1, 2]), a), (np.array([3]), a)])
    with pytest.raises(ValueError, match="positions"):
        net.hidden_batch([(np.array([1, 2]), a), (np.arange(17), b)])
    assert a.offset == b.offset == 0 and net.hidden_batch([]) == []
