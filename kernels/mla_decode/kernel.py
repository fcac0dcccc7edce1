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
end. By default (`kv_swizzle=64`) all bf16 tiles are 32 columns wide (64-byte
swizzle), since wgmma takes A and B under the same transforms and P's halves
are 32 wide. With `kv_swizzle=128` the query and KV ring are 64 columns wide
(128-byte swizzle: TMA streams 128-byte rows, faster), and since wgmma then
takes K in steps of 64 each warpgroup multiplies the whole P in at once,
both halves at warpgroup 1's maximum. With `q_regs`, each consumer also holds
the query's first latent channels in registers for its QK. KV bytes are
read once per head group. Only the last block of a segment can be partial:
it is peeled out of the loop and alone pays for masking.

Each segment's result is stored straight from registers to GMEM: its
partial result (float32, normalised, with its natural-log LSE), which the
merge combines with the row's other splits into the output. Where the plan's
parts are longer than its rows (`finish_rows`), a segment that covers its
whole row (the row's only split) is the row's result instead: it goes to the
output in bf16 with its LSE (from registers), and the merge does not touch it.
Splits that no segment produced are never written: the plan's bounds say
which exist.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .config import KV_SWIZZLES, Q_REGS, check_choice
from .layout import (
    CLEAN_COLS,
    HALF,
    HEAD_TILE,
    LATENT,
    LOG2E,
    NUM_STAGES,
    ROPE,
    SLOT_HALF,
    TILE,
    bf16_tile,
    last_group_rows,
    launch,
    load_query,
    split_outputs,
    store_head_rows,
    zero_query_rows,
)
from .seesaw import (
    query_head,
    region_scope,
    seesaw_barriers,
    seesaw_begin,
    seesaw_end,
    seesaw_p_scratch,
    seesaw_pv,
    seesaw_pv_whole,
    seesaw_row_sums,
    seesaw_scratch,
    seesaw_tile,
    softmax_finish,
    softmax_start,
    tile_scores,
)

BLOCK_SIZES = (32, 64, 128)  # cache block sizes the kernel reads
# Registers per thread of the producer and of each consumer warpgroup
# (`setmaxnreg`: multiples of 8 in [24, 256], moved inside the launch's 168
# per thread for 384 threads, so 2 * CONSUMER_REGS + PRODUCER_REGS <= 3 * 168
# or the consumers' increase waits forever). The producer only issues TMA
# copies, and every register it gives up eases the consumers' spills (ptxas:
# 272 -> 228 B of spill stores going from 40 / 232 to 24 / 240; 2-3% faster
# at 128 x 64 x 4K, 128 x 128 x 4K and 8 x 64 x 32K on the H200, NOTES.md).
PRODUCER_REGS = 24
CONSUMER_REGS = 240
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
):
  """Builds the kernel call.

  Returns a function `(q, cache, block_table, seq_lens, row_start, part_rows,
  part_start, row_part) -> (o, lse)`, and with `finish_rows` `-> (o, lse,
  out, lse_out)`, with q `[batch, heads_padded, 576]` bf16, cache
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
  fence_all = (not whole_pv or interpret is not None) if p_fence is None else p_fence
  # TMA copies per tile: (a latent half, a latent half, RoPE) per block piece.
  pieces = max(TILE // block_size, 1)
  piece_slots = min(block_size, TILE)
  scale_log2 = float(sm_scale) * LOG2E
  dtype = jnp.bfloat16
  compiled = interpret is None
  rope_in_regs = compiled

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
      *finished,  # with finish_rows: out [batch, heads_padded, 512] bf16 and
      # lse_out [batch, heads_padded] f32, GMEM: the rows finished here
  ):
    g = lax.axis_index("g")
    part = lax.axis_index("p")
    # A stale or foreign plan must not walk past a row's own blocks, the
    # table or the outputs: every plan value is clipped here, where it costs
    # a few scalar instructions instead of XLA launches per call.
    max_tokens = table_ref.shape[1] * block_size
    total = row_start_ref[batch]
    beg = jnp.clip(part_start_ref[part], 0, total)
    end = jnp.clip(part_start_ref[part + 1], beg, total)
    row_lo = jnp.clip(part_rows_ref[part, 0], 0, batch)
    row_hi = jnp.clip(part_rows_ref[part, 1], row_lo, batch)
    head0 = g * HEAD_TILE
    heads = pl.ds(head0, HEAD_TILE)

    def seq_len(row):
      return jnp.clip(seq_lens_ref[row], 0, max_tokens)

    def segment(row):
      """The row's tiles in this part: (first tile, count, split index, whole).

      `whole`: the segment is split 0 and runs from the row's first tile to
      its last, so it is the row's result (`merge_tiling.kernel_wrote_row` on the
      plan's bounds agrees for every plan that `mla_decode_plan` makes).
      None without `finish_rows`.
      """
      rs = row_start_ref[row]
      ntiles = (seq_len(row) + TILE - 1) // TILE
      lo = jnp.clip(beg - rs, 0, ntiles)
      hi = jnp.clip(end - rs, lo, ntiles)
      split = jnp.clip(part - row_part_ref[row], 0, num_splits - 1)
      whole = None
      if finish_rows:
        whole = (part == row_part_ref[row]) & (lo == 0) & (hi == ntiles)
      return lo, hi - lo, split, whole

    def scoped(q_lat, k_lat, k_rope, p_smem, xchg,
               q_bar, kv_bar, free_bar, sync_bar, q_free_bar,
               m0_bar, p0_bar, p1_bar, p0_free, p1_free, *interp_refs):
      # q_lat [2, 64, 256] bf16: the segment's latent query; k_lat [stages,
      # 2, 64, 256] and k_rope [stages, 64, 64] bf16: the KV ring; p_smem
      # [64, 64] bf16: P of the block (each consumer writes the 32 columns of
      # its slots, for the other); xchg [2, 64] f32: the maxima each consumer
      # hands on (and at a segment's end its row sums). Barriers of the
      # seesaw (one arrival each): m0_bar (warpgroup 0's maximum is out),
      # p1_bar / p0_bar (warpgroup 1's / 0's P half is out), p0_free /
      # p1_free (that half has been read and may be overwritten).
      # Compiled, the RoPE query lands in p_smem at a segment's start and
      # moves to registers before the first P is written (which keeps SMEM
      # within the limit); the interpreter keeps it in its own buffer.
      q_rope_smem = interp_refs[0] if interp_refs else p_smem
      wg = lax.axis_index("wg")

      @pl.when(wg == 2)
      def _producer():
        if tail_heads < HEAD_TILE:
          zero_query_rows(q_lat, q_rope_smem)
        plgpu.set_max_registers(PRODUCER_REGS, action="decrease")

        def issue(row, tile, slot):
          if block_size >= TILE:
            per = block_size // TILE  # tiles per block
            srcs = [(table_ref[row, tile // per], lax.rem(tile, per) * TILE)]
          else:
            # The tile's blocks; one past the row's last block reads that
            # block again (masked), never a padded entry.
            last_blk = (seq_len(row) + block_size - 1) // block_size - 1
            srcs = [
                (table_ref[row, jnp.minimum(tile * pieces + k, last_blk)], 0)
                for k in range(pieces)
            ]
          for k, (blk, off) in enumerate(srcs):
            src = cache_ref.at[blk, pl.ds(off, piece_slots)]
            dst = pl.ds(k * piece_slots, piece_slots)
            for h in range(2):
              plgpu.copy_gmem_to_smem(
                  src.at[:, pl.ds(h * HALF, HALF)],
                  k_lat.at[slot, h, dst],
                  kv_bar.at[slot],
              )
            plgpu.copy_gmem_to_smem(
                src.at[:, pl.ds(LATENT, ROPE)],
                k_rope.at[slot, dst],
                kv_bar.at[slot],
            )

        def produce(row, carry):
          steps, segs = carry
          lo, n, _, _ = segment(row)

          @pl.when(n > 0)
          def _():
            # The query buffers are free once both consumers finished the
            # previous segment's last block (QK reads Q, PV reads P, where
            # the RoPE query lands).
            with jax.named_scope("query_free_wait"):
              pl.when(segs > 0)(lambda: plgpu.barrier_wait(q_free_bar))
            load_query(q_ref, row, g, head_groups=head_groups, tail_heads=tail_heads,
                       q_lat=q_lat, q_rope=q_rope_smem, bar=q_bar)

            @pl.loop(0, n)
            def _(i):
              step = steps + i
              slot = lax.rem(step, NUM_STAGES)
              with jax.named_scope("stage_wait"):
                pl.when(step >= NUM_STAGES)(
                    lambda: plgpu.barrier_wait(free_bar.at[slot])
                )
              with jax.named_scope("issue"):
                issue(row, lo + i, slot)

          return steps + n, segs + (n > 0).astype(jnp.int32)

        steps, segs = lax.fori_loop(
            row_lo, row_hi, produce, (jnp.int32(0), jnp.int32(0))
        )

        # Observe the release of the last query and stages too: every waiter
        # of a barrier must see each of its phases.
        pl.when(segs > 0)(lambda: plgpu.barrier_wait(q_free_bar))

        @pl.loop(jnp.maximum(steps, NUM_STAGES) - NUM_STAGES, steps)
        def _(step):
          plgpu.barrier_wait(free_bar.at[lax.rem(step, NUM_STAGES)])

      def consumer(wg: int):
        # `wg` is static: every SMEM slice below has a compile-time offset.
        plgpu.set_max_registers(CONSUMER_REGS, action="increase")
        own = pl.ds(wg * SLOT_HALF, SLOT_HALF)  # the slots whose scores are ours
        bars = (m0_bar, p0_bar, p1_bar, p0_free, p1_free)

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
            s = tile_scores(q_lat, q_rope, k_lat, k_rope, slot, own, q_head=q_head)
          if last:
            # Slots of this tile that hold tokens of the row; the rest (the
            # unwritten tail of the row's last block, and at block size 32 a
            # repeat of that block) is masked by select in both modes.
            n_valid = seq_len(row) - (lo + i) * TILE
            col = plgpu.broadcasted_iota(
                jnp.int32, (HEAD_TILE, SLOT_HALF), 1, layout=plgpu.Layout.WGMMA
            )
            s = jnp.where(col + wg * SLOT_HALF < n_valid, s * scale_log2, -jnp.inf)
            # "select" keeps the row's tokens only; "multiply" keeps the
            # whole of the row's last block (its unwritten tail too, as
            # production kernels do), never the repeat past it.
            if select:
              n_keep = n_valid
            else:
              n_keep = (n_valid + block_size - 1) // block_size * block_size
            clean = select or block_size < TILE
          else:
            s = s * scale_log2
            clean = False
          if whole_pv:
            pv = functools.partial(
                seesaw_pv_whole, k_lat=k_lat, slot=slot, wg=wg, p_smem=p_smem,
                compiled=interpret is None,
            )
          else:
            pv = functools.partial(
                seesaw_pv, k_lat=k_lat, slot=slot, wg=wg, p_smem=p_smem,
                p_scratch=None if interpret is None else interp_refs[1],
            )
          acc, m_new, l_i = seesaw_tile(
              wg, s, (acc, m_i, l_i), pv=pv, xchg=xchg, p_smem=p_smem, bars=bars,
              clean=functools.partial(clean_values, slot, n_keep) if clean else None,
              whole_pv=whole_pv, fence=fence_all or last, regions=tile_regions,
          )
          plgpu.barrier_arrive(free_bar.at[slot])
          if last:
            # The segment's last QK and PV are done: the producer may load
            # the next segment's query.
            plgpu.barrier_arrive(q_free_bar)
          return acc, m_new, l_i

        def consume(row, steps):
          lo, n, split, whole = segment(row)

          @pl.when(n > 0)
          def _():
            with jax.named_scope("query_wait"):
              plgpu.barrier_wait(q_bar)
            # The RoPE part of the query lives in registers (16 per thread).
            # (The interpreter cannot take a register operand for a wgmma
            # into an accumulator ref: it reads it from SMEM.)
            if rope_in_regs:
              q_rope = plgpu.load(q_rope_smem, layout=plgpu.Layout.WGMMA)
            else:
              q_rope = q_rope_smem
            q_head = query_head(q_lat, q_regs, in_regs=rope_in_regs)

            def step(i, carry, *, last: bool):
              slot = lax.rem(steps + i, NUM_STAGES)
              with jax.named_scope("kv_wait"):
                plgpu.barrier_wait(kv_bar.at[slot])
              with jax.named_scope("last_tile" if last else "tile"):
                return tile(i, carry, slot, row=row, lo=lo, q_rope=q_rope, q_head=q_head, last=last)

            carry = lax.fori_loop(
                0, n - 1, functools.partial(step, last=False), softmax_start(HALF)
            )
            acc, m_i, l_own = step(n - 1, carry, last=True)
            with jax.named_scope("epilogue"):
              finish(row, split, whole, acc, m_i, l_own)

          return steps + n

        def finish(row, split, whole, acc, m_i, l_own):
          # The exchange rows serve the next segment's maxima too.
          with jax.named_scope("row_sums"):
            l_i = seesaw_row_sums(wg, l_own, xchg, sync_bar, reuse=True)
          o, lse = softmax_finish(acc, m_i, l_i)
          cols = pl.ds(wg * HALF, HALF)

          def store(dst, value):
            # A last head group of fewer real heads stores their rows alone
            # (the merge reads no others).
            store_head_rows(dst, value, g, head_groups=head_groups, tail_heads=tail_heads,
                            compiled=compiled)

          @jax.named_scope("store")
          def partial():
            if partial_cols is None:
              store(o_ref.at[row, split, heads, cols], o)
            else:  # this half's channels, partial_cols at a time
              per = HALF // partial_cols
              for k in range(per):
                store(o_ref.at[row, wg * per + k, g, split],
                      o[:, k * partial_cols:(k + 1) * partial_cols])
            if wg == 0:
              if partial_cols is None:
                lse_ref[row, split, heads] = lse
              else:
                lse_ref[row, g, split] = lse

          if whole is None:
            partial()
            return

          @pl.when(whole)
          def _():
            # The row's result: no f32 partial, no merge.
            out_ref, lse_out_ref = finished
            out_ref[row, heads, cols] = o.astype(dtype)
            if wg == 0:
              lse_out_ref[row, heads] = lse

          pl.when(~whole)(partial)

        seesaw_begin(wg, bars)
        lax.fori_loop(row_lo, row_hi, consume, jnp.int32(0))
        seesaw_end(wg, bars)

      for w in range(2):
        pl.when(wg == w)(lambda w=w: consumer(w))

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
        *([] if rope_in_regs else [
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
          *split_outputs(batch, num_splits, heads_padded, partial_cols),
          *([jax.ShapeDtypeStruct((batch, heads_padded, LATENT), dtype),
             jax.ShapeDtypeStruct((batch, heads_padded), jnp.float32)] if finish_rows else []),
      ),
      kernel_name="jaxkv_mla_decode",
      interpret=interpret,
      profile_dir=profile_dir,
  )
