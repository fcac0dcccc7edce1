"""The split-KV plan of dense MLA decode: which tiles each CTA reads.

Computed once per decode step from `seq_lens` (inside jit) and reused by every
layer, like FlashMLA's tile-scheduler metadata. The unit is the kernel's tile
of 64 slots (one cache block at block size 64, half of one at 128, two at
32). All rows' tiles are laid end to end and cut into contiguous parts of
equal cost, one CTA per part and head group, so every CTA carries the same
work whatever the mix of lengths. A part's cost counts its tiles and, for each
row segment it runs, a fixed overhead (`MLADecodeConfig.split_overhead_tiles`:
the query load, the pipeline's restart, the partial result's store and its
merge; 4 by default: an H200 profile put a segment at 10.1-13.3k cycles
against 3.5-3.7k a tile, and sweeps of the charge found 2-4 level,
NOTES.md). A part may hold the end of one row, whole rows and the start of
another; a row cut by part boundaries yields one partial result per part
(its splits), merged afterwards by log-sum-exp.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jaxkv._types import BATCH, SeqLens
from jaxkv.kernels._common import num_sms as device_sms

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
      touches. The number of parts is static: `part_rows.shape[0]`.
    part_start: `[num_parts + 1]` int32, non-decreasing: part `p` holds tiles
      `[part_start[p], part_start[p + 1])` of the concatenation (the last
      entry is the step's total).
    row_part: `[batch]` int32: the part that holds each row's first tile; the
      row's split `j` is part `row_part[b] + j`'s share.
  """

  bounds: Int[Array, f"{BATCH} splits_plus_one"]
  row_start: Int[Array, "batch_plus_one"]
  part_rows: Int[Array, "parts 2"]
  part_start: Int[Array, "parts_plus_one"]
  row_part: Int[Array, f"{BATCH}"]

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
    num_sms: int | None = None,
) -> MLADecodePlan:
  """Cuts the step's tiles into parts of equal cost, one CTA of work each.

  Parts: `config.ctas_per_sm * num_sms` CTAs shared by the head groups of 64
  (and never more than `batch * num_splits`, which no plan could fill). Every
  row with tiles costs its tile count plus `config.split_overhead_tiles`
  (counted where the row starts); the rows are laid end to end in that cost
  and cut into equal chunks. A cut inside a row's overhead falls on its first
  tile. The chunk is the total cost over the parts, at least
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
    num_sms: multiprocessors of the device (None: `_common.num_sms()`, the
      first device's).

  Returns:
    The plan.
  """
  if block_size not in BLOCK_SIZES:
    raise ValueError(f"{block_size=} must be one of {BLOCK_SIZES}")
  batch = seq_lens.shape[0]
  if seq_lens.ndim != 1 or batch == 0:
    raise ValueError(
        f"{seq_lens.shape=} must be [batch] with batch >= 1 (a step without decode rows"
        " needs no plan: mla_decode of batch 0 returns empty results)")
  if num_sms is None:
    num_sms = device_sms()
  if config is None:
    config = default_config(batch=batch, num_heads=num_heads, num_sms=num_sms)
  head_groups = -(-num_heads // 64)
  parts = max(1, min(config.ctas_per_sm * num_sms // head_groups, batch * config.num_splits))
  return _plan(seq_lens, parts=parts, splits=config.num_splits,
               overhead_tiles=config.split_overhead_tiles,
               min_chunk_blocks=config.min_chunk_blocks)


# One XLA program (one dispatch, one compile per shape) where a caller runs the
# plan outside jit, instead of ~40 ops each dispatched and compiled on its own.
@functools.partial(jax.jit, static_argnames=("parts", "splits", "overhead_tiles",
                                             "min_chunk_blocks"))
def _plan(seq_lens, *, parts: int, splits: int, overhead_tiles: int,
          min_chunk_blocks: int) -> MLADecodePlan:
  """`mla_decode_plan`'s arrays: `parts` parts, rows cut into at most `splits`."""
  batch = seq_lens.shape[0]
  with jax.named_scope("jaxkv.mla_decode_plan"):
    ntiles = (jnp.maximum(seq_lens, 0) + TILE - 1) // TILE
    ends = jnp.cumsum(ntiles).astype(jnp.int32)
    starts = ends - ntiles
    total = ends[-1]
    over = overhead_tiles * (ntiles > 0).astype(jnp.int32)
    cost_ends = jnp.cumsum(ntiles + over).astype(jnp.int32)
    tiles_from = cost_ends - ntiles  # where each row's tiles start in cost
    cost_total = cost_ends[-1]
    if splits == 1:
      chunk = jnp.maximum(cost_total, 1)
    else:
      # A row's tiles span at most ceil((n - 1) / chunk) + 1 parts.
      chunk = jnp.maximum(
          jnp.maximum((cost_total + parts - 1) // parts, min_chunk_blocks),
          (jnp.max(ntiles) + splits - 2) // (splits - 1),
      )
    # Part p starts at cost p * chunk: in the row r whose cost range holds
    # it, at the tile that far past r's overhead (its first tile if inside).
    cut = jnp.minimum(jnp.arange(parts + 1, dtype=jnp.int32) * chunk, cost_total)
    r = jnp.minimum(jnp.sum(cost_ends[None, :] <= cut[:, None], axis=1), batch - 1)
    in_row = jnp.clip(cut - tiles_from[r], 0, ntiles[r])
    part_start = jnp.where(cut >= cost_total, total, starts[r] + in_row).astype(jnp.int32)
    # The part holding a row's first tile: the last one starting at or before it.
    row_part = jnp.sum(part_start[None, :parts] <= starts[:, None], axis=1) - 1
    row_part = jnp.maximum(row_part, 0).astype(jnp.int32)
    # Split j of row b is its share of part row_part[b] + j.
    j = jnp.arange(splits + 1, dtype=jnp.int32)[None, :]
    edge = part_start[jnp.minimum(row_part[:, None] + j, parts)]
    bounds = jnp.clip(edge - starts[:, None], 0, ntiles[:, None])
    # Rows touching part p: those ending after its start and starting before
    # its end (empty rows inside are skipped by the kernel).
    lo = jnp.sum(ends[None, :] <= part_start[:parts, None], axis=1)
    hi = jnp.sum(starts[None, :] < part_start[1:, None], axis=1)
    part_rows = jnp.stack([lo, jnp.maximum(hi, lo)], axis=1).astype(jnp.int32)
    row_start = jnp.concatenate([starts, total[None]]).astype(jnp.int32)
    return MLADecodePlan(
        bounds.astype(jnp.int32), row_start, part_rows, part_start, row_part
    )
