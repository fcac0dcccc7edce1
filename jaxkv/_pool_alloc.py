"""Allocation: growing running sequences and admitting new ones (with prefix hits and loads).

Requests of one call are served in order. A request that needs new blocks
(or zero-list room) gets them while the running total of the call fits; one
that does not fit reports `ok=False` and changes nothing, and no block is ever
half-allocated. `admit` stops at the first request that does not fit (later
ones fail too, as a scheduler stops admitting), `grow` still serves later
requests that need no new block.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, UInt32

from . import _prefix
from ._pool_call import ceil_div, check_request_array, seq_requests, transition
from ._pool_queue import prefix_sum, take_front
from ._pool_spec import PoolSpec
from ._pool_state import PoolState
from ._types import BATCH, MAX_BLOCKS


def _take(spec: PoolSpec, state: PoolState, count: Any, start: Any, first_col: Any, num_new: Any,
          sid: Any, ok: Any, zero_from: Any, zero_start: Any, cols: int, remove: Any = None) -> PoolState:
  """Pops `count` blocks (after taking `remove` out of the queue) into the block table.

  Request r (if ok) receives popped blocks `[start[r], start[r] + num_new[r])`
  at table columns `first_col[r] + k`, `k < num_new[r] <= cols` (`cols` is
  static: the request grid is `[batch, cols]`). When the pool zeroes new
  blocks, those at columns `c >= zero_from[r]` go to the zero list at
  `num_zero + zero_start[r] + c - zero_from[r]` (callers rank them, so no
  pass over the grid is needed). Popped cached blocks lose their hash.
  """
  n, m = spec.num_blocks, spec.max_blocks_per_seq
  b = sid.shape[0]
  kmax = min(b * cols, n - 1)
  popped, queue, head, num_free = take_front(
      state.free_queue, state.queue_head, state.num_free, count, kmax, remove)
  state = _prefix.evict(state, popped, spec.hash_table_size) if spec.enable_prefix_caching else state
  k = jnp.arange(cols)[None, :]
  col = first_col[:, None] + k
  take = ok[:, None] & (k < num_new[:, None])
  block = jnp.where(take, popped[jnp.clip(start[:, None] + k, 0, kmax - 1)], -1)
  rows = jnp.where(take, sid[:, None], spec.max_seqs)
  table = state.block_table.at[rows, jnp.minimum(col, m - 1)].set(block, mode="drop")
  ref = state.ref_count.at[jnp.where(take, block, n)].set(1, mode="drop")
  state = state.replace(free_queue=queue, queue_head=head, num_free=num_free, block_table=table, ref_count=ref)
  if spec.zero_new_blocks:
    zero = take & (col >= zero_from[:, None])
    size = spec.max_zero_list
    pos = jnp.where(zero, state.num_zero + zero_start[:, None] + col - zero_from[:, None], size)
    zl = state.zero_list.at[pos].set(block, mode="drop")
    nz = state.num_zero + jnp.sum(zero.astype(jnp.int32))
    state = state.replace(zero_list=zl, num_zero=nz)
  return state


def _grow_body(spec, state, seq_ids, num_new_tokens, *, checks, max_new_tokens=None):
  bs = spec.block_size
  if max_new_tokens is None:
    max_new_tokens = spec.max_tokens_per_seq
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
    raise ValueError(f"{max_new_tokens=} must be None or an int >= 0")
  # Growing by n tokens adds at most ceil(n / block_size) blocks.
  cols = max(1, min(spec.max_blocks_per_seq, ceil_div(max_new_tokens, bs)))
  seq_ids = check_request_array("seq_ids", seq_ids)
  if seq_ids.ndim != 1:
    raise ValueError(f"{seq_ids.shape=} must be [batch]")
  num_new_tokens = check_request_array("num_new_tokens", num_new_tokens, seq_ids.shape)
  pad, sid, unique = seq_requests(spec, state, seq_ids)
  t = state.num_tokens[sid]
  fits = (num_new_tokens >= 0) & (num_new_tokens <= jnp.minimum(max_new_tokens, spec.max_tokens_per_seq - t))
  valid = unique & state.active[sid] & fits
  checks.require_requests(
      pad, valid,
      "grow: seq_ids[{i}]={s} is out of range, duplicated or inactive, or num_new_tokens[{i}]={k}"
      " is negative, above max_new_tokens or grows the sequence past max_blocks_per_seq",
      s=seq_ids, k=num_new_tokens,
  )
  old_nb = ceil_div(t, bs)
  need = jnp.where(valid, ceil_div(t + num_new_tokens, bs) - old_nb, 0)
  # Every new block is zeroed (when the pool zeroes), so one running total
  # checks both budgets. The requests that need and get blocks are a prefix
  # of those that need any, so the total also places their blocks.
  cum = prefix_sum(need)
  fits = cum <= state.num_free
  if spec.zero_new_blocks:
    fits = fits & (cum <= spec.max_zero_list - state.num_zero)
  ok = valid & ((need == 0) | fits)
  got = jnp.where(ok, need, 0)
  start = cum - need
  state = _take(spec, state, jnp.sum(got), start, old_nb, got, sid, ok, old_nb, start, cols)
  rows = jnp.where(ok, sid, spec.max_seqs)
  state = state.replace(num_tokens=state.num_tokens.at[rows].set(t + num_new_tokens, mode="drop"))
  return state, ok


@transition("jaxkv.grow", static=("max_new_tokens",))
def grow(
    spec: PoolSpec,
    state: PoolState,
    seq_ids: Int[Array, f"{BATCH}"],
    num_new_tokens: Int[Array, f"{BATCH}"],
    *,
    checks: Any,
    max_new_tokens: int | None = None,
) -> tuple[PoolState, Any]:
  """Grows running sequences by `num_new_tokens` each, allocating blocks as needed.

  New blocks come from the front of the free queue (a cached block popped
  there is evicted: its hash is dropped) and, if the pool zeroes new blocks,
  are appended to the zero list in request order.

  Args:
    spec: the pool spec (static).
    state: the pool state.
    seq_ids: `[batch]` int32 active sequence ids, -1 = padding.
    num_new_tokens: `[batch]` int32 tokens to add (>= 0).
    debug: (keyword) checkify misuse inside jit and leave the state unchanged.
    max_new_tokens: (keyword, static) an upper bound on every
      `num_new_tokens[r]`, e.g. 1 for a decode step; a larger count is a
      misuse. It sizes the work at `[batch, ceil(max_new_tokens / block_size)]`
      instead of `[batch, max_blocks_per_seq]`. None: no bound.

  Returns:
    `(state, ok [batch] bool)`: False for padding, misuse, or no room (blocks
    or zero list); such a request changed nothing.

  Raises:
    ValueError: called eagerly with an inactive/unknown/repeated sequence, a
      negative count or one above `max_new_tokens`, or a growth past
      `max_blocks_per_seq`.
  """
  return _grow_body(spec, state, seq_ids, num_new_tokens, checks=checks, max_new_tokens=max_new_tokens)


def _admit_body(spec, state, seq_ids, prompt_lens, block_hashes, load_tokens, *, checks):
  n, m, bs = spec.num_blocks, spec.max_blocks_per_seq, spec.block_size
  seq_ids = check_request_array("seq_ids", seq_ids)
  if seq_ids.ndim != 1:
    raise ValueError(f"{seq_ids.shape=} must be [batch]")
  b = seq_ids.shape[0]
  prompt_lens = check_request_array("prompt_lens", prompt_lens, (b,))
  load_tokens = check_request_array("load_tokens", load_tokens, (b,))
  block_hashes = check_request_array("block_hashes", block_hashes, None, jnp.uint32)
  if block_hashes.ndim != 3 or block_hashes.shape[0] != b or block_hashes.shape[2] != 2 or block_hashes.shape[1] > m:
    raise ValueError(f"{block_hashes.shape=} must be [{b}, <= max_blocks_per_seq={m}, 2]")
  mh = block_hashes.shape[1]
  pad, sid, unique = seq_requests(spec, state, seq_ids)
  fits = (prompt_lens >= 0) & (prompt_lens <= spec.max_tokens_per_seq)
  load_fits = (load_tokens >= 0) & (load_tokens <= prompt_lens)
  valid = unique & ~state.active[sid] & fits & load_fits
  checks.require_requests(
      pad, valid,
      "admit: seq_ids[{i}]={s} is out of range, duplicated or already active, or prompt_lens[{i}]={p}"
      " is negative or past max_blocks_per_seq, or load_tokens[{i}]={l} is outside [0, prompt_len]",
      s=seq_ids, p=prompt_lens, l=load_tokens,
  )
  nb = ceil_div(prompt_lens, bs)
  nf = prompt_lens // bs
  j = jnp.arange(mh)[None, :]
  if spec.enable_prefix_caching:
    found, cand = _prefix.lookup(state, block_hashes, spec.hash_table_size)
    # Later in-place updates of the fences wait for the lookup's read of them.
    found, fence = jax.lax.optimization_barrier((found, state.block_fence))
    state = state.replace(block_fence=fence)
    # At least the last prompt token is always computed, as in vLLM.
    cap = jnp.maximum(prompt_lens - 1, 0) // bs
    found = found & (j < cap[:, None]) & valid[:, None]
    hits = jnp.min(jnp.where(found, mh, j), axis=1).astype(jnp.int32)  # leading found blocks
    hit = j < hits[:, None]
    idle = hit & (state.ref_count[jnp.maximum(cand, 0)] == 0)
    flat = (jnp.arange(b)[:, None] * mh + j).astype(jnp.int32)
    # The first claim of each idle block wins a scatter-min of `-1 - flat`
    # into its ref count (0, so no [N] scratch array), restored right after.
    target = jnp.where(idle, cand, n)
    ref = state.ref_count.at[target].min(-1 - flat, mode="drop")
    first = idle & (ref[jnp.maximum(cand, 0)] == -1 - flat)
    first, ref = jax.lax.optimization_barrier((first, ref))  # read before the in-place restore
    state = state.replace(ref_count=ref.at[target].set(0, mode="drop"))
    claimed = jnp.sum(first.astype(jnp.int32), axis=1)
  else:
    hits = jnp.zeros((b,), jnp.int32)
    claimed = hits
  hit_tok = hits * bs
  load_end = jnp.maximum(hit_tok, load_tokens)
  zero_from = jnp.maximum(hits, ceil_div(load_end, bs))
  new = jnp.where(valid, nb - hits, 0)
  need = jnp.where(valid, new + claimed, 0)
  zneed = jnp.where(valid, nb - zero_from, 0) if spec.zero_new_blocks else jnp.zeros_like(need)
  # One running total per budget (blocks, zero list) and for placement.
  # Admission stops at the first request that does not fit (the failing ones
  # are a suffix), so the totals over valid requests also place the admitted
  # ones' blocks and zero-list entries.
  cums = prefix_sum(jnp.stack([need, zneed, new], axis=1))
  ok = valid & (cums[:, 0] <= state.num_free) & (cums[:, 1] <= spec.max_zero_list - state.num_zero)
  got = jnp.where(ok, new, 0)
  if spec.enable_prefix_caching:
    hit = hit & ok[:, None]
    ref = state.ref_count.at[jnp.where(hit, cand, n)].add(1, mode="drop")
    # Every queued block has ref count 0 but the idle hits just claimed: they
    # leave the queue (no [N] mask to build; the compare fuses into its read).
    remove = ref > 0
    rows = jnp.where(hit, sid[:, None], spec.max_seqs)
    table = state.block_table.at[rows, j].set(cand, mode="drop")
    state = state.replace(ref_count=ref, block_table=table)
  else:
    remove = None
  state = _take(spec, state, jnp.sum(got), cums[:, 2] - new, hits, got, sid, ok, zero_from,
                cums[:, 1] - zneed, m, remove)
  if spec.enable_prefix_caching:
    # Register the new full prompt blocks that no load fills (loaded blocks never are).
    reg = ok[:, None] & (j >= zero_from[:, None]) & (j < nf[:, None])
    blocks = jnp.where(reg, state.block_table[sid[:, None], j], -1).reshape(-1)
    # Later in-place updates of the table wait for this read (else XLA copies the table).
    blocks, table = jax.lax.optimization_barrier((blocks, state.block_table))
    state = state.replace(block_table=table)
    state = _prefix.register(state, blocks, block_hashes.reshape(-1, 2), spec.hash_table_size)
  rows = jnp.where(ok, sid, spec.max_seqs)
  state = state.replace(
      num_tokens=state.num_tokens.at[rows].set(prompt_lens, mode="drop"),
      active=state.active.at[rows].set(True, mode="drop"),
      loading=state.loading.at[rows].set(load_end > hit_tok, mode="drop"),
      load_start=state.load_start.at[rows].set(hit_tok, mode="drop"),
      load_end=state.load_end.at[rows].set(load_end, mode="drop"),
  )
  return state, (ok, jnp.where(ok, hit_tok, 0))


@transition("jaxkv.admit")
def admit(
    spec: PoolSpec,
    state: PoolState,
    seq_ids: Int[Array, f"{BATCH}"],
    prompt_lens: Int[Array, f"{BATCH}"],
    block_hashes: UInt32[Array, f"{BATCH} {MAX_BLOCKS} 2"],
    load_tokens: Int[Array, f"{BATCH}"],
    *,
    checks: Any,
) -> tuple[PoolState, Any]:
  """Admits new sequences with their prompts: prefix hits, async loads, new blocks.

  With prefix caching, the leading full prompt blocks whose chained digests
  are cached are shared (ref count +1, taken out of the free queue if idle),
  except that the block holding the last prompt token is always computed.
  An asynchronous load then fills tokens `[hits, max(hits, load_tokens))`:
  its blocks are exempt from the zero list until `complete_loads`. The rest
  are new blocks, zeroed if the pool zeroes new blocks; the new full prompt
  blocks outside the load are registered under their digests.

  Args:
    spec: the pool spec (static).
    state: the pool state.
    seq_ids: `[batch]` int32 inactive sequence ids, -1 = padding.
    prompt_lens: `[batch]` int32 prompt tokens.
    block_hashes: `[batch, m, 2]` uint32 chained digests of the prompt's full
      blocks (`hash_prompt_blocks`), `m <= max_blocks_per_seq`; entries past
      `prompt_len // block_size` are ignored.
    load_tokens: `[batch]` int32 leading prompt tokens an asynchronous load
      provides (0 = none).
    debug: (keyword) checkify misuse inside jit and leave the state unchanged.

  Returns:
    `(state, (ok [batch] bool, cached_tokens [batch] int32))`; cached tokens
    are the prefix-hit tokens of admitted requests.

  Raises:
    ValueError: called eagerly with an active/unknown/repeated sequence or
      lengths out of range.
  """
  return _admit_body(spec, state, seq_ids, prompt_lens, block_hashes, load_tokens, checks=checks)
