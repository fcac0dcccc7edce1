"""Freeing finished (or aborted) sequences: ref counts, reverse order, fences."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ._pool_call import check_request_array, ceil_div, first_bad, seq_requests, transition
from ._pool_queue import event_ranks, push_freed
from ._pool_spec import PoolSpec
from ._pool_state import SEQ_MASK, PoolState, ring_index
from ._types import BATCH


def release(spec: PoolSpec, state: PoolState, events: Any) -> PoolState:
  """Blocks whose ref count reached 0, in free order (`[m]`, -1 padded), leave their owners.

  With `defer_block_free`, while the current step is not processed, they are
  parked behind its fence; otherwise they go straight into the free queue.
  """
  n = spec.num_blocks
  is_hashed, ranks = event_ranks(events, state.hashed)  # shared by parking and pushing
  enabled = True
  if spec.defer_block_free:
    # Only a step that has started and is not processed yet can still write them.
    fenced = state.step > state.processed
    valid = (events > 0) & fenced
    # Unhashed and hashed blocks park in two rings, each in free order, so a
    # release moves two contiguous runs into the free queue (no ranks, no scatter).
    nu, nh = state.num_parked_u, state.num_parked_h
    pos = jnp.where(is_hashed, ring_index(state.parked_h_head, nh + ranks[:, 1] - 1, n),
                    ring_index(state.parked_u_head, nu + ranks[:, 0] - 1, n))
    pos = jnp.where(valid, pos, n)
    seq = (state.park_seq + ranks[:, 0] + ranks[:, 1] - 1) & SEQ_MASK
    rows = jnp.stack([events, jnp.broadcast_to(state.step, events.shape), seq], axis=1)  # [m, 3]
    info = state.parked_info.reshape(2, 3, n).at[is_hashed.astype(jnp.int32), :, pos].set(rows, mode="drop")
    nvalid_u = jnp.sum((valid & ~is_hashed).astype(jnp.int32))
    nvalid = jnp.sum(valid.astype(jnp.int32))
    state = state.replace(
        parked_info=info.reshape(6, n),
        num_parked_u=nu + nvalid_u,
        num_parked_h=nh + nvalid - nvalid_u,
        park_seq=(state.park_seq + nvalid) & SEQ_MASK,
        block_fence=state.block_fence.at[jnp.where(valid, events, n)].set(state.step, mode="drop"),
    )
    enabled = ~fenced
  queue, head, num_free = push_freed(state.free_queue, state.queue_head, state.num_free, events, state.hashed,
                                     (is_hashed, ranks), enabled)
  return state.replace(free_queue=queue, queue_head=head, num_free=num_free)


def _free_body(spec: PoolSpec, state: PoolState, seq_ids: Any, *, checks: Any) -> tuple[PoolState, Any]:
  n, m, bs = spec.num_blocks, spec.max_blocks_per_seq, spec.block_size
  seq_ids = check_request_array("seq_ids", seq_ids)
  if seq_ids.ndim != 1:
    raise ValueError(f"{seq_ids.shape=} must be [batch]")
  b = seq_ids.shape[0]
  pad, sid, unique = seq_requests(spec, state, seq_ids)
  valid = unique & state.active[sid]
  checks.require_requests(
      pad, valid, "free: seq_ids[{i}]={s} is out of range, duplicated or not an active sequence", s=seq_ids
  )
  nb = jnp.where(valid, ceil_div(state.num_tokens[sid], bs), 0)
  # Row r lists its blocks last first: a sequence frees its tail before its head.
  k = jnp.arange(m)[None, :]
  col = jnp.clip(nb[:, None] - 1 - k, 0, m - 1)
  live = k < nb[:, None]
  blocks = jnp.where(live, state.block_table[sid[:, None], col], -1)
  # The table's in-place update below waits for this read (else XLA copies the table).
  blocks, table = jax.lax.optimization_barrier((blocks, state.block_table))
  # Ref counts after every listed reference is dropped; below 0 means a block
  # is listed more often than it is held (double free). The scatters touch
  # only the listed blocks and update the counts in place.
  safe = jnp.maximum(blocks, 0)
  ref = state.ref_count.at[jnp.where(live, blocks, n)].add(-1, mode="drop")
  over = live & ((blocks == 0) | (ref[safe] < 0))
  j = first_bad(over.reshape(-1))
  checks.require(~jnp.any(over), "free: block {blk} is the null block or already free (double free)",
                 blk=blocks.reshape(-1)[j])
  ok = valid & ~jnp.any(over, axis=1)
  # Requests that would corrupt the counts give their references back.
  ref = ref.at[jnp.where(live & ~ok[:, None], blocks, n)].add(1, mode="drop")
  live = live & ok[:, None]
  # A block leaves at its last listed reference once none remains: among its
  # listed copies the latest position wins a scatter-min of `-1 - position`
  # into its count (0), which is then restored.
  flat = jnp.arange(b * m, dtype=jnp.int32).reshape(b, m)
  zero = live & (ref[safe] == 0)
  target = jnp.where(zero, blocks, n)
  ref = ref.at[target].min(-1 - flat, mode="drop")
  events = jnp.where(zero & (ref[safe] == -1 - flat), blocks, -1).reshape(-1)
  events, ref = jax.lax.optimization_barrier((events, ref))  # read before the in-place restore
  ref = ref.at[target].set(0, mode="drop")
  rows = jnp.where(ok, sid, spec.max_seqs)
  state = state.replace(
      ref_count=ref,
      block_table=table.at[rows].set(0, mode="drop"),
      num_tokens=state.num_tokens.at[rows].set(0, mode="drop"),
      active=state.active.at[rows].set(False, mode="drop"),
      loading=state.loading.at[rows].set(False, mode="drop"),
  )
  return release(spec, state, events), ok


@transition("jaxkv.free")
def free(spec: PoolSpec, state: PoolState, seq_ids: Int[Array, f"{BATCH}"], *, checks: Any) -> tuple[PoolState, Any]:
  """Frees finished sequences: every block loses one reference; blocks at 0 leave.

  Blocks of a sequence are released last block first. A released block
  without a prefix hash goes to the front of the free queue (reused first), a
  cached one to the back (evicted last); with `defer_block_free` both are
  parked behind the current step's fence instead. Requests of one call act in
  order, as consecutive calls would.

  Args:
    spec: the pool spec (static).
    state: the pool state.
    seq_ids: `[batch]` int32 active sequence ids, -1 = padding.
    debug: (keyword) checkify misuse inside jit and leave the state unchanged.

  Returns:
    `(state, ok [batch] bool)`; ok is False for padding and misused requests.

  Raises:
    ValueError: called eagerly on an unknown, inactive or repeated sequence.
  """
  return _free_body(spec, state, seq_ids, checks=checks)


@transition("jaxkv.abort")
def abort(spec: PoolSpec, state: PoolState, seq_ids: Int[Array, f"{BATCH}"], *, checks: Any) -> tuple[PoolState, Any]:
  """Aborts sequences at any time, also while a load is pending: exactly like `free`.

  The fence still holds: with `defer_block_free` an aborted sequence's blocks
  are parked like any freed block, so no one gets them before the step that
  may still write them is processed. A pending load of the sequence is
  forgotten (its completion is then a misuse).
  """
  return _free_body(spec, state, seq_ids, checks=checks)
