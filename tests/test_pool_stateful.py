"""Model-based test: random operation sequences against the pure-Python pool model."""

from __future__ import annotations

import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from jax.experimental import checkify

from jaxkv import _pool as pool
from pool_model import PoolModel, assert_matches

BS, S, M = 4, 4, 4
ADMIT_B, FREE_B = 2, 2
# Three shared prompt bases make prefix hits frequent.
BASES = np.random.default_rng(0).integers(0, 50, size=(3, M * BS)).astype(np.int32)


@functools.cache
def _hash_fn():
  return jax.jit(lambda t: pool.hash_prompt_blocks(t, BS))


@functools.cache
def _jitted(spec):
  """Read-outs and plain transitions, jitted once per spec (the checked ones jit themselves)."""
  return (
      jax.jit(lambda s, ids, n: pool.slot_mapping(spec, s, ids, n, 16)[1]),
      jax.jit(lambda s: pool.advance_step(spec, s)),
      jax.jit(lambda s: pool.clear_pending(spec, s)),
  )


@functools.cache
def _check_fn(spec):
  return jax.jit(checkify.checkify(lambda s: pool.check_pool(spec, s)))


def _i32(xs, n):
  return jnp.asarray(list(xs) + [-1] * (n - len(xs)), jnp.int32)


class PoolMachine(RuleBasedStateMachine):
  spec = None

  def __init__(self):
    super().__init__()
    self.state = pool.init_pool(self.spec)
    self.model = PoolModel(self.spec)

  def _inactive(self):
    return [i for i in range(S) if i not in self.model.seqs]

  def _active(self):
    return sorted(self.model.seqs)

  @precondition(lambda self: self._inactive())
  @rule(data=st.data())
  def admit(self, data):
    sids = data.draw(st.lists(st.sampled_from(self._inactive()), min_size=1, max_size=ADMIT_B, unique=True))
    tokens = np.zeros((ADMIT_B, M * BS), np.int32)
    reqs, lens, loads = [], [], []
    for r, sid in enumerate(sids):
      base = data.draw(st.integers(0, 2))
      plen = data.draw(st.integers(0, M * BS))
      tokens[r] = BASES[base]
      if data.draw(st.booleans()):
        tokens[r, data.draw(st.integers(0, M * BS - 1)):] += 1  # diverge somewhere
      load = data.draw(st.integers(0, plen)) if data.draw(st.booleans()) else 0
      lens.append(plen)
      loads.append(load)
    digests = np.asarray(_hash_fn()(jnp.asarray(tokens)))
    for r, sid in enumerate(sids):
      reqs.append((sid, lens[r], [tuple(int(x) for x in d) for d in digests[r]], loads[r]))
    self.state, (ok, hit) = pool.admit(
        self.spec, self.state, _i32(sids, ADMIT_B), _i32(lens, ADMIT_B), jnp.asarray(digests), _i32(loads, ADMIT_B))
    want_ok, want_hit = self.model.admit(reqs + [(-1, 0, [], 0)] * (ADMIT_B - len(reqs)))
    assert np.asarray(ok).tolist() == want_ok
    assert np.asarray(hit).tolist() == want_hit

  @precondition(lambda self: self._active())
  @rule(data=st.data())
  def grow(self, data):
    sids = data.draw(st.lists(st.sampled_from(self._active()), min_size=1, max_size=S, unique=True))
    ns = [data.draw(st.integers(0, M * BS - self.model.seqs[s]["tokens"]).map(lambda k: min(k, 6))) for s in sids]
    self.state, ok = pool.grow(self.spec, self.state, _i32(sids, S), _i32(ns, S))
    reqs = list(zip(sids, ns)) + [(-1, 0)] * (S - len(sids))
    assert np.asarray(ok).tolist() == self.model.grow(reqs)
    slots = _jitted(self.spec)[0](self.state, _i32(sids, S), _i32(ns, S))
    assert np.asarray(slots).tolist() == self.model.slot_mapping(reqs, 16)

  @precondition(lambda self: self._active())
  @rule(data=st.data(), aborting=st.booleans())
  def free(self, data, aborting):
    sids = data.draw(st.lists(st.sampled_from(self._active()), min_size=1, max_size=FREE_B, unique=True))
    fn = pool.abort if aborting else pool.free
    self.state, ok = fn(self.spec, self.state, _i32(sids, FREE_B))
    assert np.asarray(ok).tolist() == self.model.free(sids + [-1] * (FREE_B - len(sids)))

  @precondition(lambda self: any(q["loading"] for q in self.model.seqs.values()))
  @rule(data=st.data())
  def complete_load(self, data):
    sid = data.draw(st.sampled_from([i for i, q in sorted(self.model.seqs.items()) if q["loading"]]))
    q = self.model.seqs[sid]
    size = q["load_end"] - q["load_start"]
    v = size if data.draw(st.booleans()) else data.draw(st.integers(0, size))
    self.state, ok = pool.complete_loads(self.spec, self.state, _i32([sid], 2), _i32([v], 2))
    assert np.asarray(ok).tolist() == self.model.complete_loads([(sid, v), (-1, 0)])

  @rule(data=st.data())
  def step(self, data):
    self.state, step = _jitted(self.spec)[1](self.state)
    assert int(step) == self.model.advance_step()
    if data.draw(st.booleans()):
      s = data.draw(st.integers(self.model.processed, self.model.step))
      self.state, k = pool.mark_processed(self.spec, self.state, jnp.int32(s))
      assert int(k) == self.model.mark_processed(s)

  @rule()
  def clear_pending(self):
    self.state = _jitted(self.spec)[2](self.state)
    self.model.clear_pending()

  @invariant()
  def matches_model_and_invariants(self):
    assert_matches(self.model, self.state)
    pool.assert_pool_valid(self.spec, self.state)
    err, _ = _check_fn(self.spec)(self.state)
    assert err.get() is None


def _machine(**kw):
  spec = pool.PoolSpec(num_blocks=14, block_size=BS, max_seqs=S, max_blocks_per_seq=M,
                       enable_prefix_caching=True, max_zero_list=8, max_tails=2, **kw)
  return type("Machine", (PoolMachine,), {"spec": spec})


_SETTINGS = hypothesis.settings(max_examples=200, stateful_step_count=10, deadline=None)

TestPoolDeferred = _machine(defer_block_free=True, zero_new_blocks=True).TestCase
TestPoolDeferred.settings = _SETTINGS
TestPoolImmediate = _machine(defer_block_free=False, zero_new_blocks=True).TestCase
TestPoolImmediate.settings = _SETTINGS
