"""Scenario tests: exact block ids and free-queue order after each step."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jaxkv import _pool as pool

BS = 4


def _i32(*xs):
  return jnp.asarray(xs, jnp.int32)


def _queue(state):
  return np.asarray(state.ordered_free_queue())[: int(state.num_free)].tolist()


def _spec(**kw):
  base = dict(num_blocks=10, block_size=BS, max_seqs=4, max_blocks_per_seq=4)
  base.update(kw)
  return pool.PoolSpec(**base)


def _admit(spec, state, sids, lens, tokens=None, loads=None):
  b = len(sids)
  if tokens is None:
    tokens = np.random.default_rng(sum(sids)).integers(0, 1000, (b, spec.max_tokens_per_seq))
  digests = pool.hash_prompt_blocks(jnp.asarray(tokens, jnp.int32), spec.block_size)
  loads = loads or [0] * b
  return pool.admit(spec, state, _i32(*sids), _i32(*lens), digests, _i32(*loads))


def test_allocation_order_and_lifo_reuse():
  spec = _spec()
  st = pool.init_pool(spec)
  assert _queue(st) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
  st, (ok, _) = _admit(spec, st, [0, 1], [9, 5])
  assert ok.tolist() == [True, True]
  assert np.asarray(st.block_table)[:2].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]]
  assert _queue(st) == [6, 7, 8, 9]
  assert np.asarray(st.zero_list)[: int(st.num_zero)].tolist() == [1, 2, 3, 4, 5]
  st = pool.clear_pending(spec, st)
  st, ok = pool.grow(spec, st, _i32(1, 0), _i32(4, 3))  # 5 -> 9 tokens, 9 -> 12 tokens
  assert ok.tolist() == [True, True]
  assert np.asarray(st.block_table)[:2].tolist() == [[1, 2, 3, 0], [4, 5, 6, 0]]
  assert np.asarray(st.zero_list)[: int(st.num_zero)].tolist() == [6]
  # Reverse order, unhashed blocks to the front: the last freed is reused first.
  st, ok = pool.free(spec, st, _i32(0, -1))
  assert ok.tolist() == [True, False]
  assert _queue(st) == [1, 2, 3, 7, 8, 9]
  st, ok = pool.free(spec, st, _i32(1, -1))
  assert _queue(st) == [4, 5, 6, 1, 2, 3, 7, 8, 9]
  pool.assert_pool_valid(spec, st)


def test_out_of_blocks_is_a_flag_and_changes_nothing():
  spec = _spec(num_blocks=4)
  st = pool.init_pool(spec)
  st, (ok, _) = _admit(spec, st, [0, 1, 2], [8, 12, 4])  # needs 2, then 3 (no room), then 1
  assert ok.tolist() == [True, False, False]  # admission stops at the first that does not fit
  assert not bool(st.active[1]) and not bool(st.active[2])
  assert _queue(st) == [3]
  st, ok = pool.grow(spec, st, _i32(0, -1), _i32(8, 0))  # needs 2 > 1 free
  assert ok.tolist() == [False, False]
  assert int(st.num_tokens[0]) == 8 and _queue(st) == [3]
  pool.assert_pool_valid(spec, st)


def test_prefix_hits_lru_and_eviction():
  spec = _spec(num_blocks=8, enable_prefix_caching=True)
  st = pool.init_pool(spec)
  tok = np.arange(16)[None, :]
  st, (ok, hit) = _admit(spec, st, [0], [13], tok)  # blocks 1,2,3 full (hashed), 4 partial
  assert hit.tolist() == [0]
  assert np.flatnonzero(np.asarray(st.hashed)).tolist() == [1, 2, 3]
  st, (ok, hit) = _admit(spec, st, [1], [10], tok)  # shares 1,2; new block 5
  assert hit.tolist() == [8] and np.asarray(st.block_table)[1].tolist() == [1, 2, 5, 0]
  assert np.asarray(st.ref_count)[:6].tolist() == [0, 2, 2, 1, 1, 1]
  assert np.asarray(st.zero_list)[: int(st.num_zero)].tolist() == [1, 2, 3, 4, 5]  # hits not zeroed
  st, _ = pool.free(spec, st, _i32(0))
  # 4 (unhashed) to the front; 3 (hashed) to the back; 2 and 1 still shared.
  assert _queue(st) == [4, 6, 7, 3]
  st, _ = pool.free(spec, st, _i32(1))
  assert _queue(st) == [5, 4, 6, 7, 3, 2, 1]
  # A new prompt with the same first two blocks takes 1 and 2 back out of the queue.
  st, (ok, hit) = _admit(spec, st, [2], [9], tok)
  assert hit.tolist() == [8] and np.asarray(st.block_table)[2].tolist() == [1, 2, 5, 0]
  assert _queue(st) == [4, 6, 7, 3]
  # Popping the cached idle block 3 evicts it: its hash is dropped.
  st, ok = pool.grow(spec, st, _i32(2), _i32(7))  # 9 -> 16 tokens: 1 block (4)
  st = pool.clear_pending(spec, st)
  st, (ok, _) = _admit(spec, st, [3], [12], np.arange(16)[None, :] + 100)  # 3 blocks: 6, 7, 3
  assert ok.tolist() == [True]
  assert np.asarray(st.block_table)[3].tolist() == [6, 7, 3, 0]
  assert int(st.num_free) == 0
  assert bool(st.hashed[3])  # 3 was evicted, then registered again under its new prompt
  st2, (ok, hit) = _admit(spec, pool.free(spec, st, _i32(3))[0], [3], [13], tok)
  assert hit.tolist() == [8]  # block 3's old digest is gone: only 1 and 2 hit
  pool.assert_pool_valid(spec, st2)


def test_fence_parks_until_processed_and_abort_cannot_bypass():
  spec = _spec(defer_block_free=True)
  st = pool.init_pool(spec)
  st, _ = _admit(spec, st, [0, 1], [8, 4])
  st, step = pool.advance_step(spec, st)
  assert int(step) == 1
  st, _ = pool.abort(spec, st, _i32(0))
  assert _queue(st) == [4, 5, 6, 7, 8, 9]  # blocks 1, 2 parked, not free
  assert np.asarray(st.ordered_parked()[0])[: int(st.num_parked)].tolist() == [2, 1]
  st, (ok, _) = _admit(spec, st, [2], [16])  # takes 4 blocks, never the parked ones
  assert ok.tolist() == [True] and np.asarray(st.block_table)[2].tolist() == [4, 5, 6, 7]
  st, step = pool.advance_step(spec, st)
  st, _ = pool.free(spec, st, _i32(1))
  st, k = pool.mark_processed(spec, st, jnp.int32(1))
  assert int(k) == 2 and _queue(st) == [1, 2, 8, 9]  # same order an immediate free gives
  st, k = pool.mark_processed(spec, st, jnp.int32(2))
  assert int(k) == 1 and _queue(st) == [3, 1, 2, 8, 9]
  pool.assert_pool_valid(spec, st)


def test_async_load_tail_and_failure():
  spec = _spec(num_blocks=16)
  st = pool.init_pool(spec)
  st, _ = _admit(spec, st, [0, 1, 2], [14, 8, 12], loads=[10, 8, 12])
  # Loaded blocks are exempt: seq 0 loads tokens [0, 10) -> blocks 1,2,3 exempt, 4 zeroed.
  assert np.asarray(st.block_table)[:3].tolist() == [[1, 2, 3, 4], [5, 6, 0, 0], [7, 8, 9, 0]]
  assert np.asarray(st.zero_list)[: int(st.num_zero)].tolist() == [4]
  st = pool.clear_pending(spec, st)
  st, ok = pool.complete_loads(spec, st, _i32(0, 1, 2), _i32(10, 8, 5))
  assert ok.tolist() == [True, True, True]
  # seq 0: tail of block 3 past 2 valid slots; seq 1: aligned, nothing; seq 2 failed at token 5.
  assert list(zip(np.asarray(st.tail_ids).tolist(), np.asarray(st.tail_valid).tolist()))[:1] == [(3, 2)]
  assert int(st.num_tails) == 1
  assert np.asarray(st.zero_list)[: int(st.num_zero)].tolist() == [8, 9]
  with pytest.raises(ValueError, match="no pending load"):  # queued exactly once
    pool.complete_loads(spec, st, _i32(0), _i32(10))
  pool.assert_pool_valid(spec, st)


def test_slot_mapping():
  spec = _spec()
  st = pool.init_pool(spec)
  st, _ = _admit(spec, st, [0, 1], [6, 3])
  _, slots = pool.slot_mapping(spec, st, _i32(1, -1, 0), _i32(3, 5, 2), 8)
  assert slots.tolist() == [3 * BS + 0, 3 * BS + 1, 3 * BS + 2, 2 * BS + 0, 2 * BS + 1, -1, -1, -1]


@pytest.mark.parametrize("case", ["free_inactive", "double_free", "grow_inactive", "grow_past_table",
                                  "negative", "admit_active", "future_step"])
def test_misuse_raises_and_debug_checkify_keeps_state(case):
  spec = _spec(defer_block_free=True)
  st, _ = _admit(spec, pool.init_pool(spec), [0], [5])
  calls = {
      "free_inactive": lambda s: pool.free(spec, s, _i32(2), debug=dbg),
      "double_free": lambda s: pool.free(spec, s, _i32(0, 0), debug=dbg),
      "grow_inactive": lambda s: pool.grow(spec, s, _i32(3), _i32(1), debug=dbg),
      "grow_past_table": lambda s: pool.grow(spec, s, _i32(0), _i32(12), debug=dbg),
      "negative": lambda s: pool.grow(spec, s, _i32(0), _i32(-1), debug=dbg),
      "admit_active": lambda s: _admit(spec, s, [0], [4]),
      "future_step": lambda s: pool.mark_processed(spec, s, jnp.int32(1), debug=dbg),
  }
  dbg = False
  leaves = [np.asarray(x).copy() for x in jax.tree.leaves(st)]
  with pytest.raises(ValueError):
    calls[case](st)
  if case == "admit_active":
    return
  dbg = True
  err, (new, _) = jax.jit(checkify.checkify(calls[case]))(st)
  assert err.get() is not None
  for before, after in zip(leaves, jax.tree.leaves(new)):
    np.testing.assert_array_equal(before, np.asarray(after))


def test_decode_loop_compiles_each_transition_once():
  spec = _spec(num_blocks=64, max_seqs=8, max_blocks_per_seq=32, enable_prefix_caching=True,
               defer_block_free=True)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, finish, arrive, lens, tokens):
    state, _ = pool.advance_step(spec, state)
    state, _ = pool.free(spec, state, finish)
    state, _ = pool.admit(spec, state, arrive, lens, pool.hash_prompt_blocks(tokens, BS),
                          jnp.zeros_like(lens))
    running = jnp.where(state.active, jnp.arange(8, dtype=jnp.int32), -1)
    ones = state.active.astype(jnp.int32)
    state, ok = pool.grow(spec, state, running, ones)
    state, slots = pool.slot_mapping(spec, state, running, ones, 8)
    state, _ = pool.mark_processed(spec, state, state.step - 1)
    return pool.clear_pending(spec, state), ok, slots

  rng = np.random.default_rng(1)
  st = pool.init_pool(spec)
  for i in range(100):
    active = np.asarray(st.active)
    finish = np.where(active & (rng.random(8) < 0.1))[0][:2]
    arrive = np.where(~active)[0][:2]
    finish = np.pad(finish, (0, 2 - len(finish)), constant_values=-1)
    arrive = np.pad(arrive, (0, 2 - len(arrive)), constant_values=-1)
    lens = rng.integers(1, 40, 2)
    tokens = rng.integers(0, 5, (2, 128))
    st, ok, slots = step(st, _i32(*finish), _i32(*arrive), _i32(*lens), jnp.asarray(tokens, jnp.int32))
  pool.assert_pool_valid(spec, st)
  assert int(jnp.sum(st.active)) > 0


def _double_booked(st):
  """A block still in the free queue handed to a sequence as well."""
  f = st.ordered_free_queue()[0]
  return st.replace(block_table=st.block_table.at[1, 1].set(f), ref_count=st.ref_count.at[f].set(1))


@pytest.mark.parametrize(
    "corrupt, broken",
    [
        # One reference too many on an owned block.
        (lambda st: st.replace(ref_count=st.ref_count.at[1].add(1)),
         "ref counts equal the number of table entries"),
        (lambda st: _double_booked(st), "every real block is in exactly one place"),
        # The null block handed to the free queue's head.
        (lambda st: st.replace(free_queue=st.free_queue.at[st.queue_head].set(0)),
         "the null block is nowhere"),
        # A free block lost from the count.
        (lambda st: st.replace(num_free=st.num_free - 1), "free count is conserved"),
        # Padding past a sequence's blocks that is not the null block.
        (lambda st: st.replace(block_table=st.block_table.at[0, 3].set(9)),
         "table entries inside a sequence are real blocks, padding is 0"),
    ],
)
def test_invariant_checkers_catch_a_corrupted_pool(corrupt, broken):
  """The NumPy checker names every invariant a corrupted state breaks, the one
  corrupted among them; the checkify check stops at the first of them. Both
  pass on the state before it."""
  spec = _spec()
  st, (ok, _) = _admit(spec, pool.init_pool(spec), [0, 1], [9, 5])
  assert ok.tolist() == [True, True]
  check = jax.jit(checkify.checkify(lambda s: pool.check_pool(spec, s)))
  pool.assert_pool_valid(spec, st)
  assert check(st)[0].get() is None
  bad = corrupt(st)
  with pytest.raises(AssertionError, match=broken) as info:
    pool.assert_pool_valid(spec, bad)
  names = str(info.value).split(": ", 1)[1].split("; ")
  err = check(bad)[0].get()
  assert err is not None and names[0] in err
