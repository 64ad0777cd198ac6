"""Branches: continuations of one text that fork at any token and share what came before.

    >>> store = BranchStore(m, max_active=8)
    >>> root = Branch.create(m, {"temperature": 0}, store=store)
    >>> root.prefill(m.tokenize("The capital of France is"))
    >>> child = root.fork()                  # shares root's keys and values: nothing copied
    >>> other = root.fork(seed=7)            # and draws from its own random state
    >>> token, is_stop, text = child.produce()  # sample (does not change the branch)
    >>> child.commit(token)                  # accept it and run it through the model
    >>> store.commit([(root, a), (child, b)])  # several branches, one forward pass
    >>> store.prefill([(child, ids), (other, ids2)])  # prompts too, one pass per chunk
    >>> for ev in child: ...                 # or let it run: one TokenEvent per token
    >>> child.save("story.wbbranch")         # later, or in another kernel:
    >>> again = Branch.load("story.wbbranch", m)  # the same branch, no prefill

Every branch has a slot of its store's KV pool, its own sampler (random state
included: a fork copies it, or `fork(seed=...)` / `reseed` gives it a fresh one),
grammar matcher, logits snapshot and perplexity. A fork reads its parent's positions
from the parent's slot (the pool's pages for them are never written twice), so a fork
of a long prefix costs only the positions it adds. A branch with live children cannot
be pruned on its own (they read its slot): prune them first, or `prune_subtree()`;
`store.retain_only(winner)` copies what the winner shares into its own slot and frees
every other branch. `save` writes a branch to a file (a prefix cache of its positions
that also holds its sampler with its random state, grammar position, logits and
perplexity; checksummed and bound to the model file), and `Branch.load` brings it back
in another store or session: it goes on exactly as the saved branch would have.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from workbench.engine.decoding.grammar import Grammar, GrammarError, resolve_grammar
from workbench.engine.decoding.sampling import Sampler, SamplingParams, entropy, log_softmax
from workbench.engine.explore.metrics import Perplexity
from workbench.engine.llm import LLM, PREFILL_CHUNK
from workbench.engine.models.llama import check_ids
from workbench.engine.results import Alternative, TokenEvent
from workbench.engine.runtime.kv_cache import KVCache
from workbench.engine.runtime.prefix_cache import PrefixCache, PrefixCacheError
from workbench.engine.text.tokenizers.stream import StreamDecoder


class Produced(NamedTuple):
    """A token `Branch.produce` sampled: its id, whether it ends the branch (an end token,
    or a finished grammar) and its text (a piece of a UTF-8 character shows as U+FFFD)."""

    token: int
    is_stop: bool
    text: str


class BranchStore:
    """The KV pool and slot leases of a family of branches; runs them together.

    max_active: how many branches may live at once (pool slots); max_len: positions
    per branch (default: the model's `kv_cache_size`).
    """

    def __init__(self, model: LLM, max_active: int = 8, max_len: int | None = None):
        if max_active < 1:
            raise ValueError("max_active must be >= 1")
        self.model = model
        self.pool = model._require_model().new_pool(max_active, max_len)
        self._free = list(range(max_active - 1, -1, -1))
        self.branches: list[Branch] = []
        self.forward_passes = 0  # every forward pass run for this store's branches

    @property
    def available(self) -> int:
        """Free slots: how many more branches can be created or forked."""
        return len(self._free)

    def _lease(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.pool.n_slots} branch slots are in use: prune "
                               "branches or make the store with a larger max_active")
        return self._free.pop()

    def commit(self, pairs: Sequence[tuple[Branch, int]]) -> None:
        """Accept one token on each branch and run them all in one forward pass."""
        pairs = list(pairs)
        if not pairs:
            return
        if len({id(b) for b, _ in pairs}) != len(pairs):
            raise ValueError("each branch may commit one token per call")
        for branch, token in pairs:  # check everything before any branch changes
            branch._check_alive()
            if branch.store is not self:
                raise ValueError("every branch must belong to this store")
            branch.cache.check_room(1)
            branch._check_token(token)
        for branch, token in pairs:
            branch._record(int(token))
        net = self.model._require_model()
        with self.model._busy, self.model._forward_lock:
            hidden = net.decode(np.asarray([t for _, t in pairs]), [b.cache for b, _ in pairs])
            logits = net.logits(hidden)  # (N, n_vocab)
        self.forward_passes += 1
        for (branch, _), row in zip(pairs, logits):
            branch.logits = row

    def prefill(self, pairs: Sequence[tuple[Branch, Sequence[int]]]) -> None:
        """Run tokens (a prompt: context, no perplexity, no grammar) into each branch at
        its next positions, all the branches together.

        The prompts go in chunks of `PREFILL_CHUNK` tokens, round by round: round r runs
        chunk r of every branch that has one in one forward pass (the model's
        `hidden_batch`), so N prompts of up to PREFILL_CHUNK tokens cost one pass, not N.
        Each branch's logits are then those after its last token. The branches must be
        distinct; everything is checked before any branch changes."""
        jobs = [(branch, check_ids([int(t) for t in tokens], self.model.config.n_vocab))
                for branch, tokens in pairs]
        if len({id(b) for b, _ in jobs}) != len(jobs):
            raise ValueError("each branch may appear once in a prefill")
        for branch, ids in jobs:
            branch._check_alive()
            if branch.store is not self:
                raise ValueError("every branch must belong to this store")
            branch.cache.check_room(ids.size)
        jobs = [(b, ids) for b, ids in jobs if ids.size]
        n_rounds = max((-(-ids.size // PREFILL_CHUNK) for _, ids in jobs), default=0)
        net = self.model._require_model()
        with self.model._busy:
            for r in range(n_rounds):
                start, end = r * PREFILL_CHUNK, (r + 1) * PREFILL_CHUNK
                batch = [(b, ids) for b, ids in jobs if ids.size > start]
                with self.model._forward_lock:
                    hidden = net.hidden_batch([(ids[start:end], b.cache) for b, ids in batch])
                    for (branch, ids), h in zip(batch, hidden):  # h: (T_i, n_embd)
                        if ids.size <= end:  # its last chunk: the logits after it
                            branch.logits = net.logits(h[-1:])[0]
                self.forward_passes += 1

    def retain_only(self, winner: Branch) -> None:
        """Keep `winner` alone: it gets a copy of what it shared, every other branch is
        pruned and its slot freed."""
        winner._check_alive()
        winner.cache.materialize()
        if winner.parent is not None:
            winner.parent.children.remove(winner)
            winner.parent = None
        for branch in list(self.branches):
            if branch is not winner and branch.parent is None:
                branch.prune_subtree()
        for child in list(winner.children):
            child.prune_subtree()


class Branch:
    """One continuation: its KV cache rows, sampler, grammar state, logits and perplexity."""

    def __init__(self, store: BranchStore, cache: KVCache, sampler: Sampler,
                 matcher: Any = None, *, max_tokens: int | None = None,
                 logprobs: int | None = None, logits_processors: Sequence[Any] = ()):
        self.store = store
        self.model = store.model
        self.cache = cache
        self.sampler = sampler
        self.matcher = matcher
        self.max_tokens = max_tokens  # for iteration; None: until a stop token or full
        self.logprobs = logprobs
        self.logits_processors = list(logits_processors)
        if any(not callable(fn) for fn in self.logits_processors):
            raise TypeError("logits_processors must be functions fn(ids, logits) -> logits")
        self.logits: np.ndarray | None = None  # (n_vocab,) after the last token
        self.perplexity_tracker = Perplexity()
        self.generated: list[int] = []  # tokens accepted since creation (or the fork)
        self.constrained: list[int] = []  # every token its grammar consumed (forks: theirs)
        self.parent: Branch | None = None
        self.children: list[Branch] = []
        self.alive = True
        store.branches.append(self)

    @classmethod
    def create(cls, model: LLM, params: SamplingParams | Mapping[str, Any] | None = None, *,
               store: BranchStore | None = None, grammar: Grammar | str | None = None,
               schema: Any = None, max_tokens: int | None = None,
               logprobs: int | None = None,
               logits_processors: Sequence[Any] = ()) -> Branch:
        """A new, empty branch of `model` (in `store`, or a store of its own).

        params: `SamplingParams` or a dict of its fields (temperature, top_k, top_p,
        min_p, repeat_penalty, seed ...). grammar / schema constrain it as in
        `LLM.generate`. max_tokens bounds iteration; logprobs=k puts k alternatives
        in the events; logits_processors (`fn(ids, logits) -> logits`) change the
        logits before each sample, as in `LLM.generate`.
        """
        store = store or BranchStore(model)
        if params is None:
            params = SamplingParams()
        elif isinstance(params, Mapping):
            params = SamplingParams(**params)
        constraint = resolve_grammar(grammar, schema)
        n_vocab = model.config.n_vocab
        matcher = constraint.matcher(model.tokenizer, n_vocab) if constraint else None
        cache = store.pool.cache(store._lease())
        return cls(store, cache, Sampler(params, n_vocab), matcher, max_tokens=max_tokens,
                   logprobs=logprobs, logits_processors=logits_processors)

    # -- snapshots ----------------------------------------------------------------------------
    SNAPSHOT_KIND = "branch-1"  # the state's layout, in the file's header

    def save(self, path: str | os.PathLike) -> Path:
        """Write this branch to `path` (atomically): the keys and values of all its
        positions (those it shares with ancestors too), its sampler (options and random
        state), grammar and where it stands in it, logits, perplexity and tokens, as a
        checksummed prefix-cache file bound to this model file. `Branch.load` brings it
        back. Logits processors are functions and are not saved: pass them again."""
        self._check_alive()
        if self.logits is None:
            raise RuntimeError("prefill the branch before saving it (it has no positions)")
        model = self.model
        snap = self.cache.snapshot(model.file_sha256)
        params = dataclasses.asdict(self.sampler.params)
        bias = params.pop("logit_bias")
        rng = self.sampler.rng.bit_generator.state
        if rng.get("bit_generator") != "PCG64":
            raise ValueError(f"cannot save a sampler drawing from {rng.get('bit_generator')}")
        grammar = self.matcher.grammar if self.matcher is not None else None
        state = {
            "kind": self.SNAPSHOT_KIND,
            **{f"sampler.{k}": v for k, v in params.items()},
            # the PCG64 state's 128-bit numbers, as decimal text
            "rng.state": str(rng["state"]["state"]), "rng.inc": str(rng["state"]["inc"]),
            "rng.has_uint32": int(rng["has_uint32"]), "rng.uinteger": int(rng["uinteger"]),
            "grammar.kind": grammar.kind if grammar is not None else None,
            "perplexity.total": self.perplexity_tracker.total,
            "perplexity.count": self.perplexity_tracker.count,
            "max_tokens": self.max_tokens, "logprobs": self.logprobs,
        }
        text = grammar.source.encode() if grammar is not None else b""
        snap.state, snap.arrays = state, {
            "logits": np.asarray(self.logits, dtype=np.float32),
            "generated": np.asarray(self.generated, dtype=np.int32),
            "constrained": np.asarray(self.constrained, dtype=np.int32),
            "grammar": np.frombuffer(text, dtype=np.uint8),
            "logit_bias.ids": np.asarray(list(bias), dtype=np.int32),
            "logit_bias.values": np.asarray(list(bias.values()), dtype=np.float64),
        }
        return snap.save(path)

    @classmethod
    def load(cls, path: str | os.PathLike, model: LLM, *, store: BranchStore | None = None,
             logits_processors: Sequence[Any] = ()) -> Branch:
        """A branch saved with `save`, in `store` (or a store of its own): its positions
        are copied into a free slot (no forward pass) and its sampler, grammar position,
        logits and perplexity are as they were, so it goes on as the saved branch would.
        The file must have been made with this very model file; a damaged, foreign or
        hostile file raises `PrefixCacheError` and changes nothing."""
        snap = PrefixCache.load(path, model)
        state, arrays = snap.state, snap.arrays
        if state is None or state.get("kind") != cls.SNAPSHOT_KIND:
            raise PrefixCacheError(f"{path} is a prefix cache, not a saved branch "
                                   "(load it with LLM.load_prefix)")
        try:
            sampler, matcher, perplexity = cls._restore_state(state, arrays, model)
            generated = [int(t) for t in arrays["generated"]]
            logits = arrays["logits"]
            if logits.shape != (model.config.n_vocab,):
                raise ValueError(f"logits of shape {logits.shape}")
            max_tokens, logprobs = state["max_tokens"], state["logprobs"]
            for name, value in (("max_tokens", max_tokens), ("logprobs", logprobs)):
                if value is not None and not (isinstance(value, int) and value >= 0):
                    raise ValueError(f"{name} {value!r}")
        except (KeyError, TypeError, ValueError, GrammarError) as exc:
            raise PrefixCacheError(f"{path}: the saved branch's state is damaged ({exc})"
                                   ) from None
        if not snap.tokens:
            raise PrefixCacheError(f"{path}: the saved branch has no positions")
        store = store or BranchStore(model)
        cache = store.pool.cache(store._lease())
        try:
            cache.restore(snap, len(snap.tokens))
            if cache.offset != len(snap.tokens):
                raise PrefixCacheError(f"{path}: the saved branch lacks the sliding window "
                                       "it needs")
        except BaseException:
            store._free.append(cache.slot)
            raise
        branch = cls(store, cache, sampler, matcher, max_tokens=max_tokens,
                     logprobs=logprobs, logits_processors=logits_processors)
        branch.logits = np.asarray(logits, dtype=np.float32)
        branch.perplexity_tracker = perplexity
        branch.generated = generated
        branch.constrained = [int(t) for t in arrays["constrained"]]
        return branch

    @staticmethod
    def _restore_state(state: dict, arrays: dict, model: LLM
                       ) -> tuple[Sampler, Any, Perplexity]:
        """The sampler, grammar matcher and perplexity of a saved branch's `state` and
        `arrays` (ValueError, TypeError or KeyError where they are not what `save`
        writes)."""
        names = [f.name for f in dataclasses.fields(SamplingParams) if f.name != "logit_bias"]
        ids, values = arrays["logit_bias.ids"], arrays["logit_bias.values"]
        if len(ids) != len(values):
            raise ValueError("logit bias ids and values differ in number")
        params = SamplingParams(**{n: state[f"sampler.{n}"] for n in names},
                                logit_bias={int(i): float(v) for i, v in zip(ids, values)})
        sampler = Sampler(params, model.config.n_vocab)
        sampler.rng.bit_generator.state = {
            "bit_generator": "PCG64", "has_uint32": int(state["rng.has_uint32"]),
            "uinteger": int(state["rng.uinteger"]),
            "state": {"state": int(state["rng.state"]), "inc": int(state["rng.inc"])}}
        matcher = None
        if state["grammar.kind"] is not None:
            source = arrays["grammar"].tobytes().decode()
            make = {"gbnf": Grammar.from_gbnf, "json_schema": Grammar.from_json_schema,
                    "regex": Grammar.from_regex}[state["grammar.kind"]]
            matcher = make(source).matcher(model.tokenizer, model.config.n_vocab)
            for token in arrays["constrained"]:
                if not matcher.allows(int(token)):
                    raise ValueError("its grammar does not take its tokens")
                matcher.consume(int(token))
        perplexity = Perplexity()
        total, count = state["perplexity.total"], state["perplexity.count"]
        if not (isinstance(count, int) and count >= 0 and float(total) >= 0):
            raise ValueError("perplexity")
        perplexity.total, perplexity.count = float(total), count
        return sampler, matcher, perplexity

    # -- tree ---------------------------------------------------------------------------------
    def fork(self, seed: int | None = None) -> Branch:
        """A child that continues from here: it shares this branch's cached positions
        (not copied), and copies its sampler, grammar state, logits and perplexity.

        The sampler's random state is copied too (the child draws what this branch
        would), unless `seed` is given: then the child is `reseed`ed from it, so that
        forks of one branch draw different continuations."""
        self._check_alive()
        store = self.store
        child = Branch(store, self.cache.fork(store._lease()), copy.deepcopy(self.sampler),
                       self.matcher.clone() if self.matcher is not None else None,
                       max_tokens=self.max_tokens, logprobs=self.logprobs,
                       logits_processors=self.logits_processors)
        child.logits = None if self.logits is None else self.logits.copy()
        child.perplexity_tracker = self.perplexity_tracker.clone()
        child.constrained = list(self.constrained)
        child.parent = self
        self.children.append(child)
        if seed is not None:
            child.reseed(seed)
        return child

    def reseed(self, seed: int) -> None:
        """Give this branch's sampler a fresh random state from `seed` (as if it had been
        created with that seed); nothing else changes."""
        self._check_alive()
        self.sampler.reseed(seed)

    @property
    def is_leaf(self) -> bool:
        """True when no live branch forked from this one (pruned children are gone from
        `children`): nothing reads its cache, so it can be pruned on its own."""
        return not self.children

    @property
    def is_active(self) -> bool:
        """True until the branch is pruned (a pruned branch's slot is free: producing,
        committing, prefilling or forking it raises RuntimeError)."""
        return self.alive

    def prune(self) -> None:
        """Remove this branch and free its slot (it must have no live children)."""
        if not self.alive:
            return
        if self.children:
            raise RuntimeError(f"this branch has {len(self.children)} live children that "
                               "read its cache: prune them first, or use prune_subtree()")
        self.alive = False
        self.store._free.append(self.cache.slot)
        self.store.branches.remove(self)
        if self.parent is not None:
            self.parent.children.remove(self)

    def prune_subtree(self) -> None:
        """Remove this branch and all its descendants."""
        for child in list(self.children):
            child.prune_subtree()
        self.prune()

    # -- tokens -------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int]) -> None:
        """Run `tokens` (a prompt) through the model at this branch's next positions;
        they are context: no perplexity, no grammar."""
        self._check_alive()
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        with self.model._busy:
            self.logits = self.model._prefill(tokens, self.cache)
        self.store.forward_passes += -(-len(tokens) // PREFILL_CHUNK)  # one per chunk

    def produce(self) -> Produced:
        """Sample the next token from the current logits: `Produced(token, is_stop,
        text)` (lloyal's `{token, isStop}`, with the token's text). Only the sampler's
        random state changes; `accept` or `commit` the token to keep it."""
        self._check_alive()
        if self.logits is None:
            raise RuntimeError("prefill the branch before producing tokens")
        allowed = None
        if self.matcher is not None:
            allowed = self.matcher.mask()
            ends = np.fromiter(self.model.tokenizer.eot_ids, dtype=np.int64)
            allowed[ends] = self.matcher.is_accepting
        logits = self.logits
        for fn in self.logits_processors:
            out = np.asarray(fn(np.asarray(self.cache.tokens, dtype=np.intc), logits.copy()),
                             dtype=np.float32)
            if out.shape != logits.shape:
                raise ValueError(f"a logits processor returned shape {out.shape}")
            logits = out
        token = self.sampler.sample(logits, self.cache.tokens, allowed)
        return Produced(token, self.is_stop(token), self.model.tokenizer.decode([token]))

    def is_stop(self, token: int) -> bool:
        return self.model.is_stop_token(token) or (
            self.matcher is not None and self.matcher.is_finished)

    def _check_token(self, token: int) -> None:
        """Raise (ValueError, or `GrammarError` from the grammar) unless `token` may come
        next on this branch."""
        check_ids([token], self.model.config.n_vocab)
        if self.matcher is not None and not self.matcher.allows(token):
            raise GrammarError(f"token {int(token)} is not allowed here by this branch's "
                               "grammar")

    def accept(self, token: int) -> None:
        """Record `token` as this branch's next (perplexity, grammar), without running it.
        A token out of the vocabulary or refused by the grammar raises and changes
        nothing."""
        self._check_alive()
        self._check_token(token)
        self._record(int(token))

    def _record(self, token: int) -> None:
        """`accept` once `token` is checked."""
        if self.logits is not None:
            self.perplexity_tracker.add(float(log_softmax(self.logits)[token]))
        if self.matcher is not None:
            self.matcher.consume(token)
            self.constrained.append(token)
        self.generated.append(token)

    def commit(self, token: int) -> None:
        """`accept(token)` and run it through the model (one forward pass)."""
        self.store.commit([(self, token)])

    def kv_remove(self, start: int, end: int, *, recompute: bool = True) -> None:
        """Forget positions start .. end - 1 of this branch (see `LLM.kv_remove`); the
        branch must have no live children (they read its positions)."""
        self._check_alive()
        if self.children:
            raise RuntimeError("this branch has live children that read its cache")
        net = self.model._require_model()
        start, end = int(start), int(end)
        with self.model._busy:
            if recompute and end < self.cache.offset:
                self.prefill(self.cache.cut(start, end))
                return
            net.kv_remove(self.cache, start, end)
            if self.cache.offset:  # the next token's logits, from the moved cache
                last = self.cache.tokens[-1]
                self.cache.trim(self.cache.offset - 1)
                self.prefill([last])
            else:
                self.logits = None

    @property
    def perplexity(self) -> float:
        """Perplexity of the tokens accepted so far."""
        return self.perplexity_tracker.get()

    @property
    def tokens(self) -> list[int]:
        """Every token in this branch's cache (prompt, ancestors' and its own)."""
        return list(self.cache.tokens)

    @property
    def text(self) -> str:
        """The text of the tokens accepted since the branch began (or forked)."""
        return self.model.detokenize(self.generated)

    def __iter__(self) -> Iterator[TokenEvent]:
        """Produce and commit tokens until a stop token, `max_tokens` or a full cache;
        one `TokenEvent` per token (text as it completes UTF-8)."""
        decoder = StreamDecoder(self.model.tokenizer)
        n = 0
        while self.max_tokens is None or n < self.max_tokens:
            if self.cache.offset >= self.cache.max_len:
                break
            logits = self.logits
            token, stop, _ = self.produce()
            if stop and self.model.is_stop_token(token):
                break
            event = self._event(token, logits, decoder)
            self.commit(token)
            n += 1
            yield event
            if stop:
                break
        tail = decoder.flush()
        if tail:
            yield TokenEvent(None, tail, "")

    def _event(self, token: int, logits: np.ndarray, decoder: StreamDecoder) -> TokenEvent:
        tok = self.model.tokenizer
        lp = top = ent = None
        if self.logprobs is not None:
            logp = log_softmax(logits)
            lp, ent = float(logp[token]), entropy(logp)
            k = min(int(self.logprobs), logp.size)
            best = np.argsort(-logp, kind="stable")[:k]
            top = tuple(Alternative(int(i), tok.decode([int(i)]), float(logp[i])) for i in best)
        return TokenEvent(token, decoder.push(token), tok.decode([token]), lp, top, ent)

    def _check_alive(self) -> None:
        if not self.alive:
            raise RuntimeError("this branch has been pruned")

    def __repr__(self) -> str:
        state = "live" if self.alive else "pruned"
        return (f"<Branch {state}, slot {self.cache.slot}, {self.cache.offset} positions, "
                f"{len(self.generated)} generated, perplexity {self.perplexity:.2f}>")
