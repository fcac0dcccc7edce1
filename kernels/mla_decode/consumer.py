"""A consumer warpgroup of dense MLA decode: each tile's scores (masked in a
segment's last tile), the seesaw's softmax and PV, and each segment's partial
or finished row (`kernel.py` says how)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .cta import CONSUMER_REGS, Launch, Part, Smem
from .layout import (
    CLEAN_COLS,
    HALF,
    HEAD_TILE,
    NUM_STAGES,
    SLOT_HALF,
    TILE,
    scaled_half,
    stage_head_group,
    store_head_rows,
)
from .seesaw import (
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


def consume(wg: int, launch: Launch, cta: Part, smem: Smem, o_ref, lse_ref, scale_ref,
            finished) -> None:
  """Consumer `wg`'s whole run over the part's row segments (static `wg`:
  every SMEM slice below has a compile-time offset).

  o_ref and lse_ref are the partials (with float16 partials scale_ref their
  scales, else None), `finished` the rows finished here (`kernel.build_kernel`'s
  outputs), GMEM.
  """
  compiled, block_size, select = launch.compiled, launch.block_size, launch.select
  tile_regions, partial_cols, g, heads = launch.tile_regions, launch.partial_cols, cta.g, cta.heads
  k_lat, p_smem, xchg, free_bar = smem.k_lat, smem.p_smem, smem.xchg, smem.free_bar
  plgpu.set_max_registers(CONSUMER_REGS, action="increase")
  own = pl.ds(wg * SLOT_HALF, SLOT_HALF)  # the slots whose scores are ours
  bars = smem.bars

  def clean_values(slot, n_keep):
    # Zeroes the value rows from `n_keep` on in our 256 channels (all 64
    # slots; called once both QKs of the tile are done): p = 0 alone
    # cannot stop 0 * NaN from reaching the accumulator. 64 channels at
    # a time: 16 registers, not 64, beside the accumulator.
    @pl.when(n_keep < TILE)
    def _():
      r = plgpu.broadcasted_iota(
          jnp.int32, (TILE, CLEAN_COLS), 0, layout=plgpu.Layout.WGMMA
      )
      for c in range(HALF // CLEAN_COLS):
        v_ref = k_lat.at[slot, wg, :, pl.ds(c * CLEAN_COLS, CLEAN_COLS)]
        v = plgpu.load(v_ref, layout=plgpu.Layout.WGMMA)
        v_ref[...] = jnp.where(r < n_keep, v, jnp.zeros_like(v))
    plgpu.commit_smem()  # the wgmmas below read the cleaned rows

  def tile(i, carry, slot, *, row, lo, q_rope, q_head, last: bool):
    """One 64-slot tile: our half's scores (masked in a segment's last
    tile), then `seesaw_tile`. `carry` is (acc, m, l)."""
    acc, m_i, l_i = carry
    with region_scope(tile_regions)("qk"):
      s = tile_scores(smem.q_lat, q_rope, k_lat, smem.k_rope, slot, own, q_head=q_head)
    if last:
      # Slots of this tile that hold tokens of the row; the rest (the
      # unwritten tail of the row's last block, and at block size 32 a
      # repeat of that block) is masked by select in both modes.
      n_valid = cta.seq_len(row) - (lo + i) * TILE
      col = plgpu.broadcasted_iota(
          jnp.int32, (HEAD_TILE, SLOT_HALF), 1, layout=plgpu.Layout.WGMMA
      )
      s = jnp.where(col + wg * SLOT_HALF < n_valid, s * launch.scale_log2, -jnp.inf)
      # "select" keeps the row's tokens only; "multiply" keeps the
      # whole of the row's last block (its unwritten tail too, as
      # production kernels do), never the repeat past it.
      if select:
        n_keep = n_valid
      else:
        n_keep = (n_valid + block_size - 1) // block_size * block_size
      clean = select or block_size < TILE
    else:
      s = s * launch.scale_log2
      clean = False
    pv = tile_pv(whole=launch.whole_pv, k_lat=k_lat, slot=slot, wg=wg, p_smem=p_smem,
                 p_scratch=smem.p_scratch, compiled=compiled)
    acc, m_new, l_i = seesaw_tile(
        wg, s, (acc, m_i, l_i), pv=pv, xchg=xchg, p_smem=p_smem, bars=bars,
        clean=functools.partial(clean_values, slot, n_keep) if clean else None,
        whole_pv=launch.whole_pv, fence=launch.fence_all or last, regions=tile_regions,
    )
    if not (last and launch.staged_partials):
      # (A segment's last stage stays ours until `finish` has stored
      # the float16 partial through it.)
      plgpu.barrier_arrive(free_bar.at[slot])
    if last:
      # The segment's last QK and PV are done: the producer may load
      # the next segment's query.
      plgpu.barrier_arrive(smem.q_free_bar)
    return acc, m_new, l_i

  def consume_row(row, steps):
    lo, n, split, whole = cta.segment(row)

    @pl.when(n > 0)
    def _():
      with jax.named_scope("query_wait"):
        plgpu.barrier_wait(smem.q_bar)
      # The RoPE part of the query lives in registers (16 per thread).
      # (The interpreter cannot take a register operand for a wgmma
      # into an accumulator ref: it reads it from SMEM.)
      if compiled:
        q_rope = plgpu.load(smem.q_rope_smem, layout=plgpu.Layout.WGMMA)
      else:
        q_rope = smem.q_rope_smem
      q_head = query_head(smem.q_lat, launch.q_regs, in_regs=compiled)

      def step(i, carry, *, last: bool):
        slot = lax.rem(steps + i, NUM_STAGES)
        with jax.named_scope("kv_wait"):
          plgpu.barrier_wait(smem.kv_bar.at[slot])
        with jax.named_scope("last_tile" if last else "tile"):
          return tile(i, carry, slot, row=row, lo=lo, q_rope=q_rope, q_head=q_head, last=last)

      carry = lax.fori_loop(
          0, n - 1, functools.partial(step, last=False), softmax_start(HALF)
      )
      acc, m_i, l_own = step(n - 1, carry, last=True)
      slot = lax.rem(steps + n - 1, NUM_STAGES)
      with jax.named_scope("epilogue"):
        finish(row, split, whole, acc, m_i, l_own, slot)
      if launch.staged_partials:  # the stage `tile` kept for the staged partial
        plgpu.barrier_arrive(free_bar.at[slot])

    return steps + n

  def finish(row, split, whole, acc, m_i, l_own, slot):
    # The exchange rows serve the next segment's maxima too.
    with jax.named_scope("row_sums"):
      l_i = seesaw_row_sums(wg, l_own, xchg, smem.sync_bar, reuse=True)
    o, lse = softmax_finish(acc, m_i, l_i)
    cols = pl.ds(wg * HALF, HALF)

    def store(dst, value):
      # A last head group of fewer real heads stores their rows alone
      # (the merge reads no others).
      store_head_rows(dst, value, g, head_groups=launch.head_groups,
                      tail_heads=launch.tail_heads, compiled=compiled)

    @jax.named_scope("store")
    def partial():
      if launch.staged_partials:
        staged_f16(o)
      elif partial_cols is None:
        store(o_ref.at[row, split, heads, cols], o)
      else:  # this half's channels, partial_cols at a time
        value = o
        if launch.f16_partials:
          # From registers: at 8 channels a slice's rows are 16 bytes and
          # one warp store covers 128 contiguous bytes (NOTES.md).
          value, scale = scaled_half(o)
          scale_ref[row, g, wg, split] = scale
        per = HALF // partial_cols
        for k in range(per):
          store(o_ref.at[row, wg * per + k, g, split],
                value[:, k * partial_cols:(k + 1) * partial_cols])
      if wg == 0:
        if partial_cols is None:
          lse_ref[row, split, heads] = lse
        else:
          lse_ref[row, g, split] = lse

    def staged_f16(o):
      # Scaled to float16 (`scaled_half`) and stored by TMA through our
      # value half of the segment's last stage: its other reader, the
      # other consumer's QK of that tile, was done before its P reached
      # us. Whole rows by TMA, where float16 from registers would fill
      # half of each 32-byte sector a warp store touches (NOTES.md).
      bits, scale = scaled_half(o)
      scale_ref[row, split, wg, heads] = scale
      out_at = lambda rows: o_ref.at[row, split, rows, cols]
      stage_head_group(k_lat.at[slot, wg], bits, out_at, g, heads=heads,
                       head_groups=launch.head_groups, tail_heads=launch.tail_heads)

    if whole is None:
      partial()
      return

    @pl.when(whole)
    def _():
      # The row's result: no f32 partial, no merge.
      out_ref, lse_out_ref = finished
      out_ref[row, heads, cols] = o.astype(jnp.bfloat16)
      if wg == 0:
        lse_out_ref[row, heads] = lse

    pl.when(~whole)(partial)

  seesaw_begin(wg, bars)
  lax.fori_loop(cta.row_lo, cta.row_hi, consume_row, jnp.int32(0))
  seesaw_end(wg, bars)
