"""The split-KV plan of dense MLA decode: which tiles each CTA reads.

Computed once per decode step from `seq_lens` (inside jit) and reused by every
layer, like FlashMLA's tile-scheduler metadata. The unit is the kernel's tile
of 64 slots (one cache block at block size 64, half of one at 128, two at
32). All rows' tiles are laid end to end and cut into equal contiguous parts,
one CTA per part and head group, so every CTA carries the same number of
tiles whatever the mix of lengths.
A part may hold the end of one row, whole rows and the start of another; a
row cut by part boundaries yields one partial result per part (its splits),
merged afterwards by log-sum-exp.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jaxkv._types import BATCH, SeqLens

from .config import MLADecodeConfig, default_config
from .kernel import BLOCK_SIZES, TILE


class MLADecodePlan(NamedTuple):
  """The work of every CTA and the splits of every row.

  Attributes:
    bounds: `[batch, num_splits + 1]` int32, non-decreasing per row, from 0 to
      the row's tile count `ceil(seq_len / 64)`: split `j` of row `b`
      covers the row's tiles `[bounds[b, j], bounds[b, j + 1])` (none when
      equal; an empty split has no partial result). The maximum number of
      splits of a row is static: `bounds.shape[1] - 1`.
    row_start: `[batch + 1]` int32: where each row's tiles start when all
      rows are laid end to end (the last entry is the step's total).
    part_rows: `[num_parts, 2]` int32: the rows `[first, end)` that part `p`
      (tiles `[p * chunk, (p + 1) * chunk)` of the concatenation) touches.
      The number of parts is static: `part_rows.shape[0]`.
    chunk: `[1]` int32: tiles per part.
  """

  bounds: Int[Array, f"{BATCH} splits_plus_one"]
  row_start: Int[Array, "batch_plus_one"]
  part_rows: Int[Array, "parts 2"]
  chunk: Int[Array, "1"]

  @property
  def num_splits(self) -> int:
    return self.bounds.shape[1] - 1

  @property
  def num_parts(self) -> int:
    return self.part_rows.shape[0]


def mla_decode_plan(
    seq_lens: SeqLens,
    *,
    num_heads: int,
    block_size: int = 64,
    config: MLADecodeConfig | None = None,
    num_sms: int = 132,
) -> MLADecodePlan:
  """Cuts the step's tiles into equal parts, one CTA of work each.

  Parts: `config.ctas_per_sm * num_sms` CTAs shared by the head groups of 64
  (and never more than `batch * num_splits`, which no plan could fill). The
  chunk (tiles per part) is the step's total over the parts, at least
  `config.min_chunk_blocks`, and large enough that no row is cut into more
  than `config.num_splits` splits; with `num_splits == 1` no row is cut at
  all (one part holds every row). A row with `seq_len == 0` has no split.

  Args:
    seq_lens: `[batch]` int32 (may be traced).
    num_heads: query heads (sets the head groups of 64 per row).
    block_size: slots per cache block (one of 32, 64, 128); the plan counts
      64-slot tiles whatever it is, so one plan serves caches of any of them.
    config: tuning config; the tuned or heuristic default for this batch and
      heads when None.
    num_sms: multiprocessors of the device.

  Returns:
    The plan.
  """
  if block_size not in BLOCK_SIZES:
    raise ValueError(f"{block_size=} must be one of {BLOCK_SIZES}")
  batch = seq_lens.shape[0]
  if config is None:
    config = default_config(batch=batch, num_heads=num_heads)
  with jax.named_scope("jaxkv.mla_decode_plan"):
    head_groups = -(-num_heads // 64)
    splits = config.num_splits
    parts = max(1, min(config.ctas_per_sm * num_sms // head_groups, batch * splits))
    ntiles = (jnp.maximum(seq_lens, 0) + TILE - 1) // TILE
    ends = jnp.cumsum(ntiles).astype(jnp.int32)
    starts = ends - ntiles
    total = ends[-1]
    if splits == 1:
      chunk = jnp.maximum(total, 1)
    else:
      chunk = jnp.maximum(
          jnp.maximum((total + parts - 1) // parts, config.min_chunk_blocks),
          (jnp.max(ntiles) + splits - 2) // (splits - 1),
      )
    # Split j of row b is its share of part (starts[b] // chunk + j).
    j = jnp.arange(splits + 1, dtype=jnp.int32)[None, :]
    first = (starts // chunk)[:, None]
    bounds = jnp.clip((first + j) * chunk - starts[:, None], 0, ntiles[:, None])
    # Rows touching part p: those ending after its start and starting before
    # its end (empty rows inside are skipped by the kernel).
    p = jnp.arange(parts, dtype=jnp.int32)[:, None]
    lo = jnp.sum(ends[None, :] <= p * chunk, axis=1)
    hi = jnp.sum(starts[None, :] < jnp.minimum((p + 1) * chunk, total), axis=1)
    part_rows = jnp.stack([lo, jnp.maximum(hi, lo)], axis=1).astype(jnp.int32)
    row_start = jnp.concatenate([starts, total[None]]).astype(jnp.int32)
    return MLADecodePlan(
        bounds.astype(jnp.int32), row_start, part_rows,
        jnp.reshape(chunk, (1,)).astype(jnp.int32),
    )
