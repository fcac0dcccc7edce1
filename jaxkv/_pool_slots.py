"""Read-outs for one step: the slot mapping of its tokens and the pending zero work."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ._pool_call import check_request_array
from ._pool_queue import prefix_sum
from ._pool_spec import PoolSpec
from ._pool_state import PoolState
from ._types import BATCH, TOKENS


def slot_mapping(
    spec: PoolSpec,
    state: PoolState,
    seq_ids: Int[Array, f"{BATCH}"],
    num_new_tokens: Int[Array, f"{BATCH}"],
    num_slots: int,
) -> tuple[PoolState, Int[Array, f"{TOKENS}"]]:
  """Global slots of the newest tokens of each sequence, packed in request order.

  Call it after `grow`/`admit`: the tokens of request r are the last
  `num_new_tokens[r]` of its sequence, written at `block * block_size +
  offset`. Padding rows (seq id -1), inactive rows and slots past the total
  map to -1, which every cache write skips.

  Args:
    spec: the pool spec (static).
    state: the pool state (returned unchanged).
    seq_ids: `[batch]` int32, -1 = padding.
    num_new_tokens: `[batch]` int32 tokens per request.
    num_slots: static length of the mapping.

  Returns:
    `(state, slots [num_slots] int32)`.
  """
  seq_ids = check_request_array("seq_ids", seq_ids)
  num_new_tokens = check_request_array("num_new_tokens", num_new_tokens, seq_ids.shape)
  if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
    raise ValueError(f"{num_slots=} must be a positive int")
  bs, m = spec.block_size, spec.max_blocks_per_seq
  with jax.named_scope("jaxkv.slot_mapping"):
    sid = jnp.clip(seq_ids, 0, spec.max_seqs - 1)
    live = (seq_ids >= 0) & (seq_ids < spec.max_seqs) & state.active[sid]
    count = jnp.where(live, jnp.clip(num_new_tokens, 0, state.num_tokens[sid]), 0)
    ends = prefix_sum(count)
    t = jnp.arange(num_slots, dtype=jnp.int32)
    # Request of token t: how many requests end at or before t (a searchsorted
    # would be a loop; a histogram of the ends and its running sum is not).
    ended = jnp.zeros((num_slots,), jnp.int32).at[ends].add(1, mode="drop")
    r = jnp.minimum(prefix_sum(ended), seq_ids.shape[0] - 1)
    pos = state.num_tokens[sid[r]] - ends[r] + t
    block = state.block_table[sid[r], jnp.clip(pos // bs, 0, m - 1)]
    slots = jnp.where((t < ends[-1]) & (block > 0), block * bs + pos % bs, -1)
    return state, slots.astype(jnp.int32)


def clear_pending(spec: PoolSpec, state: PoolState) -> PoolState:
  """Empties the zero list and the tails once a `zero_blocks` call has consumed them.

  Args:
    spec: the pool spec (static).
    state: the pool state.

  Returns:
    The state with both pending lists padded with -1 and their counts 0.
  """
  if not isinstance(spec, PoolSpec):
    raise ValueError(f"spec must be a PoolSpec, got {type(spec).__name__}")
  with jax.named_scope("jaxkv.clear_pending"):
    zero = jnp.zeros((), jnp.int32)
    return state.replace(
        zero_list=jnp.full_like(state.zero_list, -1),
        num_zero=zero,
        tail_ids=jnp.full_like(state.tail_ids, -1),
        tail_valid=jnp.full_like(state.tail_valid, -1),
        num_tails=zero,
    )
