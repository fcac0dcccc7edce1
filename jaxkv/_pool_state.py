"""The dynamic state of a block pool: one frozen pytree of device arrays, and `init_pool`.

Where a block lives (exactly one place at any time):
  * block 0, the null block: never allocated, freed, hashed or queued for zeroing;
  * the free queue `free_queue[:num_free]`, front first; popped from the front.
    Freed blocks without a prefix hash are pushed to the front (reused first),
    hashed ones to the back (least recently used is evicted first);
  * owned: `ref_count > 0`, held by exactly `ref_count` block-table rows;
  * parked behind a fence (`parked[:num_parked]`, in the order they were freed,
    `parked_step` the step that may still write them; `block_fence` the same per
    block, -1 when not parked).

Array shapes (N = num_blocks, S = max_seqs, M = max_blocks_per_seq,
H = hash_table_size, Z = max_zero_list, K = max_tails), all int32 unless noted:
  free_queue [N], num_free [] ; ref_count [N] ; block_hash [N, 2] uint32,
  hashed [N] bool, hash_table [H] (block id or -1) ; block_fence [N],
  parked [N], parked_step [N], num_parked [] ; block_table [S, M] (padded with
  0), num_tokens [S], active [S] bool, loading [S] bool, load_start [S],
  load_end [S] (token range an async load fills) ; zero_list [Z], num_zero [] ;
  tail_ids [K], tail_valid [K], num_tails [] ; step [], processed [] (both start
  at 0: no step is in flight, so nothing freed before the first step is parked).
Pending lists and the queues are padded with -1 past their counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ._pool_spec import PoolSpec

_FIELDS = (
    "free_queue", "num_free", "ref_count", "block_hash", "hashed", "hash_table",
    "block_fence", "parked", "parked_step", "num_parked", "block_table", "num_tokens",
    "active", "loading", "load_start", "load_end", "zero_list", "num_zero", "tail_ids",
    "tail_valid", "num_tails", "step", "processed",
)


@dataclasses.dataclass(frozen=True)
class PoolState:
  """Free queue, ref counts, prefix hashes, fences, block tables and pending zero work.

  Fields are device arrays (see the module docstring for shapes); transitions
  return a new `PoolState` with `dataclasses.replace`.
  """

  free_queue: Any
  num_free: Any
  ref_count: Any
  block_hash: Any
  hashed: Any
  hash_table: Any
  block_fence: Any
  parked: Any
  parked_step: Any
  num_parked: Any
  block_table: Any
  num_tokens: Any
  active: Any
  loading: Any
  load_start: Any
  load_end: Any
  zero_list: Any
  num_zero: Any
  tail_ids: Any
  tail_valid: Any
  num_tails: Any
  step: Any
  processed: Any

  def replace(self, **changes: Any) -> PoolState:
    return dataclasses.replace(self, **changes)

  @property
  def pending_zero(self) -> tuple[Any, tuple[Any, Any]]:
    """`(zero_list, (tail_ids, tail_valid))`, the arguments a `zero_blocks` call consumes."""
    return self.zero_list, (self.tail_ids, self.tail_valid)


jax.tree_util.register_dataclass(PoolState, data_fields=list(_FIELDS), meta_fields=[])


def init_pool(spec: PoolSpec) -> PoolState:
  """An empty pool: every block but the null block in the free queue, in id order.

  Args:
    spec: the pool's static sizes and policy.

  Returns:
    The initial `PoolState` (free queue `[1, 2, ..., N-1, -1]`, no sequences).
  """
  if not isinstance(spec, PoolSpec):
    raise ValueError(f"spec must be a PoolSpec, got {type(spec).__name__}")
  n, s, m = spec.num_blocks, spec.max_seqs, spec.max_blocks_per_seq
  i32 = jnp.int32
  queue = jnp.where(jnp.arange(n, dtype=i32) < n - 1, jnp.arange(1, n + 1, dtype=i32), -1)
  return PoolState(
      free_queue=queue,
      num_free=jnp.asarray(n - 1, i32),
      ref_count=jnp.zeros((n,), i32),
      block_hash=jnp.zeros((n, 2), jnp.uint32),
      hashed=jnp.zeros((n,), bool),
      hash_table=jnp.full((spec.hash_table_size,), -1, i32),
      block_fence=jnp.full((n,), -1, i32),
      parked=jnp.full((n,), -1, i32),
      parked_step=jnp.full((n,), -1, i32),
      num_parked=jnp.asarray(0, i32),
      block_table=jnp.zeros((s, m), i32),
      num_tokens=jnp.zeros((s,), i32),
      active=jnp.zeros((s,), bool),
      loading=jnp.zeros((s,), bool),
      load_start=jnp.zeros((s,), i32),
      load_end=jnp.zeros((s,), i32),
      zero_list=jnp.full((spec.max_zero_list,), -1, i32),
      num_zero=jnp.asarray(0, i32),
      tail_ids=jnp.full((spec.max_tails,), -1, i32),
      tail_valid=jnp.full((spec.max_tails,), -1, i32),
      num_tails=jnp.asarray(0, i32),
      step=jnp.asarray(0, i32),
      processed=jnp.asarray(0, i32),
  )
