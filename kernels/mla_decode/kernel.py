"""Mosaic GPU body of dense paged MLA decode: persistent CTAs over balanced parts.

The plan cuts the step's tiles (64 slots: a cache block at block size 64,
half of one at 128, two at 32), all rows laid end to end, into contiguous
parts of equal cost (tiles plus an overhead per row segment; FlashMLA's
tile-scheduler metadata does the same). One CTA per (part,
head group) walks its part row segment by row segment: a segment is a row's
tiles inside the part, and yields one normalised partial result (O and LSE)
of that row, its split. The two head groups of a part are adjacent CTAs, so
the second reads its blocks from L2.

Three warpgroups per CTA. Warpgroup 2 is the TMA producer: per segment it
loads the row's 64-head query tile (once the consumers are done with the
previous one) and streams the segment's KV tiles (one 64x576 tile per step,
three TMA copies of 256 + 256 + 64 channels per cache block in it) through a
two-stage ring that runs on across segments. Warpgroups 0 and 1 consume and
split every tile (below: block) two ways. Scores by slots: warpgroup w
computes S_w = Q K^T for slots [32w, 32w + 32) of the block ([64, 32], 576
deep). Values by channels: warpgroup w accumulates O[:, 256w:256w+256] over
all 64 slots (a 64x256 f32 accumulator; 64x512 does not fit one warpgroup).
The two halves of a block meet in FlashMLA's "seesaw" order (`seesaw.py`,
shared with sparse decode; the geometry, the query's copies and the launch
are in `layout.py`): warpgroup 0 folds its half into the running maximum
first and hands the new maximum on; warpgroup 1 folds its half in after it. Each multiplies its own half's P
(from registers) into its channels at once and the other half's P (through
one shared [64, 64] bf16 tile, warpgroup 0's rescaled to warpgroup 1's
maximum) when it arrives, so one warpgroup's softmax runs beside the
other's wgmma instead of both meeting twice per block. Each warpgroup's row
sum covers its own slots, at the common scale; the two are added at the
end. In the base layout (`kv_swizzle=64`, the config field's own default;
the devices' default configs take 128) all bf16 tiles are 32 columns wide (64-byte
swizzle), since wgmma takes A and B under the same transforms and P's halves
are 32 wide. With `kv_swizzle=128` the query and KV ring are 64 columns wide
(128-byte swizzle: TMA streams 128-byte rows, faster), and since wgmma then
takes K in steps of 64 each warpgroup multiplies the whole P in at once,
both halves at warpgroup 1's maximum. With `q_regs`, each consumer also holds
the query's first latent channels in registers for its QK. KV bytes are
read once per head group. Only the last block of a segment can be partial:
it is peeled out of the loop and alone pays for masking.

Each segment's result is its partial result (normalised, with its
natural-log LSE), which the merge combines with the row's other splits into
the output: float32 stored from registers, or with `f16_partials` float16
scaled by a power of two per row and channel half, staged in the consumer's
value half of the segment's last KV stage and stored by TMA (that stage is
released once the copy has read it), or for the grouped merge stored from
registers in its column slices. Where the plan's
parts are longer than its rows (`finish_rows`), a segment that covers its
whole row (the row's only split) is the row's result instead: it goes to the
output in bf16 with its LSE (from registers), and the merge does not touch it.
Splits that no segment produced are never written: the plan's bounds say
which exist.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .config import KV_SWIZZLES, Q_REGS, check_choice
from .consumer import consume
from .cta import Launch, Part, Smem
from .layout import (
    HALF,
    HEAD_TILE,
    LATENT,
    LOG2E,
    NUM_STAGES,
    ROPE,
    TILE,
    bf16_tile,
    last_group_rows,
    launch,
    split_outputs,
)
from .producer import produce
from .seesaw import fences_every_p, seesaw_barriers, seesaw_p_scratch, seesaw_scratch

BLOCK_SIZES = (32, 64, 128)  # cache block sizes the kernel reads
# Named regions of the in-kernel profile (see `build_kernel(profile_dir=)`).
REGIONS = (
    "kv_wait", "tile", "last_tile", "query_wait", "epilogue",  # consumers
    "qk", "handoff_wait", "pv",  # consumers, inside "tile" / "last_tile"
    "row_sums", "store",  # consumers, inside "epilogue"
    "stage_wait", "issue", "query_free_wait",  # producer
)


def build_kernel(
    *,
    batch: int,
    heads_padded: int,
    num_parts: int,
    num_splits: int,
    block_size: int,
    sm_scale: float,
    select: bool,
    interpret,
    finish_rows: bool = False,
    profile_dir: str | None = None,
    kv_swizzle: int = 64,
    q_regs: int = 0,
    partial_cols: int | None = None,
    p_fence: bool | None = None,
    tile_regions: bool = True,
    q_heads: int | None = None,
    f16_partials: bool = False,
):
  """Builds the kernel call.

  Returns a function `(q, cache, block_table, seq_lens, row_start, part_rows,
  part_start, row_part) -> (o, lse)`, with `f16_partials` `-> (o, lse,
  scale)`, and with `finish_rows` also `out, lse_out` last, with q `[batch,
  heads_padded, 576]` bf16, cache
  `[num_blocks, block_size, 576]` bf16, block_table `[batch, max_blocks]`
  int32, seq_lens `[batch]` int32 (clipped here to the table), row_start
  `[batch + 1]` int32 (each row's first tile in the step's concatenation of
  rows), part_rows `[num_parts, 2]` int32 (the rows `[first, end)` a part
  touches), part_start `[num_parts + 1]` int32 (each part's first tile in the
  concatenation), row_part `[batch]` int32 (the part holding each row's first
  tile: a segment's split is its part's offset from there), o `[batch, num_splits,
  heads_padded, 512]` f32 and lse `[batch, num_splits, heads_padded]` f32
  (written where a segment exists; with `finish_rows`, only for the splits
  of rows cut into several), out `[batch, heads_padded, 512]` bf16 and lse_out
  `[batch, heads_padded]` f32 (written only for rows that one segment covers
  whole: split 0, from the row's first tile to its last; the merge writes
  every other row, `merge_tiling.kernel_wrote_row`). `finish_rows` pays where parts
  are longer than rows (128 heads at 4K-8K: half the rows whole, whose f32
  round trip and merge it saves); where few rows are whole, the branch in the
  epilogue cost 1-4% on the H200 (kernels/mla_decode/NOTES.md).

  The kernel walks a row in tiles of 64 slots: a block of 64 is one tile, a
  block of 128 two (its halves), and a tile of 32-slot blocks two blocks
  (the second one the row's last block again where the row ends inside the
  tile; masked in both modes, never the padding's null block).

  With `profile_dir` (compiled calls only), every call also writes a trace
  of the `REGIONS` each warpgroup of each CTA went through (Mosaic GPU's
  profiler, SM clock cycles; `benchmarks/profile_mla_decode.py` reads it).
  A warpgroup records at most `PROFILE_RANGES` of them: `tile_regions=False`
  leaves out the regions inside a tile ("qk", "handoff_wait", "pv"), so that
  CTAs of ~80 tiles fit.

  `kv_swizzle` (one of `config.KV_SWIZZLES`) is the byte width of the
  swizzle of the query and the KV ring in SMEM. At 64 (32-column tiles) each
  TMA copy moves 64-byte rows and each consumer multiplies P into its values
  in two 32-slot halves, its own beside the other's softmax
  (`seesaw_tile`). At 128 (64-column tiles) the copies move 128-byte rows,
  which stream ~29% faster from HBM into a two-stage ring
  (`benchmarks/probe_multicast.py`); wgmma then takes K in steps of 64, so
  each consumer's PV runs once per tile, over both halves of P.

  `q_regs` (one of `config.Q_REGS`): how many of the query's latent channels
  (from channel 0) each consumer keeps in registers for a segment and feeds
  its QK's wgmmas from there (`tile_scores(q_head=)`), so that the QK, bound
  by its SMEM reads (both consumers read all of Q every tile), reads that
  much less; `q_regs / 4` registers per thread beside the accumulator.

  `partial_cols` (the grouped merge's channels per CTA, a multiple of 8
  dividing 256): o comes back as `[batch, 512 / partial_cols, heads_padded /
  64, num_splits, 64, partial_cols]` and lse as `[batch, heads_padded / 64,
  num_splits, 64]` (`split_outputs`), so that what one merge CTA reads is
  one contiguous run of GMEM each.

  `q_heads`: the query's own heads (q is `[batch, q_heads, 576]`), when fewer
  than `heads_padded` and a multiple of 8 (the query tile's row groups): the
  last head group's copies then bring its `q_heads - (heads_padded - 64)` real
  rows alone, into the first rows of the query's SMEM tiles, whose other rows
  the producer zeroes once before the first copy (no copy writes them again;
  a padded row's scores, softmax and partial stay in that row, as every
  wgmma row and softmax row is its own). This saves the caller's pad of q to
  64 heads (an XLA op of its own per call). The partials keep
  `heads_padded` rows, but in the last head group only its real rows are
  written (`layout.store_head_rows`: compiled, in whole warps' 16 rows),
  and the merge reads no others. None: q is padded already.

  `f16_partials`: each consumer stores its half of a segment's partial O as
  `layout.scaled_half` gives it, float16 (its bits in a bfloat16 array)
  divided by the least power of two at or above the half row's largest |o|,
  so nothing overflows float16 and NaN stays NaN; the scale is a third
  output (`layout.split_outputs(f16=True)`). With `partial_cols` None the
  half goes through the consumer's own value half of the segment's last
  stage (the other consumer's QK of that tile, its only other reader, was
  done before its P came) and out by one TMA copy of whole rows; the stage
  is released once the copy has read it: from registers, float16 rows of
  1 KB fill half of each 32-byte sector a warp store touches, which bought
  nothing (kernels/mla_decode/NOTES.md). With `partial_cols` (whose slices
  a TMA copy cannot read out of the stage's swizzled tiles) its column
  slices go out from registers: at 8 channels a slice's 16-byte rows make
  each warp store 128 contiguous bytes. Half the partials' bytes for the
  kernel and the merge.

  `p_fence`: whether each consumer fences its P half (and maximum) toward the
  async proxy before handing it on. The other warpgroup's wgmma reads P from
  SMEM under the 64-byte swizzle and in the interpreter, which needs the
  fence; compiled under the 128-byte swizzle it loads P into registers with
  plain loads, which the seesaw's barriers order (every thread arrives with
  release semantics), so there only a segment's last tile fences (the next
  segment's RoPE query lands in P's tile by TMA). None: that rule; True:
  every tile fences.
  """
  assert block_size in BLOCK_SIZES
  q_heads = heads_padded if q_heads is None else q_heads
  tail_heads = last_group_rows(q_heads, heads_padded)
  head_groups = heads_padded // HEAD_TILE
  assert partial_cols is None or (partial_cols % 8 == 0 and HALF % partial_cols == 0)
  if profile_dir and interpret is not None:
    raise ValueError("profile_dir needs a compiled kernel (interpret=None)")
  check_choice("kv_swizzle", kv_swizzle, KV_SWIZZLES)
  check_choice("q_regs", q_regs, Q_REGS)
  whole_pv = kv_swizzle == 128
  # P travels to a wgmma's SMEM operand (the async proxy) unless compiled
  # under the 128-byte swizzle (`p_fence` above).
  fence_all = (fences_every_p(whole=whole_pv, compiled=interpret is None) if p_fence is None
               else p_fence)
  # TMA copies per tile: (a latent half, a latent half, RoPE) per block piece.
  pieces = max(TILE // block_size, 1)
  dtype = jnp.bfloat16
  compiled = interpret is None
  static = Launch(
      batch=batch, num_splits=num_splits, block_size=block_size, select=select,
      compiled=compiled, finish_rows=finish_rows, q_regs=q_regs,
      scale_log2=float(sm_scale) * LOG2E, head_groups=head_groups, tail_heads=tail_heads,
      partial_cols=partial_cols, whole_pv=whole_pv, fence_all=fence_all,
      tile_regions=tile_regions, pieces=pieces, piece_slots=min(block_size, TILE),
      f16_partials=f16_partials)

  def mla_decode_kernel(
      q_ref,  # [batch, q_heads, 576] bf16, GMEM
      cache_ref,  # [num_blocks, block_size, 576] bf16, GMEM
      table_ref,  # [batch, max_blocks] int32, GMEM
      seq_lens_ref,  # [batch] int32, GMEM
      row_start_ref,  # [batch + 1] int32, GMEM
      part_rows_ref,  # [num_parts, 2] int32, GMEM
      part_start_ref,  # [num_parts + 1] int32, GMEM
      row_part_ref,  # [batch] int32, GMEM
      o_ref,  # [batch, num_splits, heads_padded, 512] f32, GMEM (or split_outputs' wide layout)
      lse_ref,  # [batch, num_splits, heads_padded] f32, GMEM (or split_outputs' wide layout)
      *rest,  # with f16_partials, the partials' scales (`split_outputs`);
      # with finish_rows: out [batch, heads_padded, 512] bf16 and lse_out
      # [batch, heads_padded] f32, GMEM: the rows finished here
  ):
    scale_ref, finished = (rest[0], rest[1:]) if f16_partials else (None, rest)
    cta = Part(static, table_ref=table_ref, seq_lens_ref=seq_lens_ref,
               row_start_ref=row_start_ref, part_rows_ref=part_rows_ref,
               part_start_ref=part_start_ref, row_part_ref=row_part_ref)

    def scoped(q_lat, k_lat, k_rope, p_smem, xchg,
               q_bar, kv_bar, free_bar, sync_bar, q_free_bar,
               m0_bar, p0_bar, p1_bar, p0_free, p1_free, *interp_refs):
      # `cta.Smem` says what each is. Compiled, the RoPE query lands in
      # p_smem at a segment's start and moves to registers before the first
      # P is written (which keeps SMEM within the limit); the interpreter
      # keeps it in its own buffer.
      smem = Smem(
          q_lat=q_lat, k_lat=k_lat, k_rope=k_rope, p_smem=p_smem, xchg=xchg, q_bar=q_bar,
          kv_bar=kv_bar, free_bar=free_bar, sync_bar=sync_bar, q_free_bar=q_free_bar,
          bars=(m0_bar, p0_bar, p1_bar, p0_free, p1_free),
          q_rope_smem=interp_refs[0] if interp_refs else p_smem,
          p_scratch=interp_refs[1] if interp_refs else None)
      wg = lax.axis_index("wg")
      pl.when(wg == 2)(lambda: produce(static, cta, smem, q_ref, cache_ref, table_ref))
      for w in range(2):
        pl.when(wg == w)(lambda w=w: consume(w, static, cta, smem, o_ref, lse_ref, scale_ref,
                                                finished))

    kv = bf16_tile(kv_swizzle)
    pl.run_scoped(
        scoped,
        plgpu.SMEM((2, HEAD_TILE, HALF), dtype, transforms=kv),
        plgpu.SMEM((NUM_STAGES, 2, TILE, HALF), dtype, transforms=kv),
        plgpu.SMEM((NUM_STAGES, TILE, ROPE), dtype, transforms=kv),
        *seesaw_scratch(),
        plgpu.Barrier(num_arrivals=3),
        plgpu.Barrier(num_arrivals=3 * pieces, num_barriers=NUM_STAGES),
        plgpu.Barrier(num_arrivals=2, num_barriers=NUM_STAGES),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=2),
        *seesaw_barriers(),
        *([] if compiled else [
            plgpu.SMEM((HEAD_TILE, ROPE), dtype, transforms=kv),
            seesaw_p_scratch(),
        ]),
        collective_axes="wg",
    )

  # No automatic barriers: each cross-thread hazard above is ordered by
  # commit_smem or an mbarrier (the select-mode value clean reads and rewrites
  # the same elements in the same thread, which needs none).
  return launch(
      mla_decode_kernel,
      grid=(num_parts, heads_padded // HEAD_TILE),
      grid_names=("p", "g"),
      out_type=(
          *split_outputs(batch, num_splits, heads_padded, partial_cols, f16=f16_partials),
          *([jax.ShapeDtypeStruct((batch, heads_padded, LATENT), dtype),
             jax.ShapeDtypeStruct((batch, heads_padded), jnp.float32)] if finish_rows else []),
      ),
      kernel_name="jaxkv_mla_decode",
      interpret=interpret,
      profile_dir=profile_dir,
  )
