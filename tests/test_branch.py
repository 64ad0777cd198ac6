"""Branches on the real SmolLM2: forks continue exactly like fresh runs on the same token
history, share their prefix without copying it, and run together in one forward pass."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workbench.engine.branch import Branch, BranchStore

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def _greedy(branch: Branch, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token, stop = branch.produce()
        if stop:
            break
        branch.commit(token)
        out.append(token)
    return out


def _fresh(m, history: list[int], n: int) -> list[int]:
    m.reset()
    return m.generate(history, temperature=0, max_tokens=n).token_ids


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


def test_sampler_state_forks_too(smollm2):
    root = Branch.create(smollm2, {"temperature": 1.0, "seed": 3, "top_k": 0, "top_p": 1.0,
                                   "min_p": 0.0})
    root.prefill(smollm2.tokenize(PROMPT))
    twin = root.fork()
    draws = [(root.produce()[0], twin.produce()[0]) for _ in range(20)]
    assert all(a == b for a, b in draws)  # same random state, same logits, same tokens
    assert len({a for a, _ in draws}) > 1  # and they really are random draws


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
    token, _ = banned.produce()
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
