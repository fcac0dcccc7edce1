"""Mosaic GPU body of sparse MLA decode: one CTA per (row, split, head group).

(With one split and `cut_rows`, the batch's last rows instead take
`pieces` CTAs per head group, one per contiguous piece of their top-k list,
after the whole rows' CTAs: a batch whose CTAs overrun one wave then ends on
short pieces. On the H200 at top-k 2048, halves took 96 × 128 heads from
145.4 to 127.1 µs and 150 × 64 from 153.9 to 140.8, merge included. With
`parts`, the stream schedule of `stream.py` instead: one CTA per head group
and run of the batch's tiles laid end to end, walking its rows segment by
segment, as dense decode's parts do.)

A row's keys are arbitrary cache slots. Warpgroup 2, the producer, gathers
each 64-row tile of them straight into the swizzled wgmma operand tiles of a
two-stage ring: compiled, each of its 128 threads copies its 16-byte pieces of
the rows with `cp.async` (`gather.py`: no TMA per row, no relayout through
registers), and arrives on the stage's own mbarrier with an arrival that
completes when its copies land (`cp.async.mbarrier.arrive.noinc`): the stage
is ready with its last byte, and the producer goes on to the next free stage
without waiting (so both stages can be filling at once when the consumers are
ahead of the copies).
Each tile's 64 slot ids come ahead of time by one TMA copy into a four-deep
SMEM ring. (The interpreter has no `cp.async`: there the producer issues one
TMA copy per row and latent half / RoPE part, which lands the same bytes, on
a Pallas barrier.)

Warpgroups 0 and 1 consume each tile as the dense kernel does
(`mla_decode.kernel`): scores by slots (warpgroup w computes S_w = Q K^T for
slots [32w, 32w + 32), 576 deep), values by channels (warpgroup w accumulates
O[:, 256w:256w+256] over all 64 slots), the halves met in the "seesaw" order
(`mla_decode.seesaw.seesaw_tile`: warpgroup 0's maximum is handed on, each
multiplies its own P at once and the other's when it arrives).

Masking. Any slot of any tile can be invalid (-1, or any id outside the
cache: never clamped onto some other slot), so every tile is masked: each
stage's 64 indices land in SMEM with its rows, and the consumers give an
invalid index the score -inf in both modes. What the producer copies for
one differs: "select" copies nothing (the stage was zeroed at the start, so
the row holds finite bytes: zeros or an earlier row of this CTA's own
selection, weighted exactly 0), so no slot outside the row's selection is
ever read; "multiply" reads slot 0 (the null block) for the first invalid
id of each tile and nothing for the others, so a non-finite null block meets
p = 0 in the accumulator (0 * NaN = NaN) and poisons the row exactly as in
production kernels, which read it for every -1 (once or many times, 0 * NaN
is NaN and 0 * finite adds +0), without every CTA of the step reading one
hot row.

The result (one split) or each split's partial result is stored to GMEM,
normalised, with its natural-log LSE; a split without a valid index writes
LSE = -inf and O = 0 (a partial: NaN if "multiply" accumulated a NaN value
row, which the merge never uses). A bf16 result goes out by TMA from the
last tile's stage (`stage_out`): from registers, two bf16 values per thread
and row fill half of each 32-byte sector a warp store touches, which cost the
kernel 4-5.5% at batch 128 on the H200. The f32 partials (two per thread and
row: whole sectors) are stored from registers.

With `cluster_merge`, a row's splits (n = 2, 4 or 8), or a cut row's two
halves (`cut_rows`, `pieces=2`; the whole rows' CTAs then go in pairs that merge
nothing), are one cluster of CTAs that merge their partials themselves
(`cluster.merge_row`), so that no combine kernel follows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode.config import Q_REGS, check_choice
from jaxkv.kernels.mla_decode.layout import (
    HALF,
    HEAD_TILE,
    LATENT,
    LOG2E,
    NUM_STAGES,
    ROPE,
    SLOT_HALF,
    bf16_tile,
    last_group_rows,
    launch,
    load_query,
    split_outputs,
    stage_head_group,
    store_head_rows,
    zero_query_rows,
)
from jaxkv.kernels.mla_decode.seesaw import (
    query_head,
    seesaw_barriers,
    seesaw_begin,
    seesaw_end,
    seesaw_p_scratch,
    seesaw_pv,
    seesaw_row_sums,
    seesaw_tile,
    softmax_finish,
    softmax_start,
    tile_scores,
)
from jaxkv.kernels.sparse_mla_decode.cluster import cluster_sync, merge_row
from jaxkv.kernels.sparse_mla_decode.config import CLUSTER_SPLITS, TILE, cluster_ctas
from jaxkv.kernels.sparse_mla_decode.gather import (
    FIRST_INVALID_SCRATCH,
    init_barriers,
    issue_gather,
    null_first_invalid,
    row_ids,
    wait_barrier,
    warpgroup_barrier,
    zero_fill,
)
from jaxkv.kernels.sparse_mla_decode.stream import part_bounds, part_rows, segment

HEAD_DIM = LATENT + ROPE
# Slots per pipeline step (the config's divisibility unit): each consumer
# scores half.
assert TILE == 2 * SLOT_HALF
IDX_STAGES = 4  # tiles of slot ids in flight ahead of their gathers
# setmaxnreg only moves registers inside the launch allocation (168 per
# thread for 384 threads): 2 * CONSUMER_REGS + PRODUCER_REGS <= 3 * 168, or
# the consumers' increase waits forever.
PRODUCER_REGS = 40
CONSUMER_REGS = 232
# The running maximum's start: finite and below any score (|q.k| * scale is
# far smaller), so that masked scores (-inf) give exp2(-inf - M_FLOOR) = 0.
M_FLOOR = -1e30


def build_kernel(
    *,
    batch: int,
    heads_padded: int,
    topk: int,
    num_splits: int,
    sm_scale: float,
    select: bool,
    interpret,
    out_dtype=jnp.float32,
    q_regs: int = 0,
    stage_out: bool = False,
    q_heads: int | None = None,
    cut_rows: int = 0,
    pieces: int = 2,
    cluster_merge: bool = False,
    parts: int = 0,
):
  """Builds the kernel call.

  Returns a function `(q, cache_rows, indices) -> (o, lse)` with q
  `[batch, heads_padded, 576]` bf16, cache_rows `[num_slots, 576]` bf16 (the
  cache with blocks and slots merged), indices `[batch, topk]` int32 (-1 or
  any id outside `[0, num_slots)`: masked; "multiply" reads slot 0 for the
  first of each tile). With several splits, o `[batch, num_splits,
  heads_padded, 512]` f32 and lse `[batch, num_splits, heads_padded]` f32
  are each split's partial result, for
  `combine_splits`. With one split they are the result itself, with no split
  axis: o `[batch, heads_padded, 512]` in `out_dtype` (0 where a row has no
  valid index) and lse `[batch, heads_padded]` f32.

  `q_regs`: the query's latent channels each consumer holds in registers for
  its QK, as in dense decode (`mla_decode.kernel.build_kernel`).

  `stage_out`: with one split and a bf16 result, each consumer writes its
  half of the result into its value half of the last tile's stage (free by
  then: both QKs and its own PV read it before) and stores it by TMA, in
  whole 64-byte rows, instead of from registers (two bf16 per thread and
  row: 16 of a 32-byte sector per warp store). With `cluster_merge` and a
  bf16 result, the merged pieces go out the same way, through a buffer in
  the KV ring's bytes (a `RefUnion`: the ring is dead after the cluster's
  barrier).

  `q_heads`: the query's own heads (q `[batch, q_heads, 576]`), fewer than
  `heads_padded` and a multiple of 8, as in dense decode
  (`mla_decode.kernel.build_kernel`): the last head group's copies bring its
  real rows alone into the first rows of the query's tiles, whose other rows
  the producer zeroes before the copies. With `stage_out` the result then
  has `q_heads` rows too: the last head group stores its real rows alone by
  TMA (its LSE staged likewise). With several splits the last head group's
  partials are written for its real rows alone (`layout.store_head_rows`),
  the rows the combine reads. None: q is padded already.

  `cut_rows` (with one split): the batch's last `cut_rows` rows are cut
  into `pieces` contiguous pieces of their tiles (piece i: tiles
  `[i * n // pieces, (i + 1) * n // pieces)` of n), a CTA each, after the
  whole rows' CTAs in the grid, and their pieces' partial results go to two
  more outputs, o `[cut_rows, pieces, heads_padded, 512]` and lse
  `[cut_rows, pieces, heads_padded]` f32 (as several splits' are); the
  whole rows' results are the first two outputs, as with one split, whose
  last `cut_rows` rows are left unwritten. Where a batch's CTAs overrun one
  wave, the last one is then short pieces behind the whole rows instead of
  whole rows (`config.wave_plan`).

  `cluster_merge` (with `num_splits` in `CLUSTER_SPLITS`): the splits of a
  row and head group are one cluster, which merges them in the kernel
  (module docstring). The first two outputs are then the result, o `[batch,
  out_heads, 512]` in `out_dtype` (each CTA stores its channels: staged, at
  the query's own heads, or from registers, in whole head groups, the last
  one's real rows alone) and lse `[batch, out_heads]` f32; two more, o
  `[batch, num_splits, heads_padded, 512]` and lse `[batch, num_splits,
  heads_padded]` f32, are the partials the cluster exchanged (without each
  CTA's own pieces), of no use to the caller. With `cut_rows` (halves: an even
  number of whole rows) the clusters are of two CTAs: two whole rows, which
  merge nothing, or a cut row's halves, which merge each other's partials
  (exchanged through the two extra outputs) and store the row's result;
  nothing is left unwritten.

  `parts` (with one split, no `cut_rows`, no `cluster_merge`, `2 <= parts
  <= batch`): the stream schedule (`stream.py`): `parts` CTAs per head group,
  each over an equal run of the batch's tiles laid end to end, row segment
  by row segment (the query reloaded per segment; the KV ring runs on across
  segments). A whole row's segment is the row's result, in the first two
  outputs (with `stage_out` staged in its last tile's stage, which goes back
  to the producer once the copy has read it); the two pieces of a row cut at
  the start of part p
  go to two more outputs, o `[parts - 1, 2, heads_padded, 512]` and lse
  `[parts - 1, 2, heads_padded]` f32, at index p - 1, for `piece_merge`.
  The cut rows of the first two outputs are left unwritten.
  """
  assert topk % (TILE * num_splits) == 0
  assert cut_rows == 0 or (num_splits == 1 and 2 <= pieces <= topk // TILE
                           and cut_rows <= batch)
  assert not parts or (num_splits == 1 and not cut_rows and not cluster_merge
                       and 2 <= parts <= batch)
  assert not cluster_merge or (num_splits in CLUSTER_SPLITS and not cut_rows) or (
      num_splits == 1 and cut_rows and pieces == 2 and (batch - cut_rows) % 2 == 0)
  check_choice("q_regs", q_regs, Q_REGS)
  num_tiles = topk // (TILE * num_splits)  # per split, static
  whole_rows = batch - cut_rows
  scale_log2 = float(sm_scale) * LOG2E
  dtype = jnp.bfloat16
  compiled = interpret is None
  bf16 = bf16_tile()
  direct = num_splits == 1  # no merge: the kernel writes the result
  cluster_size = cluster_ctas(num_splits=num_splits, cut_rows=cut_rows,
                              cluster_merge=cluster_merge)
  merge_cols = HALF // cluster_size  # value channels each consumer merges
  staged = stage_out and out_dtype == jnp.bfloat16
  # The kernel's own result of a whole row, staged (in the stream, the last
  # tile's stage is released to the producer once the copy has read it: on
  # the H200 that took 110 x 128 heads from 143.8 to 138.5 µs against
  # registers, 140 x 128 178.4 -> 172.4, 300 x 16 204.2 -> 190.1).
  stage_out = staged and direct
  stage_merged = staged and cluster_merge  # the result of a cluster's merge, staged
  last_stage = (num_tiles - 1) % NUM_STAGES
  q_heads = heads_padded if q_heads is None else q_heads
  head_groups = heads_padded // HEAD_TILE
  tail_heads = last_group_rows(q_heads, heads_padded)
  # Rows of the result: the real heads where the staged stores write them alone.
  out_heads = q_heads if stage_out or stage_merged else heads_padded

  def sparse_mla_decode_kernel(
      q_ref,  # [batch, q_heads, 576] bf16, GMEM
      cache_ref,  # [num_slots, 576] bf16, GMEM
      idx_ref,  # [batch, topk] int32, GMEM
      o_ref,  # [batch, (num_splits,) out_heads, 512], GMEM
      lse_ref,  # [batch, (num_splits,) out_heads] f32, GMEM
      *more_refs,  # cut_rows: [cut_rows, pieces, heads_padded, (512)] f32; cluster_merge:
      # [batch, num_splits, heads_padded, (512)] f32 (GMEM)
  ):
    g = lax.axis_index("g")
    split = lax.axis_index("s")
    b = lax.axis_index("b")
    num_slots = cache_ref.shape[0]

    def inside(ids):  # valid: an id of a cache slot; -1 and the rest are masked
      return (ids >= 0) & (ids < num_slots)

    heads = pl.ds(g * HEAD_TILE, HEAD_TILE)
    tok0 = split * (num_tiles * TILE)
    n_tiles = num_tiles  # this CTA's tiles: static, except with cut_rows
    whole = True
    if cut_rows and cluster_merge:
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
    if parts:
      # Part b's run of the batch's tiles (`stream.py`): rows [row_lo, row_hi).
      beg, end = part_bounds(b, total=batch * num_tiles, parts=parts)
      row_lo, row_hi = part_rows(beg, end, tiles=num_tiles)
      n_steps = end - beg

    def locate(j):
      """The CTA's tile j: its row and the tile's first index in the row."""
      if parts:
        t = beg + j
        return t // num_tiles, lax.rem(t, num_tiles) * TILE
      return b, tok0 + j * TILE

    def scoped(q_lat, k_lat, k_rope, p_smem, xchg, ids, stage_idx,
               q_bar, idx_bar, free_bar, sync_bar, q_free_bar,
               m0_bar, p0_bar, p1_bar, p0_free, p1_free, *extra_refs):
      # q_lat [2, 64, 256] bf16: the latent query; k_lat [stages, 2, 64, 256]
      # and k_rope [stages, 64, 64] bf16: the KV ring; p_smem [64, 64] bf16: P
      # of the tile (each consumer writes the 32 columns of its slots, for the
      # other); xchg [2, 64] f32: the maxima each consumer hands on (at the
      # end its row sums); m0_bar ... p1_free: `seesaw_barriers()`;
      # ids [IDX_STAGES, 64] int32: the producer's ring of slot ids;
      # stage_idx [stages, 64] int32: each stage's indices (invalid: masked);
      # extra_refs: compiled, landed [stages, 2] int32 (one mbarrier per
      # stage: its tile's copies landed) and in "multiply" scratch [4]
      # int32 (`gather.null_first_invalid`: a tile's first invalid id per
      # warp); interpreted, the RoPE query's buffer and ready_bar (a stage's
      # copies landed).
      # Compiled, the RoPE query lands in p_smem and moves to registers
      # before the first P is written (SMEM holds nothing more); the
      # interpreter keeps it in its own buffer.
      if cluster_merge and not compiled:
        *extra_refs, cluster_bar = extra_refs
      lse_stage = None
      if tail_heads < HEAD_TILE and out_heads < heads_padded:
        *extra_refs, lse_stage = extra_refs
      if stage_merged and compiled:
        # [2, 64, 512 / cluster_size] bf16: each consumer's piece of the
        # merged result, in the KV ring's bytes (dead after the cluster's
        # barrier).
        k_lat, merge_stage = k_lat
      elif stage_merged:
        *extra_refs, merge_stage = extra_refs
      if compiled:
        landed, *rest = extra_refs
        scratch = rest[0] if rest else None
        q_rope_smem, ready_bar, p_scratch = p_smem, None, None
      else:
        q_rope_smem, ready_bar, p_scratch = extra_refs
        landed = scratch = None
      wg = lax.axis_index("wg")

      @pl.when(wg == 2)
      def _producer():
        if tail_heads < HEAD_TILE:
          zero_query_rows(q_lat, q_rope_smem)
        plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
        if compiled:
          # Before the query's copy: the consumers' wait on it orders their
          # first wait on a stage after this.
          init_barriers(landed, arrivals=128)
        query = functools.partial(load_query, q_ref, g=g, head_groups=head_groups,
                                  tail_heads=tail_heads, q_lat=q_lat, q_rope=q_rope_smem,
                                  bar=q_bar)
        query(row_lo if parts else b)

        def fetch_ids(j):
          row, tok = locate(j)
          ring = lax.rem(j, IDX_STAGES)
          plgpu.copy_gmem_to_smem(
              idx_ref.at[row, pl.ds(tok, TILE)],
              ids.at[ring],
              idx_bar.at[ring],
          )

        for t in range(IDX_STAGES if parts else min(IDX_STAGES, num_tiles)):
          if cut_rows or parts:
            pl.when(t < n_steps)(lambda t=t: fetch_ids(t))
          else:
            fetch_ids(t)
        # An invalid id copies nothing (but in "multiply" the first of a
        # tile), so its row keeps what the stage held: finite bytes (zeros, or
        # a row this CTA gathered before), weighted exactly 0.
        if compiled:
          zero_fill(k_lat, k_rope, transforms=bf16)
        else:
          k_lat[...] = jnp.zeros(k_lat.shape, dtype)
          k_rope[...] = jnp.zeros(k_rope.shape, dtype)
        plgpu.commit_smem()

        def gather(j, stage, tile_ids):
          # The tile's indices travel with its rows: the consumers mask by them.
          row, tok = locate(j)
          tile_idx = idx_ref.at[row, pl.ds(tok, TILE)]
          if compiled:
            issue_gather(
                tile_ids, cache_ref, k_lat.at[stage], k_rope.at[stage],
                tile_idx, stage_idx.at[stage], landed.at[stage],
                tile=TILE, transforms=bf16,
            )
          else:
            ring = lax.rem(j, IDX_STAGES)
            plgpu.barrier_wait(idx_bar.at[ring])
            plgpu.copy_gmem_to_smem(tile_idx, stage_idx.at[stage], ready_bar.at[stage])

            if select:
              first = TILE
            else:  # the tile's first invalid id reads the null block
              col = lax.broadcasted_iota(jnp.int32, (TILE,), 0)
              first = jnp.min(jnp.where(inside(ids[ring]), TILE, col))

            @pl.loop(0, TILE)
            def _(r):
              sid = ids[ring, r]
              copy = inside(sid) | (r == first)

              @pl.when(copy)
              def _():
                src = cache_ref.at[pl.ds(jnp.where(inside(sid), sid, 0), 1)]
                for h in range(2):
                  plgpu.copy_gmem_to_smem(
                      src.at[:, pl.ds(h * HALF, HALF)],
                      k_lat.at[stage, h, pl.ds(r, 1)],
                      ready_bar.at[stage],
                  )
                plgpu.copy_gmem_to_smem(
                    src.at[:, pl.ds(LATENT, ROPE)],
                    k_rope.at[stage, pl.ds(r, 1)],
                    ready_bar.at[stage],
                )

              @pl.when(~copy)
              def _():
                for _ in range(3):  # the copies' arrivals
                  plgpu.barrier_arrive(ready_bar.at[stage])

        # Compiled, a stage is ready when its copies landed (each producer
        # thread's arrival on `landed` completes with them), so the producer
        # moves on as soon as the next stage is free and both stages can be
        # filling at once; interpreted, the copies arrive on `ready_bar`.
        def produce_tile(i):  # the CTA's tile i, of any segment
          stage = lax.rem(i, NUM_STAGES)
          # Compiled, the producer loads the tile's ids into registers (and
          # in "multiply" points the first invalid id at the null block,
          # `null_first_invalid`) before it waits for the tile's stage: that
          # runs while the consumers still read the stage, and the copies go
          # out as soon as it comes free.
          tile_ids = None
          if compiled:
            ring = lax.rem(i, IDX_STAGES)
            plgpu.barrier_wait(idx_bar.at[ring])
            tile_ids = row_ids(ids.at[ring], tile=TILE)
            if not select:
              tile_ids = null_first_invalid(tile_ids, scratch, tile=TILE, num_rows=num_slots)
          pl.when(i >= NUM_STAGES)(lambda: plgpu.barrier_wait(free_bar.at[stage]))
          gather(i, stage, tile_ids)
          # Every thread's reads of the tile's ids before their refill (the
          # interpreter has no inline barrier: commit_smem is one too).
          (warpgroup_barrier if compiled else plgpu.commit_smem)()
          pl.when(i + IDX_STAGES < n_steps)(lambda: fetch_ids(i + IDX_STAGES))

        if parts:
          def produce(row, carry):
            steps, segs = carry
            _, n = segment(row, beg, end, tiles=num_tiles)

            @pl.when(segs > 0)
            def _():
              # The row's first tile goes out while the consumers finish the
              # last row's; its query, once both are done with that one.
              produce_tile(steps)
              plgpu.barrier_wait(q_free_bar)
              query(row)

            pl.loop(jnp.minimum(segs, 1), n)(lambda i: produce_tile(steps + i))
            return steps + n, segs + 1

          lax.fori_loop(row_lo, row_hi, produce, (jnp.int32(0), jnp.int32(0)))
          plgpu.barrier_wait(q_free_bar)  # the last segment's release
        else:
          pl.loop(0, n_tiles)(produce_tile)

        # Observe the releases of the last tiles too, so that every barrier
        # phase is consumed before the barriers go away.
        if cut_rows or parts:
          for k in range(NUM_STAGES):
            i = n_steps - NUM_STAGES + k
            pl.when(i >= 0)(lambda i=i: plgpu.barrier_wait(free_bar.at[lax.rem(i, NUM_STAGES)]))
        else:
          for i in range(max(num_tiles - NUM_STAGES, 0), num_tiles):
            plgpu.barrier_wait(free_bar.at[i % NUM_STAGES])
        if cluster_merge and compiled:
          # Every thread of the cluster arrives (a cluster of whole rows
          # merges nothing and meets nowhere).
          if cut_rows:
            pl.when(~whole)(cluster_sync)
          else:
            cluster_sync()

      def consumer(wg: int):
        # `wg` is static: every SMEM slice below has a compile-time offset.
        plgpu.set_max_registers(CONSUMER_REGS, action="increase")
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        col_layout = plgpu.Layout.WGMMA.reduce(0)
        slots = pl.ds(wg * SLOT_HALF, SLOT_HALF)  # the slots whose scores are ours
        bars = (m0_bar, p0_bar, p1_bar, p0_free, p1_free)

        def tiles(n, steps, hold=None):
          """A segment's n tiles, the CTA's tiles `steps` on: (acc, m, l_own).
          Where `hold` (a traced bool), the last tile's stage is not released:
          the caller stages the result in it first."""
          plgpu.barrier_wait(q_bar)
          # The RoPE part of the query lives in registers (16 per thread).
          # (The interpreter cannot take a register operand for a wgmma into an
          # accumulator ref: it reads it from SMEM.)
          q_rope = plgpu.load(q_rope_smem, layout=plgpu.Layout.WGMMA) if compiled else q_rope_smem
          q_head = query_head(q_lat, q_regs, in_regs=compiled)
          step = functools.partial(tile_step, steps=steps, q_rope=q_rope, q_head=q_head,
                                   hold=None if hold is None else (hold, steps + n - 1))
          acc, _, l_i = softmax_start(HALF)
          m_i = plgpu.layout_cast(jnp.full((HEAD_TILE,), M_FLOOR, jnp.float32), row_layout)
          return lax.fori_loop(0, n, step, (acc, m_i, l_i))

        def tile_step(i, carry, *, steps, q_rope, q_head, hold=None):
          i = steps + i  # the CTA's tile
          stage = lax.rem(i, NUM_STAGES)
          if compiled:
            parity = lax.rem(i // NUM_STAGES, 2)
            for ph in range(2):
              pl.when(parity == ph)(
                  lambda ph=ph: wait_barrier(landed.at[stage], parity=ph)
              )
          else:
            plgpu.barrier_wait(ready_bar.at[stage])
          # Our slots' indices, from SMEM at the point of use (a loop-carried
          # prefetch from GMEM cost ~16%: see NOTES.md, v5-v6).
          idx = plgpu.load(stage_idx.at[stage, slots], layout=col_layout, optimized=False)

          s = tile_scores(q_lat, q_rope, k_lat, k_rope, stage, slots, q_head=q_head)
          valid = lax.broadcast_in_dim(inside(idx), s.shape, [1])
          s = jnp.where(valid, s * scale_log2, -jnp.inf)
          # m starts at a finite floor below any score, so a row with no
          # valid index so far gets p = exp2(-inf - floor) = 0, never NaN.
          pv = functools.partial(
              seesaw_pv, k_lat=k_lat, slot=stage, wg=wg, p_smem=p_smem, p_scratch=p_scratch
          )
          carry = seesaw_tile(wg, s, carry, pv=pv, xchg=xchg, p_smem=p_smem, bars=bars)
          if hold is None:
            plgpu.barrier_arrive(free_bar.at[stage])
          else:
            pl.when(~(hold[0] & (i == hold[1])))(lambda: plgpu.barrier_arrive(free_bar.at[stage]))
          return carry

        cols = pl.ds(wg * HALF, HALF)

        def store_result(o, lse, l_i, row=None, stage=last_stage):
          # The row's result, as `combine_splits` of one split gives it: 0
          # where no index is valid (also where "multiply" met NaN there).
          # (A whole row's last tile is in `last_stage`, with cut_rows too.)
          row = b if row is None else row
          has = lax.broadcast_in_dim(l_i > 0.0, o.shape, [0])
          res = jnp.where(has, o, 0.0).astype(out_dtype)
          if stage_out:
            # Our value half of the last stage: the other consumer's QK of
            # that tile (the only other reader) was done before its P came.
            stage_head_group(
                k_lat.at[stage, wg], res, lambda rows: o_ref.at[row, rows, cols], g,
                heads=heads, head_groups=head_groups, tail_heads=tail_heads, lse=lse,
                lse_at=lambda rows: lse_ref.at[row, rows], lse_buf=lse_stage,
                lse_when=wg == 0)
          else:
            o_ref[row, heads, cols] = res
            if wg == 0:
              lse_ref[row, heads] = lse

        def store_partial(o_dst, lse_dst, o, lse):
          # A last head group of fewer real heads stores their rows alone:
          # the combine reads no others.
          store_head_rows(o_dst.at[heads, cols], o, g, head_groups=head_groups,
                          tail_heads=tail_heads, compiled=compiled)
          if wg == 0:
            lse_dst[heads] = lse

        def merge_in_cluster(part_o, part_lse, o, lse):
          # The row's partials, part_o `[cluster_size, heads_padded, 512]`
          # and part_lse `[cluster_size, heads_padded]`: ours at `split`.
          merge_row(
              o, lse, part_o, part_lse, o_ref.at[b], lse_ref.at[b], wg=wg, split=split, g=g,
              cluster_size=cluster_size, head_groups=head_groups, tail_heads=tail_heads,
              select=select, out_dtype=out_dtype,
              cluster_bar=None if compiled else cluster_bar,
              stage_ref=merge_stage.at[wg] if stage_merged else None, lse_stage_ref=lse_stage)

        seesaw_begin(wg, bars)
        if parts:
          cut_o, cut_lse = more_refs

          def consume(row, steps):
            lo, n = segment(row, beg, end, tiles=num_tiles)
            whole = (lo == 0) & (n == num_tiles)
            acc, m_i, l_own = tiles(n, steps, hold=whole if stage_out else None)
            plgpu.barrier_arrive(q_free_bar)  # both QKs and PVs of the query are done
            l_i = seesaw_row_sums(wg, l_own, xchg, sync_bar, reuse=True)
            o, lse = softmax_finish(acc, m_i, l_i)
            tail = lo > 0  # piece 1 of the row cut at this part's start
            # (else piece 0 of the row cut at the next part's start)
            last = lax.rem(steps + n - 1, NUM_STAGES)  # the stage of the row's last tile

            @pl.when(whole)
            def _():
              store_result(o, lse, l_i, row=row, stage=last)
              if stage_out:  # the copy has read the stage: the producer may refill it
                plgpu.barrier_arrive(free_bar.at[last])

            cut = jnp.where(tail, b - 1, b)
            for k, when in enumerate((~whole & ~tail, tail)):
              pl.when(when)(lambda k=k: store_partial(
                  cut_o.at[jnp.clip(cut, 0, parts - 2), k],
                  cut_lse.at[jnp.clip(cut, 0, parts - 2), k], o, lse))
            return steps + n

          lax.fori_loop(row_lo, row_hi, consume, jnp.int32(0))
          seesaw_end(wg, bars)
          return
        acc, m_i, l_own = tiles(n_tiles, 0)
        seesaw_end(wg, bars)
        l_i = seesaw_row_sums(wg, l_own, xchg, sync_bar, reuse=False)
        o, lse = softmax_finish(acc, m_i, l_i)
        if cut_rows:
          cut_o, cut_lse = more_refs
          pl.when(whole)(lambda: store_result(o, lse, l_i))
          if cluster_merge:
            pl.when(~whole)(lambda: merge_in_cluster(cut_o.at[part], cut_lse.at[part], o, lse))
          else:
            pl.when(~whole)(lambda: store_partial(cut_o.at[part, piece], cut_lse.at[part, piece],
                                                  o, lse))
        elif cluster_merge:
          part_o, part_lse = more_refs
          merge_in_cluster(part_o.at[b], part_lse.at[b], o, lse)
        elif direct:
          store_result(o, lse, l_i)
        else:
          store_partial(o_ref.at[b, split], lse_ref.at[b, split], o, lse)

      for w in range(2):
        pl.when(wg == w)(lambda w=w: consumer(w))

    ring = plgpu.SMEM((NUM_STAGES, 2, TILE, HALF), dtype, transforms=bf16)  # k_lat
    if compiled:
      extra = [
          plgpu.SMEM((NUM_STAGES, 2), jnp.int32),
          *([] if select else [plgpu.SMEM((FIRST_INVALID_SCRATCH,), jnp.int32)]),
      ]
    else:
      # A stage is ready when the tile's 3 copies per row and its indices'
      # copy landed.
      extra = [
          plgpu.SMEM((HEAD_TILE, ROPE), dtype, transforms=bf16),
          plgpu.Barrier(num_arrivals=3 * TILE + 1, num_barriers=NUM_STAGES),
          seesaw_p_scratch(),
      ]
    # Each consumer's piece of a cluster's merged result, staged for TMA.
    merge_stage = plgpu.SMEM((2, HEAD_TILE, merge_cols), dtype,
                             transforms=bf16_tile(min(128, 2 * merge_cols)))
    if stage_merged and not compiled:
      # (Its own buffer: the interpreter's race detector takes a `RefUnion` for
      # one buffer, whose writes and earlier reads it would report.)
      extra.append(merge_stage)
    if tail_heads < HEAD_TILE and out_heads < heads_padded:
      extra.append(plgpu.SMEM((HEAD_TILE,), jnp.float32))  # the last group's LSE
    if cluster_merge and not compiled:
      # The interpreter has no `barrier.cluster`: each consumer arrives on
      # every CTA's barrier of the cluster.
      extra.append(plgpu.ClusterBarrier(collective_axes=("s",), num_arrivals=2))
    pl.run_scoped(
        scoped,
        plgpu.SMEM((2, HEAD_TILE, HALF), dtype, transforms=bf16),
        plgpu.RefUnion(ring, merge_stage) if stage_merged and compiled else ring,
        plgpu.SMEM((NUM_STAGES, TILE, ROPE), dtype, transforms=bf16),
        plgpu.SMEM((HEAD_TILE, TILE), dtype, transforms=bf16),
        plgpu.SMEM((2, HEAD_TILE), jnp.float32),
        plgpu.SMEM((IDX_STAGES, TILE), jnp.int32),
        plgpu.SMEM((NUM_STAGES, TILE), jnp.int32),
        plgpu.Barrier(num_arrivals=3),
        plgpu.Barrier(num_arrivals=1, num_barriers=IDX_STAGES),
        plgpu.Barrier(num_arrivals=2, num_barriers=NUM_STAGES),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=2),
        *seesaw_barriers(),
        *extra,
        collective_axes="wg",
    )

  # No automatic barriers: each cross-thread hazard above is ordered by an
  # explicit commit_smem or an mbarrier.
  result = (jax.ShapeDtypeStruct((batch, out_heads, LATENT), out_dtype),
            jax.ShapeDtypeStruct((batch, out_heads), jnp.float32))
  if cluster_merge and not cut_rows:
    out_type = (*result, *split_outputs(batch, num_splits, heads_padded))
  elif parts:
    out_type = (*result, *split_outputs(parts - 1, 2, heads_padded))
  elif direct:
    out_type = (*result, *(split_outputs(cut_rows, pieces, heads_padded) if cut_rows else ()))
  else:
    out_type = split_outputs(batch, num_splits, heads_padded)
  # With cluster_merge the splits (or two CTAs: two whole rows, or a cut
  # row's halves) are the cluster's axis, its CTAs side by side.
  rows = (batch + cut_rows) // 2 if cluster_merge and cut_rows else (
      parts or batch + (pieces - 1) * cut_rows)
  return launch(
      sparse_mla_decode_kernel,
      grid=(rows, *(() if cluster_merge else (num_splits,)), heads_padded // HEAD_TILE),
      grid_names=("b", *(() if cluster_merge else ("s",)), "g"),
      cluster=(cluster_size,) if cluster_merge else (),
      cluster_names=("s",) if cluster_merge else (),
      out_type=out_type,
      kernel_name="jaxkv_sparse_mla_decode",
      interpret=interpret,
  )
