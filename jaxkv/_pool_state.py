"""The dynamic state of a block pool: one frozen pytree of device arrays, and `init_pool`.

Where a block lives (exactly one place at any time):
  * block 0, the null block: never allocated, freed, hashed or queued for zeroing;
  * the free queue, front first; popped from the front. Freed blocks without
    a prefix hash are pushed to the front (reused first), hashed ones to the
    back (least recently used is evicted first). It is a ring: entry `i` of
    the queue is `free_queue[(queue_head + i) % N]` for `i < num_free`, so
    pops and pushes move a head index instead of every entry
    (`ordered_free_queue()` reads it front first);
  * owned: `ref_count > 0`, held by exactly `ref_count` block-table rows;
  * parked behind a fence, in two rings (unhashed and hashed blocks), each in
    the order they were freed, with the step that may still write them and a
    park order number (`ordered_parked()` merges them in free order). A
    release then moves two contiguous runs into the free queue. `block_fence`
    holds the parking step per block: a block is fenced while its
    `block_fence > processed` (released blocks keep their processed step, so
    a release never touches it; -1 for blocks never parked).

Storage (N = num_blocks, S = max_seqs, M = max_blocks_per_seq, H =
hash_table_size, Z = max_zero_list, K = max_tails), all int32 unless noted.
Every call of a jitted step passes each leaf, so small arrays of one length
share a leaf; the public names below are properties over them:
  free_queue [N] (ring, -1 where not live) ; ref_count [N] ; block_hash [N, 2]
  uint32, hashed [N] bool, hash_table [H] (block id or -1) ; block_fence [N] ;
  parked_info [6, N]: rows `parked_u`, `parked_u_step`, `parked_u_seq` (the
  unhashed ring: block, step, park order number modulo 2**30) and the same
  three for the hashed ring `parked_h*`; entries outside the live runs are
  stale and never read ; block_table [S, M] (padded with 0) ; seq_info [5, S]:
  rows `num_tokens`, `load_start`, `load_end` (token range an async load
  fills), `active`, `loading` (0/1, read as bool) ; zero_list [Z] ; tail_info
  [2, K]: rows `tail_ids`, `tail_valid` ; counters [11]: `num_free`,
  `queue_head`, `num_parked_u`, `parked_u_head`, `num_zero`, `num_tails`,
  `step`, `processed` (both start at 0: no step is in flight, so nothing
  freed before the first step is parked), `num_parked_h`, `parked_h_head`,
  `park_seq` (the next park order number). `num_parked` is the sum of both
  rings' counts.
Pending lists are padded with -1 past their counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ._pool_spec import PoolSpec

_STORAGE = (
    "free_queue", "ref_count", "block_hash", "hashed", "hash_table", "block_fence", "parked_info",
    "block_table", "seq_info", "zero_list", "tail_info", "counters",
)
# Packed names: (storage leaf, row, stored as bool).
_PACKED = {
    "parked_u": ("parked_info", 0, False), "parked_u_step": ("parked_info", 1, False),
    "parked_u_seq": ("parked_info", 2, False), "parked_h": ("parked_info", 3, False),
    "parked_h_step": ("parked_info", 4, False), "parked_h_seq": ("parked_info", 5, False),
    "num_tokens": ("seq_info", 0, False), "load_start": ("seq_info", 1, False),
    "load_end": ("seq_info", 2, False), "active": ("seq_info", 3, True),
    "loading": ("seq_info", 4, True),
    "tail_ids": ("tail_info", 0, False), "tail_valid": ("tail_info", 1, False),
    "num_free": ("counters", 0, False), "queue_head": ("counters", 1, False),
    "num_parked_u": ("counters", 2, False), "parked_u_head": ("counters", 3, False),
    "num_zero": ("counters", 4, False), "num_tails": ("counters", 5, False),
    "step": ("counters", 6, False), "processed": ("counters", 7, False),
    "num_parked_h": ("counters", 8, False), "parked_h_head": ("counters", 9, False),
    "park_seq": ("counters", 10, False),
}
_ROWS = {"parked_info": 6, "seq_info": 5, "tail_info": 2, "counters": 11}
SEQ_MASK = (1 << 30) - 1  # park order numbers wrap modulo 2**30 (differences stay exact)


def _packed_property(name: str) -> property:
  leaf, row, is_bool = _PACKED[name]

  def get(self):
    x = getattr(self, leaf)[row]
    return x != 0 if is_bool else x

  get.__doc__ = f"Row {row} of `{leaf}`" + (" as bool." if is_bool else ".")
  return property(get)


def ring_index(head: Any, offset: Any, n: int) -> Any:
  """`(head + offset) % n` where `-n <= head + offset < 2n` (two selects, no division)."""
  x = head + offset
  return jnp.where(x < 0, x + n, jnp.where(x >= n, x - n, x))


@dataclasses.dataclass(frozen=True)
class PoolState:
  """Free queue, ref counts, prefix hashes, fences, block tables and pending zero work.

  Fields are device arrays (see the module docstring for shapes and the
  packed names read as properties); transitions return a new `PoolState`
  with `replace`, which accepts packed names too.
  """

  free_queue: Any
  ref_count: Any
  block_hash: Any
  hashed: Any
  hash_table: Any
  block_fence: Any
  parked_info: Any
  block_table: Any
  seq_info: Any
  zero_list: Any
  tail_info: Any
  counters: Any

  def replace(self, **changes: Any) -> PoolState:
    """A new state with `changes` (storage or packed names) applied."""
    direct = {k: v for k, v in changes.items() if k in _STORAGE}
    unknown = set(changes) - set(direct) - set(_PACKED)
    if unknown:
      raise TypeError(f"unknown PoolState fields {sorted(unknown)}")
    by_leaf: dict[str, list[tuple[int, Any]]] = {}
    for k, v in changes.items():
      if k in _PACKED:
        leaf, row, _ = _PACKED[k]
        by_leaf.setdefault(leaf, []).append((row, v))
    for leaf, rows in by_leaf.items():
      # The whole leaf is restacked from its rows: XLA folds a later read of a
      # row back to the value stacked there, so a chain of transitions keeps
      # its counters as plain scalars and packs them once (no small scatters).
      cur = direct.get(leaf, getattr(self, leaf))
      new = dict(rows)
      cur = jnp.stack([jnp.asarray(new[r]).astype(cur.dtype) if r in new else cur[r] for r in range(_ROWS[leaf])])
      direct[leaf] = cur
    return dataclasses.replace(self, **direct)

  @property
  def pending_zero(self) -> tuple[Any, tuple[Any, Any]]:
    """`(zero_list, (tail_ids, tail_valid))`, the arguments a `zero_blocks` call consumes."""
    return self.zero_list, (self.tail_ids, self.tail_valid)

  def ordered_free_queue(self) -> Any:
    """`[N]` int32: the free queue front first, -1 past `num_free`."""
    n = self.free_queue.shape[0]
    i = jnp.arange(n, dtype=jnp.int32)
    return jnp.where(i < self.num_free, self.free_queue[ring_index(self.queue_head, i, n)], -1)

  @property
  def num_parked(self) -> Any:
    """Blocks parked behind fences (both rings)."""
    return self.num_parked_u + self.num_parked_h

  def parked_live(self) -> tuple[Any, Any]:
    """`([N], [N])` bool: live entries of the unhashed and the hashed parked rings."""
    n = self.parked_info.shape[1]
    p = jnp.arange(n, dtype=jnp.int32)
    return (ring_index(-self.parked_u_head, p, n) < self.num_parked_u,
            ring_index(-self.parked_h_head, p, n) < self.num_parked_h)

  def ordered_parked(self) -> tuple[Any, Any]:
    """`([N], [N])` int32: parked blocks and their steps in free order, -1 past `num_parked`.

    The two rings are merged by park order (for checks and tests; not for jit).
    """
    n = self.parked_info.shape[1]
    live = jnp.concatenate(self.parked_live())
    oldest = self.park_seq - self.num_parked
    key = (jnp.concatenate([self.parked_u_seq, self.parked_h_seq]) - oldest) & SEQ_MASK
    order = jnp.argsort(jnp.where(live, key, SEQ_MASK + 1))[:n]
    blocks = jnp.concatenate([self.parked_u, self.parked_h])[order]
    steps = jnp.concatenate([self.parked_u_step, self.parked_h_step])[order]
    i = jnp.arange(n)
    return jnp.where(i < self.num_parked, blocks, -1), jnp.where(i < self.num_parked, steps, -1)

  def fields(self) -> dict[str, Any]:
    """Every storage leaf and packed name, as arrays (for checkers and tests)."""
    out = {k: getattr(self, k) for k in _STORAGE}
    out.update({k: getattr(self, k) for k in _PACKED})
    out["num_parked"] = self.num_parked
    return out


for _name in _PACKED:
  setattr(PoolState, _name, _packed_property(_name))

jax.tree_util.register_dataclass(PoolState, data_fields=list(_STORAGE), meta_fields=[])


def init_pool(spec: PoolSpec) -> PoolState:
  """An empty pool: every block but the null block in the free queue, in id order.

  Args:
    spec: the pool's static sizes and policy.

  Returns:
    The initial `PoolState` (free queue `[1, 2, ..., N-1]` from head 0, no sequences).
  """
  if not isinstance(spec, PoolSpec):
    raise ValueError(f"spec must be a PoolSpec, got {type(spec).__name__}")
  n, s, m = spec.num_blocks, spec.max_seqs, spec.max_blocks_per_seq
  i32 = jnp.int32
  queue = jnp.where(jnp.arange(n, dtype=i32) < n - 1, jnp.arange(1, n + 1, dtype=i32), -1)
  counters = jnp.zeros((11,), i32).at[0].set(n - 1)
  return PoolState(
      free_queue=queue,
      ref_count=jnp.zeros((n,), i32),
      block_hash=jnp.zeros((n, 2), jnp.uint32),
      hashed=jnp.zeros((n,), bool),
      hash_table=jnp.full((spec.hash_table_size,), -1, i32),
      block_fence=jnp.full((n,), -1, i32),
      parked_info=jnp.full((6, n), -1, i32),
      block_table=jnp.zeros((s, m), i32),
      seq_info=jnp.zeros((5, s), i32),
      zero_list=jnp.full((spec.max_zero_list,), -1, i32),
      tail_info=jnp.full((2, spec.max_tails), -1, i32),
      counters=counters,
  )
