"""Merge of a row's split results as a Mosaic GPU kernel that reads only live splits.

`combine_splits` (plain jnp) is its specification. XLA's fusion of it reads
every split slot of every row, written or not; with the balanced plan most
rows use fewer slots than the plan reserves, and those reads cost as much as
the live ones. Here one CTA per (row, head group, 64 value channels) loops
over the row's live splits only: each split's [64, 64] tile (float32, or the
decode kernel's scaled float16 with its scale: `build_merge(f16_partials=)`)
and its LSE come in by TMA through a ring of `STAGES` buffers (that many splits in
flight, so a row of many splits streams instead of waiting out one load per
split), and the merged tile is stored in the output dtype: a 16-bit one
through SMEM by one TMA copy (`build_merge(stage_out=)`, the default of
`_mla_decode`), which took 1.8-3.4 µs off the merge at batch 128 on the H200
against stores from registers.

Rows of more than `MAX_SPLITS` splits take two passes: the first merges
chunks of a row's splits (split 0 alone, then `CHUNK` at a time), a CTA per
chunk, into float32 results; the second merges those as the row's splits.
(The tiling, these constants and the split bounds' helpers are in
`merge_tiling`.)

Where `merge_tiling.use_grouped` says so (rows of more than `MAX_SPLITS`
splits at batch 1-4, and of `GROUP_NARROW_MIN` to `MAX_SPLITS` splits with
one head group), one pass merges them instead with the splits grouped
(`build_merge(group=True)`, its row in `grouped_merge`): each copy brings
`GROUP` splits of a CTA's tile at once, and the decode kernel stores its
partials in that pass's layout (`wide_partials`). With `halves` two CTAs in
a cluster share each tile's splits: the wrapper's default for rows of more
than `GROUP_MAX_SPLITS` splits (1 x 64 x 128K's 133).

Rows of 8-32 heads (one head group, mostly padding) take
`packed_merge.build_packed_merge` instead of the per-split ring: `64 // heads` rows of the batch per CTA, their
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
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels._cluster import cluster_sync, interpreted_cluster_sync

from .grouped_merge import merge_row_grouped
from .ring import ring_step
from .layout import (
    HALF,
    HEAD_TILE,
    TILE,
    by_head_group,
    last_group_rows,
    stage_store,
)
from .merge_tiling import (
    COLS,
    GROUP,
    can_group,
    chunk_edge,
    chunk_edges,
    grouped_tiling,
    kernel_wrote_row,
    live_splits,
    merge_tiling,
)
from .seesaw import softmax_finish, softmax_start


def build_merge(
    *, batch: int, num_splits: int, heads_padded: int, dv: int, max_tokens: int,
    out_dtype, interpret, finish_rows: bool = False, cols: int | None = None,
    stages: int | None = None, chunk: int | None = None, edge_chunk: int | None = None,
    group: bool = False, stage_out: bool = False, out_heads: int | None = None,
    partial_heads: int | None = None, f16_partials: bool = False, halves: bool = False,
    lean: bool = True,
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

  `f16_partials` (the per-split ring in one pass or the first of two, and
  the grouped pass): o holds float16 partials as the decode kernel's
  `f16_partials` stores them (`layout.split_outputs`), and their scales f32
  come as an argument after lse: `[batch, num_splits, 2, heads_padded]`, or
  for the grouped pass `[batch, heads_padded / 64, 2, num_splits, 64]`.

  `halves` (the grouped pass, not with `finish_rows`): a cluster of two CTAs
  per tile, each over half of the row's groups of splits; the second hands
  its sums on to the first through GMEM at the cluster's barrier
  (`grouped_merge.merge_row_grouped`). It doubles the grid (batch 1 x 64
  heads: 128 CTAs instead of 64) and takes rows of up to twice
  `GROUP_MAX_SPLITS` splits in one pass; `_mla_decode` takes it past those
  (with float16 partials, on an H100 0.943-0.959 of the per-split ring's two
  passes at 1 x 64 x 64K-128K) and only forces it elsewhere, where it lost
  (NOTES.md).

  `lean`: the row's live splits counted once its first copies are issued
  (the per-split ring's first split; the grouped pass's LSE, scales and
  first group), not before; and the grouped pass's maximum (its maximum and
  sums are loops over the live splits and groups) a loop over groups of
  independent loads (`grouped_merge.merge_row_grouped`). False: the merges
  as first timed.
  """
  span = num_splits if chunk is None else chunk  # splits one CTA merges
  if cols is None or stages is None:
    if group:
      cols, stages = grouped_tiling(
          batch=batch, head_groups=heads_padded // HEAD_TILE, num_splits=num_splits,
          f16=f16_partials, halves=halves)
    else:
      cols, stages = merge_tiling(num_splits) if chunk is None else (COLS // 2, chunk)
  assert dv % cols == 0 and heads_padded % HEAD_TILE == 0
  assert chunk is None or not finish_rows
  assert chunk is None or edge_chunk is None
  assert not group or (chunk is None and edge_chunk is None and can_group(num_splits, halves))
  assert not halves or (group and not finish_rows)
  assert not f16_partials or edge_chunk is None
  chunks = 1 if chunk is None else len(chunk_edges(num_splits, chunk)) - 1

  stage_out = stage_out and jnp.dtype(out_dtype).itemsize == 2
  out_heads = heads_padded if out_heads is None else out_heads
  head_groups = heads_padded // HEAD_TILE
  tail_heads = last_group_rows(out_heads, heads_padded)
  assert tail_heads == HEAD_TILE or (stage_out and chunk is None and not finish_rows)
  in_tail = last_group_rows(heads_padded if partial_heads is None else partial_heads,
                            heads_padded)

  def merge_kernel(seq_ref, bounds_ref, o_ref, lse_ref, *refs):
    scale_ref = scale_buf = None
    sync = cluster_sync
    if halves and interpret is not None:  # no `barrier.cluster` in the interpreter
      *refs, cluster_bar = refs
      sync = functools.partial(interpreted_cluster_sync, cluster_bar)
    if f16_partials:
      scale_ref, *refs, scale_buf = refs
    if tail_heads < HEAD_TILE:
      *refs, lse_stage = refs
    if stage_out:
      *refs, out_buf = refs
    if halves:  # the second CTA's sums for the first, after the outputs
      out_ref, lse_out_ref, acc_ref, l_ref, *refs = refs
    else:
      out_ref, lse_out_ref, *refs = refs
    o_buf, lse_buf, bar = refs
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

      def store(acc, m, l):  # the merged tile, in out_dtype, and its LSE
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

      # The row's first n splits are its live ones.
      count = lambda: live_splits(bound, span)
      scales = None if scale_ref is None else (scale_ref, scale_buf)
      if group:
        pair = None
        if halves:  # this tile's slot for the second CTA's sums
          tile = (b, lax.axis_index("g"), c)
          pair = (lax.axis_index("h"), acc_ref.at[tile], l_ref.at[tile], sync)
        merge_row_grouped(
            b, count, chans, o_ref, lse_ref, o_buf, lse_buf, bar, scales, store,
            num_splits=num_splits, dv=dv, cols=cols, heads_padded=heads_padded,
            stages=stages, halves=pair, lean=lean)
      else:
        store(*merge_row(b, first, count, heads, chans, o_ref, lse_ref, o_buf, lse_buf, bar,
                         scales))

    if finish_rows:
      pl.when(~kernel_wrote_row(ntiles, bound(0), bound(1)))(run)
    else:
      run()

  def merge_row(b, first, count, heads, chans, o_ref, lse_ref, o_buf, lse_buf, bar, scales):
    """`(acc, m, l)` of the row's n = `count()` live splits, one at a time
    through a ring (`scales`: float16 partials' `(scale_ref, scale_buf)`,
    else None). With `lean`, the first split's copies are issued before n
    is counted (its bounds' loads then overlap them), and waited for where
    the row has no live split (their bytes, whatever they are, unused)."""

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
      if scales:  # the scale of the channel half these channels are in
        scale_ref, scale_buf = scales
        half = lax.div(chans.start, HALF)
        plgpu.copy_gmem_to_smem(scale_ref.at[b, first + j, half, heads], scale_buf.at[slot],
                                bar.at[slot])

    if lean:
      fetch(0)
      n = count()
      pl.when(n == 0)(lambda: plgpu.barrier_wait(bar.at[0]))  # no copy left in flight
    else:
      n = count()
    for k in range(1 if lean else 0, stages):
      pl.when(k < n)(lambda k=k: fetch(k))

    step = functools.partial(ring_step, bar=bar, lse_buf=lse_buf, o_buf=o_buf, stages=stages,
                             n=n, fetch=fetch,
                             scale_buf=None if scales is None else scales[1])

    # A live split has a finite LSE (it read at least one slot), so the
    # first one sets m finite and alpha never sees -inf - -inf.
    return lax.fori_loop(0, n, step, softmax_start(cols))

  partial_dtype = jnp.bfloat16 if f16_partials else jnp.float32
  if group:
    scratch = [
        plgpu.SMEM((stages, GROUP, HEAD_TILE, cols), partial_dtype),
        plgpu.SMEM((num_splits, HEAD_TILE), jnp.float32),
        (plgpu.Barrier(num_arrivals=1, num_barriers=stages),
         plgpu.Barrier(num_arrivals=2 if f16_partials else 1)),
    ]
  else:
    scratch = [
        plgpu.SMEM((stages, HEAD_TILE, cols), partial_dtype),
        plgpu.SMEM((stages, HEAD_TILE), jnp.float32),
        plgpu.Barrier(num_arrivals=3 if f16_partials else 2, num_barriers=stages),
    ]
  if stage_out:
    scratch.append(plgpu.SMEM((HEAD_TILE, cols), out_dtype))
  if tail_heads < HEAD_TILE:
    scratch.append(plgpu.SMEM((HEAD_TILE,), jnp.float32))
  if f16_partials:  # the scales: per slot of the ring, or every split's
    scratch.append(plgpu.SMEM((num_splits, HEAD_TILE) if group else (stages, HEAD_TILE),
                              jnp.float32))
  if halves and interpret is not None:
    # The interpreter has no `barrier.cluster`: each CTA arrives on both
    # CTAs' barrier.
    scratch.append(plgpu.ClusterBarrier(collective_axes=("h",), num_arrivals=1))
  per_row = () if chunk is None else (chunks,)
  outputs = (
      jax.ShapeDtypeStruct((batch, *per_row, out_heads, dv), out_dtype),
      jax.ShapeDtypeStruct((batch, *per_row, out_heads), jnp.float32),
  )
  if halves:  # the second CTA's sums, per tile: of no use to the caller
    tiles = (batch, head_groups, dv // cols, HEAD_TILE)
    outputs += (jax.ShapeDtypeStruct((*tiles, cols), jnp.float32),
                jax.ShapeDtypeStruct(tiles, jnp.float32))
  call = plgpu.kernel(
      merge_kernel,
      out_type=() if finish_rows else outputs,
      grid=(batch, *per_row, heads_padded // HEAD_TILE, dv // cols),
      grid_names=("b", *(("k",) if chunk else ()), "g", "c"),
      cluster=(2,) if halves else (),
      cluster_names=("h",) if halves else (),
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
    return merge_call(call, finish_rows=finish_rows, scaled=f16_partials)
  # `wide_partials`' layout with every dimension but a split's tile as one
  # (a free reshape): a group's copy is then a contiguous slice.
  return merge_call(call, finish_rows=finish_rows, flat=lambda o: o.reshape(-1, HEAD_TILE, cols),
                    scaled=f16_partials, results=2 if halves else None)


def merge_call(call, *, finish_rows: bool, flat=lambda o: o, scaled: bool = False,
               results: int | None = None):
  """A merge kernel's call as `build_merge` returns it: `(seq_lens, bounds,
  o, lse) -> (out, lse_out)`, o passed through `flat`, and with `scaled` the
  float16 partials' scales after lse; with `finish_rows` `(..., out,
  lse_out) -> (out, lse_out)`, the decode kernel's outputs updated in place
  (a Pallas state discharge aliases them). `results`: the call's outputs
  the caller gets, its first ones (None: all)."""

  def merge(seq_lens, bounds, o, lse, *rest):
    scale, finished = (rest[:1], rest[1:]) if scaled else ((), rest)
    inputs = (seq_lens, bounds, flat(o), lse, *scale)
    assert len(finished) == (2 if finish_rows else 0)
    if not finish_rows:
      return call(*inputs)[:results]

    def in_place(refs):
      call(*inputs, *refs)

    return pl.run_state(in_place)(tuple(finished))

  return merge
