"""Slot mappings derived from block tables, with the null block mapped to -1 (rule 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ._types import BATCH, MAX_BLOCKS


def slots_from_block_table(
    block_table: Int[Array, f"{BATCH} {MAX_BLOCKS}"],
    positions: Int[Array, f"{BATCH}"],
    block_size: int,
    *,
    skip_null_block: bool = True,
) -> Int[Array, f"{BATCH}"]:
  """The global slot of token `positions[b]` of each row, read through its block table.

  A component that derives its write slots this way (a compressor's ring
  buffer, a draft model's cache) sees an all-zero table on a padded or dummy
  row and would write into block 0, the null block every padded read points
  at. With `skip_null_block` (the default) such slots, and negative or
  out-of-table positions, map to -1, which every cache write skips.

  Args:
    block_table: `[batch, max_blocks]` int32, padded with 0.
    positions: `[batch]` int32 token positions.
    block_size: slots per block.
    skip_null_block: map slots of block 0 to -1.

  Returns:
    `[batch]` int32 slots `block * block_size + position % block_size`, or -1.
  """
  if block_size <= 0:
    raise ValueError(f"{block_size=} must be positive")
  with jax.named_scope("jaxkv.slots_from_block_table"):
    max_blocks = block_table.shape[1]
    index = positions // block_size
    inside = (positions >= 0) & (index < max_blocks)
    block = jnp.take_along_axis(block_table, jnp.clip(index, 0, max_blocks - 1)[:, None], axis=1)[:, 0]
    slot = block * block_size + positions % block_size
    keep = inside & (block > 0) if skip_null_block else inside
    return jnp.where(keep, slot, -1).astype(jnp.int32)
