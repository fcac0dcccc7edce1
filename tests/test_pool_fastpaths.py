"""The pool's cheap paths: grow's static `max_new_tokens` cap and the list primitives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import _pool as pool
from jaxkv._pool_queue import prefix_sum, push_freed, take_front

BS = 4


def _i32(*xs):
  return jnp.asarray(xs, jnp.int32)


def _running_pool(seed):
  spec = pool.PoolSpec(num_blocks=40, block_size=BS, max_seqs=6, max_blocks_per_seq=6,
                       max_zero_list=64)
  rng = np.random.default_rng(seed)
  st = pool.init_pool(spec)
  lens = rng.integers(1, 18, 6).astype(np.int32)
  digests = pool.hash_prompt_blocks(jnp.asarray(rng.integers(0, 9, (6, 24)), jnp.int32), BS)
  st, (ok, _) = pool.admit(spec, st, jnp.arange(6, dtype=jnp.int32), jnp.asarray(lens), digests,
                           jnp.zeros((6,), jnp.int32))
  assert bool(jnp.all(ok))
  st, _ = pool.free(spec, st, _i32(int(rng.integers(6)), -1))
  return spec, pool.clear_pending(spec, st), rng


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_capped_grow_matches_uncapped(seed):
  spec, st, rng = _running_pool(seed)
  ids = jnp.asarray(np.where(np.asarray(st.active), np.arange(6), -1).astype(np.int32))
  cap = 5
  counts = jnp.asarray(rng.integers(0, cap + 1, 6).astype(np.int32))
  grow = jax.jit(lambda s, i, n: pool.grow(spec, s, i, n))
  capped = jax.jit(lambda s, i, n: pool.grow(spec, s, i, n, max_new_tokens=cap))
  for _ in range(4):  # until the pool runs dry, so some requests fail
    (a, ok_a), (b, ok_b) = grow(st, ids, counts), capped(st, ids, counts)
    assert ok_a.tolist() == ok_b.tolist()
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    pool.assert_pool_valid(spec, b)
    st = b
  assert not all(ok_b.tolist()), "the pool never ran out: the test saw no failure path"


def test_count_above_cap_is_misuse():
  spec, st, _ = _running_pool(3)
  sid = int(np.flatnonzero(np.asarray(st.active))[0])
  with pytest.raises(ValueError, match="max_new_tokens"):
    pool.grow(spec, st, _i32(sid), _i32(2), max_new_tokens=1)
  leaves = [np.asarray(x).copy() for x in jax.tree.leaves(st)]
  new, ok = jax.jit(lambda s: pool.grow(spec, s, _i32(sid), _i32(2), max_new_tokens=1))(st)
  assert ok.tolist() == [False]
  for before, after in zip(leaves, jax.tree.leaves(new)):
    np.testing.assert_array_equal(before, np.asarray(after))
  with pytest.raises(TypeError):
    pool.grow(spec, st, _i32(sid), _i32(1), max_tokens=1)


@pytest.mark.parametrize("shape", [(1,), (31,), (33, 3), (1000,), (4097,), (5000, 2)])
def test_prefix_sum_is_cumsum(shape):
  x = np.random.default_rng(shape[0]).integers(-3, 9, shape).astype(np.int32)
  np.testing.assert_array_equal(np.asarray(prefix_sum(jnp.asarray(x))), np.cumsum(x, axis=0))


def _live_queue(rng, n):
  """A ring with a random head (often wrapping), its count and the blocks not in it."""
  num_free = int(rng.integers(0, n - 8))
  head = int(rng.integers(0, n))
  ids = rng.permutation(np.arange(1, n))
  queue = np.full(n, -1, np.int32)
  queue[(head + np.arange(num_free)) % n] = ids[:num_free]
  return queue, head, num_free, ids[num_free:]


def _in_order(ring, head, count):
  ring, n = np.asarray(ring), len(ring)
  order = ring[(int(head) + np.arange(n)) % n]
  assert (order[int(count):] == -1).all(), "the ring holds entries past its count"
  return order[: int(count)].tolist()


@pytest.mark.parametrize("seed", range(8))
def test_push_and_take_match_list_semantics(seed):
  rng = np.random.default_rng(seed)
  n = 48
  queue, head, num_free, others = _live_queue(rng, n)
  hashed = rng.random(n) < 0.5
  events = np.full(12, -1, np.int32)
  pick = rng.random(12) < 0.7
  events[pick] = others[: int(pick.sum())]
  want = _in_order(queue, head, num_free)
  for e in events:  # one block at a time, as the pool's policy states it
    if e > 0:
      want = want + [e] if hashed[e] else [e] + want
  got, ghead, count = push_freed(jnp.asarray(queue), jnp.int32(head), jnp.int32(num_free), jnp.asarray(events),
                                jnp.asarray(hashed))
  assert _in_order(got, ghead, count) == want
  remove = np.zeros(n, bool)
  remove[rng.choice(want, size=min(5, len(want)), replace=False)] = True
  kept = [b for b in want if not remove[b]]
  count_pop = int(rng.integers(0, len(kept) + 1))
  for rm in (jnp.asarray(remove), None):
    ref = kept if rm is not None else want
    c = min(count_pop, len(ref), 20)
    popped, rest, rhead, left = take_front(got, ghead, count, jnp.int32(c), 20, rm)
    assert np.asarray(popped).tolist() == (ref[:c] + [-1] * 20)[:20]
    assert int(left) == len(ref) - c and _in_order(rest, rhead, left) == ref[c:]
