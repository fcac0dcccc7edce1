"""One CTA of sparse MLA decode: its launch's static choices, its share of the
batch (a row's split, a piece of a cut row, or a run of the stream schedule)
and the SMEM its three warpgroups share."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkv.kernels.mla_decode.layout import HEAD_TILE, NUM_STAGES
from jaxkv.kernels.sparse_mla_decode.config import TILE
from jaxkv.kernels.sparse_mla_decode.stream import Stream

IDX_STAGES = 4  # tiles of slot ids in flight ahead of their gathers
# setmaxnreg only moves registers inside the launch allocation (168 per
# thread for 384 threads): 2 * CONSUMER_REGS + PRODUCER_REGS <= 3 * 168, or
# the consumers' increase waits forever.
PRODUCER_REGS = 40
CONSUMER_REGS = 232


@dataclasses.dataclass(frozen=True)
class Launch:
  """The launch's static choices (`kernel.build_kernel`'s arguments, resolved)."""

  batch: int
  num_tiles: int  # a split's tiles of 64 indices
  num_splits: int
  select: bool
  compiled: bool
  q_regs: int
  kv_swizzle: int  # the query's and KV ring's swizzle: 128 takes `seesaw_pv_whole`
  scale_log2: float
  out_dtype: Any
  head_groups: int
  tail_heads: int  # real rows of the last head group
  cut_rows: int
  pieces: int
  cluster_merge: bool
  cluster_size: int
  parts: int
  stream_whole: int  # the stream: whole rows per part, before its leftover run
  stream_segment: int  # the stream: a row segment's cost in tiles (its leftover runs' cut)
  stage_out: bool  # the kernel's own result of a whole row, staged
  stage_merged: bool  # a cluster's merged result, staged
  f16_partials: bool  # partials for the merge after the kernel: float16, staged
  tile_regions: bool = False  # profile regions inside a tile (`kernel.REGIONS`)

  @property
  def direct(self) -> bool:
    """One split: the kernel writes the result (no merge of splits)."""
    return self.num_splits == 1

  @property
  def whole_pv(self) -> bool:
    """Each consumer's PV takes a tile's whole P (the 128-byte swizzle)."""
    return self.kv_swizzle == 128

  @property
  def stream(self) -> Stream:
    """The stream schedule (with `parts`)."""
    return Stream(self.batch, self.num_tiles, self.parts, self.stream_whole,
                  self.stream_segment)

  @property
  def last_stage(self) -> int:
    """The stage of a whole split's last tile."""
    return (self.num_tiles - 1) % NUM_STAGES


class Cta(NamedTuple):
  """This CTA's share of the launch (traced values from the grid indices)."""

  g: jax.Array  # head group
  split: jax.Array
  b: jax.Array  # the row (or with the stream, the part)
  heads: Any  # `pl.ds` of the head group's 64 rows
  num_slots: int  # the cache's slots: ids outside `[0, num_slots)` are masked
  tok0: Any  # the first index of the CTA's tiles in its row
  n_tiles: Any  # the CTA's tiles (static, but with cut rows)
  n_steps: Any  # the CTA's tiles over all its segments
  whole: Any  # a whole row (cut rows: not a piece)
  piece: Any  # cut rows: the piece of the row
  part: Any  # cut rows: the cut row's index among the cut rows
  runs: Any  # the stream: the part's runs of tiles, ((beg, end), (beg, end))

  def inside(self, ids):
    """Valid: an id of a cache slot; -1 and the rest are masked."""
    return (ids >= 0) & (ids < self.num_slots)


def cta_work(launch: Launch, num_slots: int) -> Cta:
  """This CTA's share, from its grid indices ("b", "s", "g"; with
  `cluster_merge`, "s" is the cluster's axis)."""
  num_tiles, cut_rows, pieces = launch.num_tiles, launch.cut_rows, launch.pieces
  whole_rows = launch.batch - cut_rows
  g = lax.axis_index("g")
  split = lax.axis_index("s")
  b = lax.axis_index("b")
  heads = pl.ds(g * HEAD_TILE, HEAD_TILE)
  tok0 = split * (num_tiles * TILE)
  n_tiles = num_tiles  # this CTA's tiles: static, except with cut_rows
  whole = True
  piece = part = runs = None
  if cut_rows and launch.cluster_merge:
    # Cluster b < whole_rows / 2: rows 2b and 2b + 1 whole, a CTA each; then
    # one cluster per cut row, its halves.
    pairs = whole_rows // 2
    whole = b < pairs
    piece = split
    part = jnp.maximum(b - pairs, 0)  # the cut row's index among the cut rows
    b = jnp.where(whole, 2 * b + split, whole_rows + part)
  elif cut_rows:
    # CTA b < whole_rows: row b whole; then `pieces` CTAs per cut row.
    cut = b - whole_rows
    whole = cut < 0
    cut = jnp.maximum(cut, 0)
    piece = lax.rem(cut, pieces)
    part = cut // pieces  # the cut row's index among the cut rows
    b = jnp.where(whole, b, whole_rows + part)
  if cut_rows:
    first = piece * num_tiles // pieces
    tok0 = jnp.where(whole, 0, first * TILE)
    n_tiles = jnp.where(whole, num_tiles, (piece + 1) * num_tiles // pieces - first)
  n_steps = n_tiles  # the CTA's tiles, all segments
  if launch.parts:
    # Part b's whole rows and leftover run (`stream.py`).
    runs = launch.stream.runs(b)
    n_steps = sum(end - beg for beg, end in runs)
  return Cta(g=g, split=split, b=b, heads=heads, num_slots=num_slots, tok0=tok0,
             n_tiles=n_tiles, n_steps=n_steps, whole=whole, piece=piece, part=part, runs=runs)


def locate(launch: Launch, cta: Cta, j):
  """The CTA's tile j: its row and the tile's first index in the row."""
  if launch.parts:
    (a_beg, a_end), (b_beg, _) = cta.runs
    t = jnp.where(j < a_end - a_beg, a_beg + j, b_beg + j - (a_end - a_beg))
    return t // launch.num_tiles, lax.rem(t, launch.num_tiles) * TILE
  return cta.b, cta.tok0 + j * TILE


class Smem(NamedTuple):
  """The CTA's scoped SMEM and barriers (`kernel.build_kernel` allocates them)."""

  q_lat: Any  # [2, 64, 256] bf16: the latent query
  k_lat: Any  # [stages, 2, 64, 256] bf16: the KV ring's latent halves
  k_rope: Any  # [stages, 64, 64] bf16: its RoPE part
  p_smem: Any  # [64, 64] bf16: P of the tile, each consumer's 32 columns for the other
  xchg: Any  # [2, 64] f32: the maxima each consumer hands on (at the end its row sums)
  ids: Any  # [IDX_STAGES, 64] int32: the producer's ring of slot ids
  stage_idx: Any  # [stages, 64] int32: each stage's indices (invalid: masked)
  q_bar: Any  # the query landed
  idx_bar: Any  # [IDX_STAGES]: a tile's ids landed
  free_bar: Any  # [stages]: both consumers are done with a stage
  sync_bar: Any  # the consumers' rendezvous
  q_free_bar: Any  # both consumers are done with the query
  bars: tuple  # `seesaw_barriers()`
  landed: Any  # compiled: [stages, 2] int32, one mbarrier per stage (its copies landed)
  scratch: Any  # compiled "multiply": [4] int32 (`gather.null_first_invalid`)
  q_rope_smem: Any  # [64, 64] bf16: the RoPE query (compiled: in p_smem)
  ready_bar: Any  # interpreted: [stages], a stage's copies landed
  p_scratch: Any  # interpreted: `seesaw_p_scratch()`
  lse_stage: Any  # [64] f32: a short last head group's LSE, staged (or None)
  merge_stage: Any  # [2, 64, 512 / cluster_size] bf16: a cluster's merged result, staged
  cluster_bar: Any  # interpreted `cluster_merge`: the cluster's barrier
