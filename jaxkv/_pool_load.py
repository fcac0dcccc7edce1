"""Completing asynchronous loads: queue the tail, or the blocks a failed load left invalid."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Int

from ._pool_call import ceil_div, check_request_array, cum_ok, seq_requests, transition
from ._pool_queue import append
from ._pool_spec import PoolSpec
from ._pool_state import PoolState
from ._types import BATCH


@transition("jaxkv.complete_loads")
def complete_loads(
    spec: PoolSpec,
    state: PoolState,
    seq_ids: Int[Array, f"{BATCH}"],
    num_valid_tokens: Int[Array, f"{BATCH}"],
    *,
    checks: Any,
) -> tuple[PoolState, Any]:
  """Completes the pending loads of sequences with the number of tokens that arrived.

  A load that delivered all its tokens succeeded: if it ended inside a block,
  that block's tail `(block_id, valid_slots)` is queued once (a block-aligned
  load queues nothing). A load that delivered fewer failed: every block from
  the one holding the first invalid token to the load's last block is queued
  for zeroing whole (the caller recomputes those tokens). Nothing is queued
  when the pool does not zero new blocks. A completion whose entries do not
  fit in the pending lists reports `ok=False` and stays pending.

  Args:
    spec: the pool spec (static).
    state: the pool state.
    seq_ids: `[batch]` int32 sequences with a pending load, -1 = padding.
    num_valid_tokens: `[batch]` int32 tokens the load delivered, counted from
      its first token, in `[0, load_tokens]`.
    debug: (keyword) checkify misuse inside jit and leave the state unchanged.

  Returns:
    `(state, ok [batch] bool)`.

  Raises:
    ValueError: called eagerly for a sequence without a pending load or with
      a count out of range.
  """
  bs, m = spec.block_size, spec.max_blocks_per_seq
  seq_ids = check_request_array("seq_ids", seq_ids)
  if seq_ids.ndim != 1:
    raise ValueError(f"{seq_ids.shape=} must be [batch]")
  num_valid_tokens = check_request_array("num_valid_tokens", num_valid_tokens, seq_ids.shape)
  pad, sid, unique = seq_requests(spec, state, seq_ids)
  start, end = state.load_start[sid], state.load_end[sid]
  in_range = (num_valid_tokens >= 0) & (num_valid_tokens <= end - start)
  valid = unique & state.active[sid] & state.loading[sid] & in_range
  checks.require_requests(
      pad, valid,
      "complete_loads: seq_ids[{i}]={s} has no pending load or is repeated, or"
      " num_valid_tokens[{i}]={v} is outside [0, load size]",
      s=seq_ids, v=num_valid_tokens,
  )
  stop = start + num_valid_tokens
  failed = stop < end
  first_invalid = stop // bs
  last = ceil_div(end, bs)
  if spec.zero_new_blocks:
    tail = ~failed & (stop % bs != 0)
    nzero = jnp.where(valid & failed, last - first_invalid, 0)
    ntail = jnp.where(valid & tail, 1, 0)
  else:
    tail = jnp.zeros_like(failed)
    nzero = ntail = jnp.zeros_like(num_valid_tokens)
  ok = cum_ok(valid, nzero, spec.max_zero_list - state.num_zero) & cum_ok(
      valid, ntail, spec.max_tails - state.num_tails)
  if spec.zero_new_blocks:
    k = jnp.arange(m)[None, :]
    zmask = ok[:, None] & failed[:, None] & (k >= first_invalid[:, None]) & (k < last[:, None])
    zl, nz = append(state.zero_list, state.num_zero, state.block_table[sid].reshape(-1), zmask.reshape(-1))
    tmask = ok & tail
    tail_block = state.block_table[sid, jnp.clip(first_invalid, 0, m - 1)]
    ti, _ = append(state.tail_ids, state.num_tails, tail_block, tmask)
    tv, nt = append(state.tail_valid, state.num_tails, stop % bs, tmask)
    state = state.replace(zero_list=zl, num_zero=nz, tail_ids=ti, tail_valid=tv, num_tails=nt)
  rows = jnp.where(ok, sid, spec.max_seqs)
  return state.replace(loading=state.loading.at[rows].set(False, mode="drop")), ok
