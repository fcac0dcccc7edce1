"""A consumer warpgroup of sparse MLA decode: each tile's scores, masked by its
ids, the seesaw's softmax and PV, and the CTA's result or partials
(`kernel.py` says how)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode.layout import (
    HALF,
    HEAD_TILE,
    NUM_STAGES,
    SLOT_HALF,
    scaled_half,
    stage_head_group,
    store_head_rows,
)
from jaxkv.kernels.mla_decode.seesaw import (
    fences_every_p,
    query_head,
    region_scope,
    seesaw_begin,
    seesaw_end,
    seesaw_row_sums,
    seesaw_tile,
    softmax_finish,
    softmax_start,
    tile_pv,
    tile_scores,
)
from jaxkv.kernels.sparse_mla_decode.cluster import merge_row
from jaxkv.kernels.sparse_mla_decode.cta import CONSUMER_REGS, Cta, Launch, Smem
from jaxkv.kernels.sparse_mla_decode.gather import wait_barrier

# The running maximum's start: finite and below any score (|q.k| * scale is
# far smaller), so that masked scores (-inf) give exp2(-inf - M_FLOOR) = 0.
M_FLOOR = -1e30


def consume(wg: int, launch: Launch, cta: Cta, smem: Smem, o_ref, lse_ref, more_refs) -> None:
  """Consumer `wg`'s whole run (static `wg`: every SMEM slice below has a
  compile-time offset).

  o_ref and lse_ref are the kernel's first two outputs and `more_refs` the
  others (`kernel.build_kernel`), GMEM.
  """
  f16 = launch.f16_partials
  compiled, parts, cut_rows = launch.compiled, launch.parts, launch.cut_rows
  stage_out, num_tiles, b, g = launch.stage_out, launch.num_tiles, cta.b, cta.g
  heads, k_lat, xchg, free_bar = cta.heads, smem.k_lat, smem.xchg, smem.free_bar
  head_groups, tail_heads = launch.head_groups, launch.tail_heads
  plgpu.set_max_registers(CONSUMER_REGS, action="increase")
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  slots = pl.ds(wg * SLOT_HALF, SLOT_HALF)  # the slots whose scores are ours
  bars = smem.bars
  # P fenced toward the async proxy per tile (else once a stream's segment ends, below).
  p_fence = fences_every_p(whole=launch.whole_pv, compiled=compiled)

  def tiles(n, steps, hold=None):
    """A segment's n tiles, the CTA's tiles `steps` on: (acc, m, l_own).
    Where `hold` (a traced bool), the last tile's stage is not released:
    the caller stages the result in it first."""
    with jax.named_scope("query_wait"):
      plgpu.barrier_wait(smem.q_bar)
    # The RoPE part of the query lives in registers (16 per thread).
    # (The interpreter cannot take a register operand for a wgmma into an
    # accumulator ref: it reads it from SMEM.)
    q_rope = (plgpu.load(smem.q_rope_smem, layout=plgpu.Layout.WGMMA) if compiled
              else smem.q_rope_smem)
    q_head = query_head(smem.q_lat, launch.q_regs, in_regs=compiled)
    step = functools.partial(tile_step, steps=steps, q_rope=q_rope, q_head=q_head,
                             hold=None if hold is None else (hold, steps + n - 1))
    acc, _, l_i = softmax_start(HALF)
    m_i = plgpu.layout_cast(jnp.full((HEAD_TILE,), M_FLOOR, jnp.float32), row_layout)
    return lax.fori_loop(0, n, step, (acc, m_i, l_i))

  def tile_step(i, carry, *, steps, q_rope, q_head, hold=None):
    i = steps + i  # the CTA's tile
    stage = lax.rem(i, NUM_STAGES)
    with jax.named_scope("kv_wait"):
      if compiled:
        parity = lax.rem(i // NUM_STAGES, 2)
        for ph in range(2):
          pl.when(parity == ph)(
              lambda ph=ph: wait_barrier(smem.landed.at[stage], parity=ph)
          )
      else:
        plgpu.barrier_wait(smem.ready_bar.at[stage])
    with jax.named_scope("tile"):
      return _tile_body(i, stage, carry, q_rope=q_rope, q_head=q_head, hold=hold)

  def _tile_body(i, stage, carry, *, q_rope, q_head, hold):
    # Our slots' indices, from SMEM at the point of use (a loop-carried
    # prefetch from GMEM cost ~16%: see NOTES.md, v5-v6).
    idx = plgpu.load(smem.stage_idx.at[stage, slots], layout=col_layout, optimized=False)

    with region_scope(launch.tile_regions)("qk"):
      s = tile_scores(smem.q_lat, q_rope, k_lat, smem.k_rope, stage, slots, q_head=q_head)
    valid = lax.broadcast_in_dim(cta.inside(idx), s.shape, [1])
    s = jnp.where(valid, s * launch.scale_log2, -jnp.inf)
    # m starts at a finite floor below any score, so a row with no
    # valid index so far gets p = exp2(-inf - floor) = 0, never NaN.
    pv = tile_pv(whole=launch.whole_pv, k_lat=k_lat, slot=stage, wg=wg, p_smem=smem.p_smem,
                 p_scratch=smem.p_scratch, compiled=compiled)
    carry = seesaw_tile(wg, s, carry, pv=pv, xchg=xchg, p_smem=smem.p_smem, bars=bars,
                        whole_pv=launch.whole_pv, fence=p_fence, regions=launch.tile_regions)
    if hold is None:
      plgpu.barrier_arrive(free_bar.at[stage])
    else:
      pl.when(~(hold[0] & (i == hold[1])))(lambda: plgpu.barrier_arrive(free_bar.at[stage]))
    return carry

  cols = pl.ds(wg * HALF, HALF)

  def store_result(o, lse, l_i, row=None, stage=launch.last_stage):
    # The row's result, as `combine_splits` of one split gives it: 0
    # where no index is valid (also where "multiply" met NaN there); NaN
    # where a valid slot or the query is (l NaN).
    # (A whole row's last tile is in `last_stage`, with cut_rows too.)
    row = b if row is None else row
    has = lax.broadcast_in_dim(l_i != 0.0, o.shape, [0])
    res = jnp.where(has, o, 0.0).astype(launch.out_dtype)
    if stage_out:
      # Our value half of the last stage: the other consumer's QK of
      # that tile (the only other reader) was done before its P came.
      stage_head_group(
          k_lat.at[stage, wg], res, lambda rows: o_ref.at[row, rows, cols], g,
          heads=heads, head_groups=head_groups, tail_heads=tail_heads, lse=lse,
          lse_at=lambda rows: lse_ref.at[row, rows], lse_buf=smem.lse_stage,
          lse_when=wg == 0)
    else:
      o_ref[row, heads, cols] = res
      if wg == 0:
        lse_ref[row, heads] = lse

  def store_partial(o_dst, lse_dst, o, lse, scale_dst=None, stage=None):
    # A last head group of fewer real heads stores their rows alone:
    # the combine reads no others.
    if f16:
      # Scaled to float16 (`scaled_half`), with its scale from registers, and
      # stored by TMA through our value half of the tile's `stage`, as a
      # whole row's result is (`store_result`), in whole rows.
      bits, scale = scaled_half(o)
      scale_dst[wg, heads] = scale
      stage_head_group(k_lat.at[stage, wg], bits, lambda rows: o_dst.at[rows, cols], g,
                       heads=heads, head_groups=head_groups, tail_heads=tail_heads)
    else:
      store_head_rows(o_dst.at[heads, cols], o, g, head_groups=head_groups,
                      tail_heads=tail_heads, compiled=compiled)
    if wg == 0:
      lse_dst[heads] = lse

  def merge_in_cluster(part_o, part_lse, o, lse):
    # The row's partials, part_o `[cluster_size, heads_padded, 512]`
    # and part_lse `[cluster_size, heads_padded]`: ours at `split`.
    merge_row(
        o, lse, part_o, part_lse, o_ref.at[b], lse_ref.at[b], wg=wg, split=cta.split, g=g,
        cluster_size=launch.cluster_size, head_groups=head_groups, tail_heads=tail_heads,
        select=launch.select, out_dtype=launch.out_dtype,
        cluster_bar=None if compiled else smem.cluster_bar,
        stage_ref=smem.merge_stage.at[wg] if launch.stage_merged else None,
        lse_stage_ref=smem.lse_stage)

  seesaw_begin(wg, bars)
  if parts:
    cut_o, cut_lse, *cut_scale = more_refs
    stream = launch.stream

    def consume_row(beg, end, row, steps):
      lo, n = stream.segment(row, beg, end)
      whole = (lo == 0) & (n == num_tiles)
      # The last tile's stage is kept for what goes out through it: a whole
      # row's staged result, a cut row's float16 piece.
      hold = None
      if stage_out or f16:
        hold = (whole if stage_out else False) | (~whole if f16 else False)
      acc, m_i, l_own = tiles(n, steps, hold=hold)
      with jax.named_scope("epilogue"):
        if not p_fence:
          # The next segment's RoPE query lands in P's tile by TMA: our last
          # P writes go to the async proxy before we release it.
          plgpu.commit_smem()
        plgpu.barrier_arrive(smem.q_free_bar)  # both QKs and PVs of the query are done
        l_i = seesaw_row_sums(wg, l_own, xchg, smem.sync_bar, reuse=True)
        o, lse = softmax_finish(acc, m_i, l_i)
        last = lax.rem(steps + n - 1, NUM_STAGES)  # the stage of the row's last tile

        @pl.when(whole)
        def _():
          store_result(o, lse, l_i, row=row, stage=last)
          if stage_out:  # the copy has read the stage: the producer may refill it
            plgpu.barrier_arrive(free_bar.at[last])

        @pl.when(~whole)
        def _():  # a piece of a leftover row: `[row's index among them, piece]`
          at = (jnp.clip(row - stream.first_left_row, 0, cut_o.shape[0] - 1),
                jnp.clip(stream.piece(b, row), 0, cut_o.shape[1] - 1))
          store_partial(cut_o.at[at], cut_lse.at[at], o, lse,
                        scale_dst=cut_scale[0].at[at] if f16 else None, stage=last)
          if f16:  # the copy has read the stage: the producer may refill it
            plgpu.barrier_arrive(free_bar.at[last])

      return steps + n

    steps = jnp.int32(0)
    for beg, end in cta.runs:  # the whole rows, then the leftover run
      steps = lax.fori_loop(*stream.run_rows(beg, end),
                            functools.partial(consume_row, beg, end), steps)
    seesaw_end(wg, bars)
    return
  acc, m_i, l_own = tiles(cta.n_tiles, 0)
  seesaw_end(wg, bars)
  with jax.named_scope("epilogue"):
    l_i = seesaw_row_sums(wg, l_own, xchg, smem.sync_bar, reuse=False)
    o, lse = softmax_finish(acc, m_i, l_i)
    whole, part = cta.whole, cta.part
    # A split's or piece's last stage: no tile of the CTA's comes after it, so
    # the producer refills it no more (float16 partials go out through it).
    last = lax.rem(cta.n_tiles - 1, NUM_STAGES)
    if cut_rows:
      cut_o, cut_lse, *cut_scale = more_refs
      pl.when(whole)(lambda: store_result(o, lse, l_i))
      if launch.cluster_merge:
        pl.when(~whole)(lambda: merge_in_cluster(cut_o.at[part], cut_lse.at[part], o, lse))
      else:
        pl.when(~whole)(lambda: store_partial(
            cut_o.at[part, cta.piece], cut_lse.at[part, cta.piece], o, lse,
            scale_dst=cut_scale[0].at[part, cta.piece] if f16 else None, stage=last))
    elif launch.cluster_merge:
      part_o, part_lse = more_refs
      merge_in_cluster(part_o.at[b], part_lse.at[b], o, lse)
    elif launch.direct:
      store_result(o, lse, l_i)
    else:
      store_partial(o_ref.at[b, cta.split], lse_ref.at[b, cta.split], o, lse,
                    scale_dst=more_refs[0].at[b, cta.split] if f16 else None, stage=last)
