"""The merge's tiling: channels and splits in flight per CTA, which rows take
the grouped pass, and the split bounds its kernels read.

Shared by the per-split ring (`merge.build_merge`), the stacked rows of few
heads (`packed_merge.build_packed_merge`) and the wrapper that picks between
them; the measurements behind each figure are in NOTES.md.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .layout import HEAD_TILE

# Value channels per CTA and at most this many splits in flight per CTA (16 KB
# each; no more than a plan's splits per row), for rows of few splits;
# `merge_tiling` halves the channels (twice the CTAs) and doubles the ring
# for rows of many.
COLS = 64
STAGES = 4
# Beyond this many splits per row the wrapper merges in two passes: chunks of
# CHUNK splits first (a CTA per chunk too), then the chunks' results. One
# CTA per row walking 52-67 splits lost to XLA's fused merge on the H200 even
# with 16 splits in flight (1 x 128 x 128K: 0.097 ms vs 0.093); two passes
# beat it (0.091; NOTES.md, "Two passes for rows of many splits").
MAX_SPLITS = 32
CHUNK = 8
# The grouped one-pass merge: splits per TMA copy, the SMEM its ring of value
# tiles may take, and the CTAs it aims for (about one per SM).
GROUP = 8
GROUP_SMEM = 160 * 1024
GROUP_CTAS = 128
# At most this many splits (the row's LSE, splits x 64 floats, sits beside the
# ring's GROUP_SMEM). Measured on the H200 up to 101 splits on the default
# path; 133 (1 x 64 x 128K, forced, 64 CTAs) was slower than the two passes.
GROUP_MAX_SPLITS = 128
# Rows of this many splits up to MAX_SPLITS (which the per-split ring takes in
# one pass) take the grouped merge too, at 8 channels per CTA, where a row has
# one head group: 8 x 64 x 32K (27 splits) on the H200, end to end, two runs:
# 0.971 / 0.975 of the ring's time (NOTES.md).
GROUP_NARROW_MIN = 17
# The grouped merge in halves (`build_merge(halves=True)`: a cluster of two
# CTAs per tile, each over half of the row's groups; the default for rows of
# more than `GROUP_MAX_SPLITS` splits, which the whole pass cannot take: at 1 x
# 64 x 128K (133 splits) 0.943-0.959 of the two passes' time on an H100, the
# two passes 1.054 of its time on the H200, NOTES.md). Each CTA's ring takes
# at most this much SMEM where the grid is past one wave, so that two CTAs
# fit an SM beside their LSE.
HALVES_SMEM = 72 * 1024


def can_group(num_splits: int, halves: bool = False) -> bool:
  """Whether the grouped merge (`build_merge(group=True)`) can take rows of
  `num_splits` splits at all: more than one copy's `GROUP`, at most
  `GROUP_MAX_SPLITS` (twice that in `halves`, each CTA of a pair over half of
  them). Where it should is `use_grouped`."""
  return GROUP < num_splits <= GROUP_MAX_SPLITS * (2 if halves else 1)


def merge_tiling(num_splits: int) -> tuple[int, int]:
  """(value channels per CTA, splits in flight per CTA) for rows of up to
  `num_splits` splits. Measured on the H200 (end to end, same run): at 8 x 64
  x 32K (27 splits) (32, 8) took 0.0998 ms against 0.1025 with (64, 4) (that
  shape now takes the grouped pass, `use_grouped`). At
  batch 128 (3 splits) the ring holds a row's splits at once, and no deeper:
  slots no row fills only keep CTAs off the SM (merge alone, same run: 12.8
  -> 11.6 µs at 128 x 64 x 4K, 15.5 -> 14.9 at 128 x 128 x 4K with 3 slots
  instead of 4; NOTES.md)."""
  if num_splits <= 8:
    return COLS, min(STAGES, num_splits)
  return COLS // 2, 2 * STAGES


def grouped_tiling(*, batch: int, head_groups: int, num_splits: int,
                   cols: int | None = None, f16: bool = False,
                   halves: bool = False) -> tuple[int, int]:
  """(value channels per CTA, groups in flight per CTA) of the grouped merge.

  The channels shrink (down to 8, the narrowest wgmma-layout tile) until the
  grid has about `GROUP_CTAS` CTAs, so batch 1 still spreads over the SMs;
  the ring holds as many `GROUP`-split groups as `GROUP_SMEM` allows (all of
  a row's at 1 x 128 x 128K: 9 groups of 16 KB). A grid of fewer CTAs
  (1 x 64 heads, one CTA per tile) is slower than the two passes even with
  bulk copies; past `GROUP_MAX_SPLITS` splits (1 x 64 x 128K, 133) the
  wrapper takes the pass in halves instead (`halves`). Rows the per-split
  ring could take in one pass (at most `MAX_SPLITS` splits) take 8 channels
  whatever the grid: at 8 x 64 x 32K (27 splits) 8 channels (512 CTAs) ran
  0.975 of 32 (128 CTAs, two of four groups in flight) on the H200.
  `f16`: float16 partials (half the bytes a group; their scales, a float32
  per split and row, take SMEM beside the LSE). `halves`: a cluster of two
  CTAs per tile, each over half of the groups (twice the grid; each ring at
  most `HALVES_SMEM` where the grid is past `GROUP_CTAS`)."""
  grid = lambda cols: batch * head_groups * (512 // cols) * (2 if halves else 1)  # CTAs
  if cols is None:
    cols = 8 if num_splits <= MAX_SPLITS else 64
    while cols > 8 and grid(cols) < GROUP_CTAS:
      cols //= 2
  groups = -(-num_splits // GROUP)
  if halves:
    groups = -(-groups // 2)  # the first CTA's share, the larger
  per_group = GROUP * HEAD_TILE * cols * (2 if f16 else 4)
  ring = GROUP_SMEM - (num_splits * HEAD_TILE * 4 if f16 else 0)
  if halves and grid(cols) > GROUP_CTAS:
    ring = min(ring, HALVES_SMEM)  # past a wave: two CTAs an SM
  return cols, max(1, min(groups, ring // per_group))


def use_grouped(*, batch: int, head_groups: int, num_splits: int) -> bool:
  """Whether rows of `num_splits` splits take the grouped merge: past
  `MAX_SPLITS` (where the per-split ring needs two passes), up to
  `GROUP_MAX_SPLITS`, and where its grid reaches `GROUP_CTAS` with 8 or 16
  channels per CTA (wider tiles, at batch 4 x 128 heads and up, were not
  measured with rows this long). Measured on the H200 (merge alone, same
  run, against the per-split ring, partials in `wide_partials`' layout):
  1 x 128 x 128K (67 splits, 8 channels per CTA) 6.2 µs against 10.2,
  4 x 64 x 128K and 2 x 128 x 64K (52, 16 / 8 channels) 7.0 / 6.9 against
  11.5 / 11.5, 2 x 64 x 64K (101, 8 channels) 9.1 against 10.6; but
  1 x 64 x 128K (133 splits, 64 CTAs of 8 channels, forced) 15.7 against
  10.7. Rows of `GROUP_NARROW_MIN` to `MAX_SPLITS` splits, which the ring
  takes in one pass, take it at 8 channels where a row has one head group
  and the grid reaches `GROUP_CTAS` (end to end, two runs: 8 x 64 x 32K
  0.971 / 0.975 of the ring, 8 x 64 x 64K 0.988); at 8 x 128 x 16K (15
  splits, two head groups) it was even (1.002) and stays on the ring
  (NOTES.md)."""
  if not GROUP_NARROW_MIN <= num_splits <= GROUP_MAX_SPLITS:
    return False
  cols, _ = grouped_tiling(batch=batch, head_groups=head_groups, num_splits=num_splits)
  fills_grid = batch * head_groups * (512 // cols) >= GROUP_CTAS
  if num_splits <= MAX_SPLITS:  # 8 channels (grouped_tiling)
    return head_groups == 1 and fills_grid
  return cols <= 16 and fills_grid


def group_box_start(k, num_splits: int):
  """The first split slot of group `k`'s copy: `k * GROUP`, except that the
  last group's box ends at the last slot (it overlaps the group before it
  rather than running past the array). `k` a Python int (the copies issued
  before the loop) or a traced int32 (the loop's)."""
  if isinstance(k, int):
    return min(k * GROUP, num_splits - GROUP)
  return jnp.minimum(k * GROUP, num_splits - GROUP)


def wide_partials(o, lse, cols: int):
  """The decode kernel's partials, o `[batch, splits, heads_padded, dv]` and
  lse `[batch, splits, heads_padded]`, as the grouped merge reads them
  (`build_kernel(partial_cols=cols)` stores them so): o `[batch, dv / cols,
  heads_padded / 64, splits, 64, cols]` and lse `[batch, heads_padded / 64,
  splits, 64]`. One merge CTA (a row, a head group, `cols` channels) then
  finds its row's splits in one contiguous run of each, and every copy is a
  bulk copy (the LSE's one, and `GROUP * 64 * cols` floats per group)
  instead of a TMA box of 64-row tiles of `cols * 4` bytes (the narrow rows
  that held the grouped merge to ~15-17 GB/s per CTA on the H200; NOTES.md)."""
  batch, splits, heads, dv = o.shape
  groups = heads // HEAD_TILE
  o = o.reshape(batch, splits, groups, HEAD_TILE, dv // cols, cols).transpose(0, 4, 2, 1, 3, 5)
  return o, lse.reshape(batch, splits, groups, HEAD_TILE).transpose(0, 2, 1, 3)


def chunk_edges(num_splits: int, chunk: int) -> np.ndarray:
  """Where the first merge pass cuts a row's splits: split 0 alone, then
  chunks of `chunk`. Split 0 alone keeps the second pass's first two bounds
  equal to the plan's, so `kernel_wrote_row` answers the same on them."""
  starts = np.arange(1, num_splits + chunk, chunk)  # at most one at or past the end
  return np.concatenate([[0], np.minimum(starts, num_splits)]).astype(np.int32)


def chunk_edge(k, chunk: int, num_splits: int):
  """`chunk_edges(num_splits, chunk)[k]` for a traced `k` (in the merge kernel)."""
  return jnp.where(k == 0, 0, jnp.minimum(1 + (k - 1) * chunk, num_splits))


def live_splits(bound, span: int):
  """How many of a row's `span` splits are non-empty (`bound(j)`: the row's
  clipped bound j). Unrolled: each bound is a scalar load from GMEM, and in a
  loop each load waited for the one before it (the grouped merge of a
  67-split row on the H200: 10.0 -> 8.1 µs unrolled; NOTES.md)."""
  bounds = [bound(j) for j in range(span + 1)]
  return sum((hi > lo).astype(jnp.int32) for lo, hi in zip(bounds, bounds[1:]))


def kernel_wrote_row(ntiles, first, second):
  """Whether the decode kernel wrote a row's result itself: the row has tiles
  and its split 0 covers all of them (`first`, `second`: the plan's bounds 0
  and 1 clipped to `[0, ntiles]`). The decode kernel's test (its segment is
  split 0 and runs from tile 0 to the last) gives the same answer on every
  plan that `mla_decode_plan` makes, for these lengths or others."""
  return (ntiles > 0) & (first == 0) & (second == ntiles)
