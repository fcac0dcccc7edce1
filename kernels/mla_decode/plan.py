"""The split-KV plan of dense MLA decode: which blocks each (row, split) CTA reads.

Computed once per decode step from `seq_lens` (inside jit) and reused by every
layer, like FlashMLA's tile-scheduler metadata.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jaxkv._types import BATCH, SeqLens

from .config import MLADecodeConfig, default_config


class MLADecodePlan(NamedTuple):
  """Block boundaries of every split.

  Attributes:
    bounds: `[batch, num_splits + 1]` int32, non-decreasing per row, from 0 to
      the row's block count `ceil(seq_len / block_size)`: split `j` of row `b`
      reads the row's blocks `[bounds[b, j], bounds[b, j + 1])` (none when
      equal). The number of splits is static: `bounds.shape[1] - 1`.
  """

  bounds: Int[Array, f"{BATCH} splits_plus_one"]

  @property
  def num_splits(self) -> int:
    return self.bounds.shape[1] - 1


def mla_decode_plan(
    seq_lens: SeqLens,
    *,
    num_heads: int,
    block_size: int = 64,
    config: MLADecodeConfig | None = None,
    num_sms: int = 132,
) -> MLADecodePlan:
  """Splits every row's blocks so that the grid's CTAs carry similar work.

  The chunk (blocks per split) is the same for every row: the total work of
  the step divided over `config.ctas_per_sm * num_sms` CTAs, at least
  `config.min_chunk_blocks`, and large enough that no row needs more than
  `config.num_splits` splits. Short rows get fewer (possibly one) non-empty
  splits; a row with `seq_len == 0` gets none.

  Args:
    seq_lens: `[batch]` int32 (may be traced).
    num_heads: query heads (sets the head groups of 64 per row).
    block_size: slots per cache block.
    config: tuning config; the heuristic default for this batch and heads
      when None.
    num_sms: multiprocessors of the device.

  Returns:
    The plan.
  """
  batch = seq_lens.shape[0]
  if config is None:
    config = default_config(batch=batch, num_heads=num_heads)
  with jax.named_scope("jaxkv.mla_decode_plan"):
    head_groups = -(-num_heads // 64)
    splits = config.num_splits
    nblk = (jnp.maximum(seq_lens, 0) + block_size - 1) // block_size
    total = jnp.sum(nblk) * head_groups
    ctas = config.ctas_per_sm * num_sms
    chunk = jnp.maximum((total + ctas - 1) // ctas, config.min_chunk_blocks)
    chunk_b = jnp.maximum(chunk, (nblk + splits - 1) // splits)  # [batch]
    j = jnp.arange(splits + 1, dtype=jnp.int32)[None, :]
    bounds = jnp.minimum(j * chunk_b[:, None], nblk[:, None])
    return MLADecodePlan(bounds.astype(jnp.int32))
