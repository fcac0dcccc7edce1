"""One CTA of dense MLA decode: its launch's static choices, its part of the
step's tiles (row segments, from the plan's bounds) and the SMEM its three
warpgroups share."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .layout import HEAD_TILE, TILE

# Registers per thread of the producer and of each consumer warpgroup
# (`setmaxnreg`: multiples of 8 in [24, 256], moved inside the launch's 168
# per thread for 384 threads, so 2 * CONSUMER_REGS + PRODUCER_REGS <= 3 * 168
# or the consumers' increase waits forever). The producer only issues TMA
# copies, and every register it gives up eases the consumers' spills (ptxas:
# 272 -> 228 B of spill stores going from 40 / 232 to 24 / 240; 2-3% faster
# at 128 x 64 x 4K, 128 x 128 x 4K and 8 x 64 x 32K on the H200, NOTES.md).
PRODUCER_REGS = 24
CONSUMER_REGS = 240


@dataclasses.dataclass(frozen=True)
class Launch:
  """The launch's static choices (`kernel.build_kernel`'s arguments, resolved)."""

  batch: int
  num_splits: int
  block_size: int
  select: bool
  compiled: bool
  finish_rows: bool
  q_regs: int
  scale_log2: float
  head_groups: int
  tail_heads: int  # real rows of the last head group
  partial_cols: int | None
  whole_pv: bool  # the 128-byte swizzle: each consumer's PV takes the whole P
  fence_all: bool  # every tile's P hand-off fenced toward the async proxy
  tile_regions: bool  # profile regions inside a tile
  pieces: int  # cache block pieces per tile (TMA copies: three per piece)
  piece_slots: int  # slots per piece
  f16_partials: bool  # partials' O in scaled float16

  @property
  def staged_partials(self) -> bool:
    """Float16 partials in whole halves, staged through the segment's last
    stage and stored by TMA (the stage held until the copy has read it);
    with `partial_cols` they go out from registers in column slices."""
    return self.f16_partials and self.partial_cols is None


class Part:
  """This CTA's part of the step's tiles, all rows laid end to end: tiles
  `[beg, end)`, over rows `[row_lo, row_hi)`, for head group `g` (`heads`).

  Every plan value is clipped here: a stale or foreign plan must not walk
  past a row's own blocks, the table or the outputs (a few scalar
  instructions instead of XLA launches per call).
  """

  def __init__(self, launch: Launch, *, table_ref, seq_lens_ref, row_start_ref, part_rows_ref,
               part_start_ref, row_part_ref):
    batch = launch.batch
    self.launch = launch
    self.seq_lens_ref, self.row_start_ref, self.row_part_ref = (
        seq_lens_ref, row_start_ref, row_part_ref)
    self.g = lax.axis_index("g")
    self.part = part = lax.axis_index("p")
    self.max_tokens = table_ref.shape[1] * launch.block_size
    total = row_start_ref[batch]
    self.beg = beg = jnp.clip(part_start_ref[part], 0, total)
    self.end = jnp.clip(part_start_ref[part + 1], beg, total)
    self.row_lo = row_lo = jnp.clip(part_rows_ref[part, 0], 0, batch)
    self.row_hi = jnp.clip(part_rows_ref[part, 1], row_lo, batch)
    self.heads = pl.ds(self.g * HEAD_TILE, HEAD_TILE)

  def seq_len(self, row):
    return jnp.clip(self.seq_lens_ref[row], 0, self.max_tokens)

  def segment(self, row):
    """The row's tiles in this part: (first tile, count, split index, whole).

    `whole`: the segment is split 0 and runs from the row's first tile to
    its last, so it is the row's result (`merge_tiling.kernel_wrote_row` on the
    plan's bounds agrees for every plan that `mla_decode_plan` makes).
    None without `finish_rows`.
    """
    rs = self.row_start_ref[row]
    ntiles = (self.seq_len(row) + TILE - 1) // TILE
    lo = jnp.clip(self.beg - rs, 0, ntiles)
    hi = jnp.clip(self.end - rs, lo, ntiles)
    split = jnp.clip(self.part - self.row_part_ref[row], 0, self.launch.num_splits - 1)
    whole = None
    if self.launch.finish_rows:
      whole = (self.part == self.row_part_ref[row]) & (lo == 0) & (hi == ntiles)
    return lo, hi - lo, split, whole


class Smem(NamedTuple):
  """The CTA's scoped SMEM and barriers (`kernel.build_kernel` allocates them)."""

  q_lat: Any  # [2, 64, 256] bf16: the segment's latent query
  k_lat: Any  # [stages, 2, 64, 256] bf16: the KV ring's latent halves
  k_rope: Any  # [stages, 64, 64] bf16: its RoPE part
  p_smem: Any  # [64, 64] bf16: P of the tile, each consumer's 32 columns for the other
  xchg: Any  # [2, 64] f32: the maxima each consumer hands on (at a segment's end its row sums)
  q_bar: Any  # the query landed
  kv_bar: Any  # [stages]: a stage's copies landed
  free_bar: Any  # [stages]: both consumers are done with a stage
  sync_bar: Any  # the consumers' rendezvous
  q_free_bar: Any  # both consumers are done with the segment's query
  bars: tuple  # `seesaw_barriers()`
  q_rope_smem: Any  # [64, 64] bf16: the RoPE query (compiled: in p_smem)
  p_scratch: Any  # interpreted: `seesaw_p_scratch()`; compiled: None
