"""Merge of a row's split results as a Mosaic GPU kernel that reads only live splits.

`combine_splits` (plain jnp) is its specification. XLA's fusion of it reads
every split slot of every row, written or not; with the balanced plan most
rows use fewer slots than the plan reserves, and those reads cost as much as
the live ones. Here one CTA per (row, head group, 64 value channels) loops
over the row's live splits only: each split's [64, 64] float32 tile and its
LSE come in by TMA through a ring of `STAGES` buffers (that many splits in
flight, so a row of many splits streams instead of waiting out one load per
split), and the merged tile is stored in the output dtype: a 16-bit one
through SMEM by one TMA copy (`build_merge(stage_out=)`, the default of
`_mla_decode`), which took 1.8-3.4 µs off the merge at batch 128 on the H200
against stores from registers.

Rows of more than `MAX_SPLITS` splits take two passes: the first merges
chunks of a row's splits (split 0 alone, then `CHUNK` at a time), a CTA per
chunk, into float32 results; the second merges those as the row's splits.

Where `use_grouped` says so (rows of more than `MAX_SPLITS` splits at batch
1-4, and of `GROUP_NARROW_MIN` to `MAX_SPLITS` splits with one head group),
one pass merges them instead with the splits grouped
(`build_merge(group=True)`): each copy brings `GROUP` splits of a CTA's
tile at once, so a CTA holds all of a row's splits in a handful of copies;
the row's LSE comes first and its maximum is taken before any value tile is
read, so the splits' weighted sum is a chain of FMAs rather than one
online-softmax step per split. The decode kernel then stores its partials
in this merge's layout (`wide_partials`: a CTA's splits contiguous), so
that every copy is a bulk copy rather than a TMA box of narrow rows.

Rows of 8-32 heads (one head group, mostly padding) take `build_packed_merge`
instead of the per-split ring: `64 // heads` rows of the batch per CTA, their
heads stacked in the rows of one tile, so that each CTA's ring is all real
rows and the grid a quarter (at 16 heads) of the ring's: one wave at batch
128 where the ring took about three (2.3-2.6 µs less on the H200).

With `finish_rows` (the decode kernel's), the merge writes into the decode
kernel's output in place (a Pallas state discharge aliases it): rows the
decode kernel finished itself (one split covering the whole row,
`kernel_wrote_row`) are neither read nor written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .layout import (
    HEAD_TILE,
    LOG2E,
    TILE,
    by_head_group,
    last_group_rows,
    stage_store,
)
from .seesaw import softmax_finish, softmax_start

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


def can_group(num_splits: int) -> bool:
  """Whether the grouped merge (`build_merge(group=True)`) can take rows of
  `num_splits` splits at all: more than one copy's `GROUP`, at most
  `GROUP_MAX_SPLITS`. Where it should is `use_grouped`."""
  return GROUP < num_splits <= GROUP_MAX_SPLITS


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
                   cols: int | None = None) -> tuple[int, int]:
  """(value channels per CTA, groups in flight per CTA) of the grouped merge.

  The channels shrink (down to 8, the narrowest wgmma-layout tile) until the
  grid has about `GROUP_CTAS` CTAs, so batch 1 still spreads over the SMs;
  the ring holds as many `GROUP`-split groups as `GROUP_SMEM` allows (all of
  a row's at 1 x 128 x 128K: 9 groups of 16 KB). A grid of fewer CTAs
  (1 x 64 heads) is slower than the two passes even with bulk copies, which
  is why `use_grouped` keeps it on the per-split ring. Rows the per-split
  ring could take in one pass (at most `MAX_SPLITS` splits) take 8 channels
  whatever the grid: at 8 x 64 x 32K (27 splits) 8 channels (512 CTAs) ran
  0.975 of 32 (128 CTAs, two of four groups in flight) on the H200."""
  if cols is None:
    cols = 8 if num_splits <= MAX_SPLITS else 64
    while cols > 8 and batch * head_groups * (512 // cols) < GROUP_CTAS:
      cols //= 2
  groups = -(-num_splits // GROUP)
  per_group = GROUP * HEAD_TILE * cols * 4
  return cols, max(1, min(groups, GROUP_SMEM // per_group))


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


def group_box_start(k: int, num_splits: int) -> int:
  """The first split slot of group `k`'s copy: `k * GROUP`, except that the
  last group's box ends at the last slot (it overlaps the group before it
  rather than running past the array)."""
  return min(k * GROUP, num_splits - GROUP)


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


def ring_step(j, carry, *, bar, lse_buf, o_buf, stages: int, n, fetch, live_rows=None):
  """Split j of the per-split ring's online merge: waits for its slot (`j %
  stages` of `o_buf` `[stages, 64, cols]` and `lse_buf` `[stages, 64]` f32,
  landing on `bar`), refills the slot with split `j + stages` if it is below
  `n` (`fetch`), and folds split j into `carry` = `(acc, m, l)` (m in log2
  units). `live_rows(j)`, where given, is a row-layout mask of the tile rows
  whose split j is live (`build_packed_merge`); the others are selected away,
  and a row without a live split so far keeps weight 0. None: every row's
  split j is live (`build_merge`)."""
  acc, m, l = carry
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  slot = lax.rem(j, stages)
  plgpu.barrier_wait(bar.at[slot])
  lse_j = plgpu.load(lse_buf.at[slot], layout=row_layout, optimized=False) * LOG2E
  o_j = plgpu.load(o_buf.at[slot], layout=plgpu.Layout.WGMMA, optimized=False)
  # The slot is refilled at once: every thread's reads are ordered before
  # the copy (Pallas's warpgroup barrier ahead of a TMA issue).
  plgpu.commit_smem()
  pl.when(j + stages < n)(lambda: fetch(j + stages))
  if live_rows is None:
    m_new = m_ref = jnp.maximum(m, lse_j)
  else:
    live = live_rows(j)
    lse_j = jnp.where(live, lse_j, -jnp.inf)
    o_j = jnp.where(lax.broadcast_in_dim(live, o_j.shape, [0]), o_j, 0.0)
    m_new = jnp.maximum(m, lse_j)
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no live split yet: weights 0
  alpha = jnp.exp2(m - m_ref)
  w = jnp.exp2(lse_j - m_ref)
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + o_j * lax.broadcast_in_dim(
      w, acc.shape, [0]
  )
  return acc, m_new, l * alpha + w


def pack_rows(*, heads: int, head_groups: int, num_splits: int) -> int:
  """Rows of the batch one CTA of the per-split ring merges at once
  (`build_packed_merge`): `64 // heads` where a row's real heads fill at
  most half of the one head group (the tensor-parallel 8-32 heads) and one
  pass takes the rows' splits; else 1 (`build_merge`)."""
  if head_groups != 1 or heads > HEAD_TILE // 2 or num_splits > MAX_SPLITS:
    return 1
  return HEAD_TILE // heads


def build_packed_merge(
    *, batch: int, num_splits: int, heads: int, dv: int, max_tokens: int, out_dtype,
    interpret, finish_rows: bool = False, cols: int | None = None, stages: int | None = None,
):
  """The per-split ring merge for rows of few heads: one CTA per `64 //
  heads` rows of the batch (and `cols` value channels), their heads stacked
  in the rows of one `[64, cols]` tile.

  At 16 heads a CTA of `build_merge` copies 16 real rows into a 64-row ring
  (48 KB of SMEM for three splits: three CTAs per SM), so the 1,024 CTAs of
  batch 128 ran in about three waves of latency-bound copies (7.5 µs on the
  H200 for 8 MB of partials). Stacked, each copy brings one row's real heads
  into its own rows of the tile, a quarter of the CTAs fill the SMs at once,
  and every row of the tile is real.

  Same arguments and results as `build_merge` with `partial_heads=heads`
  and `stage_out` (a 16-bit `out_dtype`): o `[batch, num_splits, 64, dv]`
  and lse `[batch, num_splits, 64]` f32 (the decode kernel's partials, of
  which the first `heads` rows are written), out `[batch, heads, dv]` and
  lse_out `[batch, heads]` (with `finish_rows`, the decode kernel's
  `[batch, 64, dv]` and `[batch, 64]`, updated in place at the rows it did
  not write, its first `heads` rows). The splits of the stacked rows are
  walked together, up to the most any of them has; a split past a row's
  live ones is still copied (in bounds, its bytes never written) and
  selected away, so each ring slot completes on a fixed count of copies.
  """
  pack = HEAD_TILE // heads
  assert heads % 8 == 0 and pack >= 2 and jnp.dtype(out_dtype).itemsize == 2
  assert num_splits <= MAX_SPLITS
  if cols is None or stages is None:
    cols, stages = merge_tiling(num_splits)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  real = pl.ds(0, heads)

  def merge_kernel(seq_ref, bounds_ref, o_ref, lse_ref, *refs):
    out_ref, lse_out_ref, o_buf, lse_buf, bar, out_buf, lse_stage = refs
    c = lax.axis_index("c")
    chans = pl.ds(c * cols, cols)
    rows = []  # per stacked row: (batch row, live splits, whether this CTA writes it)
    for k in range(pack):
      b_k = lax.axis_index("b") * pack + k
      b = jnp.minimum(b_k, batch - 1)  # past the batch: a real row's bytes, never stored
      ntiles = (jnp.clip(seq_ref[b], 0, max_tokens) + TILE - 1) // TILE

      def bound(j, b=b, ntiles=ntiles):
        return jnp.clip(bounds_ref[b, j], 0, ntiles)

      mine = b_k < batch
      if finish_rows:
        mine &= ~kernel_wrote_row(ntiles, bound(0), bound(1))
      rows.append((b, jnp.where(mine, live_splits(bound, num_splits), 0), mine))
    n = rows[0][1]
    for _, n_k, _ in rows[1:]:
      n = jnp.maximum(n, n_k)
    # Each tile row's own live splits (rows past the stacked ones: none).
    stacked = plgpu.broadcasted_iota(jnp.int32, (HEAD_TILE,), 0, layout=row_layout) // heads
    n_rows = plgpu.layout_cast(jnp.full((HEAD_TILE,), 0, jnp.int32), row_layout)
    for k, (_, n_k, _) in enumerate(rows):
      n_rows = jnp.where(stacked == k, n_k, n_rows)

    def fetch(j):
      slot = lax.rem(j, stages)
      for k, (b, _, _) in enumerate(rows):
        at = pl.ds(k * heads, heads)
        plgpu.copy_gmem_to_smem(o_ref.at[b, j, real, chans], o_buf.at[slot, at], bar.at[slot])
        # A plain bulk copy (contiguous, in bounds): a TMA box needs a
        # 128-byte aligned SMEM address, and row k's LSE starts at 4 * heads *
        # k bytes (a misaligned-address fault on the H200 otherwise).
        plgpu.copy_gmem_to_smem(lse_ref.at[b, j, real], lse_buf.at[slot, at], bar.at[slot],
                                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

    for j in range(stages):
      pl.when(j < n)(lambda j=j: fetch(j))

    def live_rows(j):  # the tile rows whose row's split j is live
      return plgpu.layout_cast(jnp.full((HEAD_TILE,), j, jnp.int32), row_layout) < n_rows

    step = functools.partial(ring_step, bar=bar, lse_buf=lse_buf, o_buf=o_buf, stages=stages,
                             n=n, fetch=fetch, live_rows=live_rows)
    acc, m, l = lax.fori_loop(0, n, step, softmax_start(cols))
    o, lse = softmax_finish(acc, m, l)
    out_buf[...] = o.astype(out_dtype)
    lse_stage[...] = lse
    plgpu.commit_smem()  # the copies (async proxy) read what the stores wrote
    for k, (b, _, mine) in enumerate(rows):
      # (The out box starts `heads * k` rows of `2 * cols` bytes in, a
      # multiple of 512 bytes for every head count and tiling that stacks, as
      # the value boxes above are; the LSE, contiguous, goes by a plain bulk
      # copy, 16-aligned.)
      at = pl.ds(k * heads, heads)
      pl.when(mine)(lambda b=b, at=at: plgpu.copy_smem_to_gmem(
          out_buf.at[at], out_ref.at[b, real, chans]))
      pl.when(mine & (c == 0))(lambda b=b, at=at: plgpu.copy_smem_to_gmem(
          lse_stage.at[at], lse_out_ref.at[b, real]))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  scratch = [
      plgpu.SMEM((stages, HEAD_TILE, cols), jnp.float32),
      plgpu.SMEM((stages, HEAD_TILE), jnp.float32),
      plgpu.Barrier(num_arrivals=2 * pack, num_barriers=stages),
      plgpu.SMEM((HEAD_TILE, cols), out_dtype),
      plgpu.SMEM((HEAD_TILE,), jnp.float32),
  ]
  call = plgpu.kernel(
      merge_kernel,
      out_type=() if finish_rows else (
          jax.ShapeDtypeStruct((batch, heads, dv), out_dtype),
          jax.ShapeDtypeStruct((batch, heads), jnp.float32),
      ),
      grid=(-(-batch // pack), dv // cols),
      grid_names=("b", "c"),
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      kernel_name="jaxkv_mla_decode_merge",
      interpret=interpret,
  )
  return _merge_call(call, finish_rows=finish_rows)


def build_merge(
    *, batch: int, num_splits: int, heads_padded: int, dv: int, max_tokens: int,
    out_dtype, interpret, finish_rows: bool = False, cols: int | None = None,
    stages: int | None = None, chunk: int | None = None, edge_chunk: int | None = None,
    group: bool = False, stage_out: bool = False, out_heads: int | None = None,
    partial_heads: int | None = None,
):
  """Returns `(seq_lens, bounds, o, lse) -> (out, lse_out)`, and with
  `finish_rows` `(seq_lens, bounds, o, lse, out, lse_out) -> (out, lse_out)`.

  seq_lens `[batch]` int32 (clipped here to `[0, max_tokens]`) and bounds
  `[batch, num_splits + 1]` int32 (the plan's, clipped here to the row's
  64-slot tiles) give each row's live splits: the non-empty ones, which are
  its first ones. o `[batch, num_splits, heads_padded, dv]` f32 and lse `[batch,
  num_splits, heads_padded]` f32 are read only where live. out `[batch,
  heads_padded, dv]` in out_dtype and lse_out `[batch, heads_padded]` f32: each
  row's merge (0 and -inf for a row with no live split); with `finish_rows`
  they are the decode kernel's, updated in place, and the rows it wrote
  (`kernel_wrote_row`) come back as they were. cols, stages: the tiling
  (when None: `merge_tiling`, and with `chunk` 32 channels and the whole
  chunk in flight).

  With `chunk` (the first of two passes for rows of many splits), each row's
  splits are merged in the chunks `chunk_edges(num_splits, chunk)` gives, one
  CTA per chunk as well: out `[batch, chunks, heads_padded, dv]` in out_dtype
  and lse_out `[batch, chunks, heads_padded]`, the merge of each chunk's live
  splits (0 and -inf for a chunk without one). The chunks' results are then
  a row's splits, bounded by `bounds[:, chunk_edges(...)]`.

  With `edge_chunk` (the second pass), `bounds` is the plan's own `[batch,
  plan_splits + 1]` and split k of this pass is the plan's chunk k of
  `edge_chunk` splits: the kernel reads the bound at `chunk_edges(plan_splits,
  edge_chunk)[k]` itself, which saves the XLA gather of those columns (a
  launch of its own: 0.7-1.5 µs at batch 1-4 on the H200).

  With `group` (one pass over rows of more than `GROUP` splits), o and lse
  come in `wide_partials`' layout, the splits come in `GROUP` per copy and
  are weighted by the row's LSE maximum taken first (`grouped_tiling` when
  cols / stages are None; stages then counts groups in flight).

  `stage_out`: a 16-bit out goes through SMEM and a TMA copy (each CTA's
  `[64, cols]` in whole rows) instead of from registers, where a warp's
  store covers half of each 32-byte sector it touches.

  `out_heads` (with `stage_out`, neither `chunk` nor `finish_rows`): out and
  lse_out have that many rows, `heads_padded - 64 < out_heads < heads_padded`
  and a multiple of 8, instead of `heads_padded`: the last head group's CTAs
  copy their tiles' real rows alone (its LSE staged too), so that the caller
  needs no slice of the padded result (an XLA op per output and call).

  `partial_heads`: the real heads of o, when fewer than `heads_padded` (a
  multiple of 8 past `heads_padded - 64`): the decode kernel writes the last
  head group's real rows of its partials alone (`layout.store_head_rows`),
  and the per-split ring copies those alone (a box of as many rows), which
  saves their padding's bytes. The other rows of the tile in SMEM hold
  whatever they held and stay in their rows: every row of the merge is its
  own, and no store writes them. The grouped pass reads whole tiles (one
  bulk copy of a group's splits) and needs none of it either.
  """
  span = num_splits if chunk is None else chunk  # splits one CTA merges
  if cols is None or stages is None:
    if group:
      cols, stages = grouped_tiling(
          batch=batch, head_groups=heads_padded // HEAD_TILE, num_splits=num_splits)
    else:
      cols, stages = merge_tiling(num_splits) if chunk is None else (COLS // 2, chunk)
  assert dv % cols == 0 and heads_padded % HEAD_TILE == 0
  assert chunk is None or not finish_rows
  assert chunk is None or edge_chunk is None
  assert not group or (chunk is None and edge_chunk is None and can_group(num_splits))
  chunks = 1 if chunk is None else len(chunk_edges(num_splits, chunk)) - 1

  stage_out = stage_out and jnp.dtype(out_dtype).itemsize == 2
  out_heads = heads_padded if out_heads is None else out_heads
  head_groups = heads_padded // HEAD_TILE
  tail_heads = last_group_rows(out_heads, heads_padded)
  assert tail_heads == HEAD_TILE or (stage_out and chunk is None and not finish_rows)
  in_tail = last_group_rows(heads_padded if partial_heads is None else partial_heads,
                            heads_padded)

  def merge_kernel(seq_ref, bounds_ref, o_ref, lse_ref, *refs):
    if tail_heads < HEAD_TILE:
      *refs, lse_stage = refs
    if stage_out:
      *refs, out_buf = refs
    out_ref, lse_out_ref, o_buf, lse_buf, bar = refs
    b = lax.axis_index("b")
    ntiles = (jnp.clip(seq_ref[b], 0, max_tokens) + TILE - 1) // TILE
    if chunk is None:
      first, limit, row_out, row_lse = 0, num_splits, out_ref.at[b], lse_out_ref.at[b]
    else:  # chunk k holds splits [first, limit), as chunk_edges lays them out
      k = lax.axis_index("k")
      first, limit = chunk_edge(k, chunk, num_splits), chunk_edge(k + 1, chunk, num_splits)
      row_out, row_lse = out_ref.at[b, k], lse_out_ref.at[b, k]

    def column(k):
      # The bounds column of this pass's split boundary k.
      if edge_chunk is None:
        return k
      return chunk_edge(k, edge_chunk, bounds_ref.shape[1] - 1)

    def bound(j):
      return jnp.clip(bounds_ref[b, column(jnp.minimum(first + j, limit))], 0, ntiles)

    def run():
      c = lax.axis_index("c")
      heads = pl.ds(lax.axis_index("g") * HEAD_TILE, HEAD_TILE)
      chans = pl.ds(c * cols, cols)
      n = live_splits(bound, span)  # the row's first n splits are its live ones
      row = merge_row_grouped if group else merge_row
      acc, m, l = row(b, first, n, heads, chans, o_ref, lse_ref, o_buf, lse_buf, bar)
      o, lse = softmax_finish(acc, m, l)

      def store_whole():  # all 64 rows of the head group
        if stage_out:
          stage_store(out_buf, o.astype(out_dtype), row_out.at[heads, chans])
        else:
          row_out[heads, chans] = o.astype(out_dtype)

        @pl.when(c == 0)
        def _():
          row_lse[heads] = lse

      def store_tail():  # the last head group's real rows alone
        rows = pl.ds(heads_padded - HEAD_TILE, tail_heads)
        real = pl.ds(0, tail_heads)
        stage_store(out_buf, o.astype(out_dtype), row_out.at[rows, chans], src=out_buf.at[real])

        @pl.when(c == 0)
        def _():
          stage_store(lse_stage, lse, row_lse.at[rows], src=lse_stage.at[real])

      by_head_group(lax.axis_index("g"), head_groups=head_groups, tail_heads=tail_heads,
                    whole=store_whole, tail=store_tail)

      if stage_out:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if finish_rows:
      pl.when(~kernel_wrote_row(ntiles, bound(0), bound(1)))(run)
    else:
      run()

  def merge_row(b, first, n, heads, chans, o_ref, lse_ref, o_buf, lse_buf, bar):
    """`(acc, m, l)` of the row's n live splits, one at a time through a ring."""

    def fetch(j):
      slot = lax.rem(j, stages)
      src = o_ref.at[b, first + j]
      by_head_group(
          lax.axis_index("g"), head_groups=head_groups, tail_heads=in_tail,
          whole=lambda: plgpu.copy_gmem_to_smem(
              src.at[heads, chans], o_buf.at[slot], bar.at[slot]),
          # The last head group's real rows alone, into the tile's first rows.
          tail=lambda: plgpu.copy_gmem_to_smem(
              src.at[pl.ds(heads_padded - HEAD_TILE, in_tail), chans],
              o_buf.at[slot, pl.ds(0, in_tail)], bar.at[slot]),
      )
      plgpu.copy_gmem_to_smem(lse_ref.at[b, first + j, heads], lse_buf.at[slot], bar.at[slot])

    for k in range(stages):
      pl.when(k < n)(lambda k=k: fetch(k))

    step = functools.partial(ring_step, bar=bar, lse_buf=lse_buf, o_buf=o_buf, stages=stages,
                             n=n, fetch=fetch)

    # A live split has a finite LSE (it read at least one slot), so the
    # first one sets m finite and alpha never sees -inf - -inf.
    return lax.fori_loop(0, n, step, softmax_start(cols))

  def merge_row_grouped(b, first, n, heads, chans, o_ref, lse_ref, o_buf, lse_buf, bar):
    """`(acc, m, l)` of the row's n live splits, `GROUP` per copy, weighted
    by their LSE maximum taken first."""
    del first  # 0: the whole row
    o_bar, lse_bar = bar
    groups = -(-num_splits // GROUP)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    del chans  # o is `wide_partials`' layout, flattened (see `merge` below)
    run_start = ((b * (dv // cols) + lax.axis_index("c")) * (heads_padded // HEAD_TILE)
                 + lax.axis_index("g")) * num_splits

    def fetch(k):
      # The group's `[GROUP, 64, cols]` is contiguous in GMEM and inside the
      # array (the last box ends at the row's last slot): Mosaic GPU issues
      # one bulk copy for it, not a TMA box of `cols * 4`-byte rows.
      rows = pl.ds(run_start + group_box_start(k, num_splits), GROUP)
      plgpu.copy_gmem_to_smem(o_ref.at[rows], o_buf.at[k % stages], o_bar.at[k % stages],
                              oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

    # Every slot's LSE (a dead slot's bytes are selected away below), and the
    # first group whether live or not (a row with any split has split 0 live):
    # neither copy waits for the live count's loads.
    plgpu.copy_gmem_to_smem(lse_ref.at[b, lax.axis_index("g")], lse_buf, lse_bar,
                            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
    fetch(0)
    for k in range(1, min(stages, groups)):
      pl.when(k * GROUP < n)(lambda k=k: fetch(k))

    def live_rows(j):
      # Split j is live, as a row-layout mask (a scalar does not select an array).
      return plgpu.layout_cast(jnp.full((HEAD_TILE,), j, jnp.int32), row_layout) < n

    def log2_lse(j):
      # Loaded again where used: all splits' maxima held in registers would
      # not fit beside the accumulator.
      return plgpu.load(lse_buf.at[j], layout=row_layout, optimized=False) * LOG2E

    plgpu.barrier_wait(lse_bar)
    m = plgpu.layout_cast(jnp.full((HEAD_TILE,), -jnp.inf, jnp.float32), row_layout)
    for j in range(num_splits):
      m = jnp.maximum(m, jnp.where(live_rows(j), log2_lse(j), -jnp.inf))
    # No live split: m stays -inf and every weight is selected to 0, so the
    # row comes out 0 / -inf (softmax_finish).

    acc, _, l = softmax_start(cols)
    for k in range(groups):
      slot = k % stages
      if k == 0:  # fetched whatever n is
        plgpu.barrier_wait(o_bar.at[slot])
      else:
        pl.when(k * GROUP < n)(lambda slot=slot: plgpu.barrier_wait(o_bar.at[slot]))
      for j in range(k * GROUP, min((k + 1) * GROUP, num_splits)):
        live = live_rows(j)
        w = jnp.where(live, jnp.exp2(log2_lse(j) - m), 0.0)
        o_j = plgpu.load(o_buf.at[slot, j - group_box_start(k, num_splits)],
                         layout=plgpu.Layout.WGMMA, optimized=False)
        o_j = jnp.where(lax.broadcast_in_dim(live, o_j.shape, [0]), o_j, 0.0)
        acc = acc + o_j * lax.broadcast_in_dim(w, acc.shape, [0])
        l = l + w
      if k + stages < groups:
        # Every thread's reads of the slot are ordered before its refill.
        plgpu.commit_smem()
        pl.when((k + stages) * GROUP < n)(lambda k=k: fetch(k + stages))
    return acc, m, l

  if group:
    scratch = [
        plgpu.SMEM((stages, GROUP, HEAD_TILE, cols), jnp.float32),
        plgpu.SMEM((num_splits, HEAD_TILE), jnp.float32),
        (plgpu.Barrier(num_arrivals=1, num_barriers=stages), plgpu.Barrier(num_arrivals=1)),
    ]
  else:
    scratch = [
        plgpu.SMEM((stages, HEAD_TILE, cols), jnp.float32),
        plgpu.SMEM((stages, HEAD_TILE), jnp.float32),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    ]
  if stage_out:
    scratch.append(plgpu.SMEM((HEAD_TILE, cols), out_dtype))
  if tail_heads < HEAD_TILE:
    scratch.append(plgpu.SMEM((HEAD_TILE,), jnp.float32))
  per_row = () if chunk is None else (chunks,)
  outputs = (
      jax.ShapeDtypeStruct((batch, *per_row, out_heads, dv), out_dtype),
      jax.ShapeDtypeStruct((batch, *per_row, out_heads), jnp.float32),
  )
  call = plgpu.kernel(
      merge_kernel,
      out_type=() if finish_rows else outputs,
      grid=(batch, *per_row, heads_padded // HEAD_TILE, dv // cols),
      grid_names=("b", *(("k",) if chunk else ()), "g", "c"),
      scratch_types=scratch,
      # The grouped pass lowers with Lane semantics: Warpgroup semantics' layout
      # inference would give its SMEM tiles an (8, 8) tiling and a 32-byte
      # swizzle, and its bulk copies would be TMA boxes of narrow rows again.
      compiler_params=plgpu.CompilerParams(
          approx_math=True, **(dict(lowering_semantics=plgpu.LoweringSemantics.Lane) if group else {})),
      kernel_name="jaxkv_mla_decode_merge",
      interpret=interpret,
  )

  if not group:
    return _merge_call(call, finish_rows=finish_rows)
  # `wide_partials`' layout with every dimension but a split's tile as one
  # (a free reshape): a group's copy is then a contiguous slice.
  return _merge_call(call, finish_rows=finish_rows, flat=lambda o: o.reshape(-1, HEAD_TILE, cols))


def _merge_call(call, *, finish_rows: bool, flat=lambda o: o):
  """A merge kernel's call as `build_merge` returns it: `(seq_lens, bounds,
  o, lse) -> (out, lse_out)`, o passed through `flat`; with `finish_rows`
  `(..., out, lse_out) -> (out, lse_out)`, the decode kernel's outputs
  updated in place (a Pallas state discharge aliases them)."""
  if not finish_rows:
    return lambda seq_lens, bounds, o, lse: call(seq_lens, bounds, flat(o), lse)

  def merge(seq_lens, bounds, o, lse, out, lse_out):

    def in_place(refs):
      call(seq_lens, bounds, flat(o), lse, *refs)

    return pl.run_state(in_place)((out, lse_out))

  return merge
