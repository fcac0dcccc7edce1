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
The two halves of a block meet in FlashMLA's "seesaw" order: warpgroup 0
folds its half into the running maximum first and hands the new maximum on;
warpgroup 1 folds its half in after it. Each multiplies its own half's P
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

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .config import KV_SWIZZLES, Q_REGS, check_choice
from .reference import READ_TILE

HEAD_TILE = 64  # wgmma M: heads per CTA
# Slots per KV ring stage, the plan's unit (a block at block size 64): the
# reference's read tile, which sets what "multiply" reads.
TILE = READ_TILE
BLOCK_SIZES = (32, 64, 128)  # cache block sizes the kernel reads
LATENT = 512
ROPE = 64
HALF = 256  # value channels per consumer warpgroup; also the TMA box limit
CLEAN_COLS = 64  # value channels cleaned per register pass
SLOT_HALF = 32  # slots of a block whose scores one consumer warpgroup computes
NUM_STAGES = 2
NUM_THREADS = 3  # warpgroups per block: two consumers and the TMA producer
# Registers per thread of the producer and of each consumer warpgroup
# (`setmaxnreg`: multiples of 8 in [24, 256], moved inside the launch's 168
# per thread for 384 threads, so 2 * CONSUMER_REGS + PRODUCER_REGS <= 3 * 168
# or the consumers' increase waits forever). The producer only issues TMA
# copies, and every register it gives up eases the consumers' spills (ptxas:
# 272 -> 228 B of spill stores going from 40 / 232 to 24 / 240; 2-3% faster
# at 128 x 64 x 4K, 128 x 128 x 4K and 8 x 64 x 32K on the H200, NOTES.md).
PRODUCER_REGS = 24
CONSUMER_REGS = 240
_LOG2E = math.log2(math.e)
# Ranges per warpgroup the in-kernel profiler can record: its buffer takes
# 3 x 16 B per range from the SMEM the kernel leaves free (224,312 of
# 232,448 B). Past it, events are dropped (`profile_bounds_check`).
PROFILE_RANGES = 168
# Named regions of the in-kernel profile (see `build_kernel(profile_dir=)`).
REGIONS = (
    "kv_wait", "tile", "last_tile", "query_wait", "epilogue",  # consumers
    "qk", "handoff_wait", "pv",  # consumers, inside "tile" / "last_tile"
    "row_sums", "store",  # consumers, inside "epilogue"
    "stage_wait", "issue", "query_free_wait",  # producer
)


def bf16_tile(swizzle: int = 64):
  # Tiles of 8 rows and `swizzle` bytes (32 columns at 64: wgmma takes A and
  # B under the same transforms, and P and each warpgroup's score slice are
  # 32 slots wide; 64 columns at 128, `build_kernel(kv_swizzle=128)`).
  return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


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
  every other row, `merge.kernel_wrote_row`). `finish_rows` pays where parts
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
  `heads_padded` rows. None: q is padded already.

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
  scale_log2 = float(sm_scale) * _LOG2E
  dtype = jnp.bfloat16
  rope_in_regs = interpret is None

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
      its last, so it is the row's result (`merge.kernel_wrote_row` on the
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

        def sources(row, tile):
          """The tile's (cache block, first slot) pieces: scalar loads of the
          block table from GMEM."""
          if block_size >= TILE:
            per = block_size // TILE  # tiles per block
            return [(table_ref[row, tile // per], lax.rem(tile, per) * TILE)]
          # The tile's blocks; one past the row's last block reads that
          # block again (masked), never a padded entry.
          last_blk = (seq_len(row) + block_size - 1) // block_size - 1
          return [
              (table_ref[row, jnp.minimum(tile * pieces + k, last_blk)], 0)
              for k in range(pieces)
          ]

        def issue(srcs, slot):
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
                issue(sources(row, lo + i), slot)

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

          @jax.named_scope("store")
          def partial():
            if partial_cols is None:
              o_ref[row, split, heads, cols] = o
            else:  # this half's channels, partial_cols at a time
              per = HALF // partial_cols
              for k in range(per):
                o_ref[row, wg * per + k, g, split] = o[:, k * partial_cols:(k + 1) * partial_cols]
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


def tile_scores(q_lat, q_rope, k_lat, k_rope, stage, slots, q_head=None):
  """S = Q K^T over a KV stage's `slots` (32 of them): `[64, 32]` float32, 576 deep.

  The QK of both decode kernels. `q_lat` `[2, 64, 256]` bf16 SMEM, `q_rope`
  `[64, 64]` bf16 (registers, or SMEM in the interpreter), `k_lat` `[stages,
  2, 64, 256]` and `k_rope` `[stages, 64, 64]` bf16 SMEM. `q_head`, when
  given, is `q_lat[0, :, :d]` (`[64, d]` bf16, registers or SMEM), which the
  first wgmma then takes instead of the SMEM copy.

  The query's address is the same for every tile, so LLVM would hoist the
  21 wgmma descriptors of its 32-column tiles out of the tile loop, where
  they held 42 registers beside the accumulator for the whole loop and ptxas
  spilled (232 B of spill stores at 64 heads). Read through an index that
  passes an empty asm statement with side effects (a 0 LLVM can neither fold
  nor hoist), the descriptors are worked out per tile in uniform registers
  from one base, as the KV stage's are: no spills at 64 or 128 heads, and
  dense and sparse decode 1.5-7% faster on the H200 with bit-identical
  outputs (kernels/mla_decode/NOTES.md, "The query's wgmma descriptors").
  """
  def qk(s_ref):
    q = q_lat.at[pl.ds(lax.optimization_barrier(jnp.int32(0)), 2)]
    if q_head is None:
      plgpu.wgmma(s_ref, q.at[0], k_lat.at[stage, 0, slots].T)
    else:
      d = q_head.shape[1]
      plgpu.wgmma(s_ref, q_head, k_lat.at[stage, 0, slots, pl.ds(0, d)].T)
      rest = pl.ds(d, HALF - d)
      plgpu.wgmma(s_ref, q.at[0, :, rest], k_lat.at[stage, 0, slots, rest].T)
    plgpu.wgmma(s_ref, q.at[1], k_lat.at[stage, 1, slots].T)
    plgpu.wgmma(s_ref, q_rope, k_rope.at[stage, slots].T)
    return s_ref[...]

  return pl.run_scoped(qk, plgpu.ACC((HEAD_TILE, SLOT_HALF), jnp.float32))


def query_head(q_lat, q_regs: int, *, in_regs: bool):
  """`tile_scores`' `q_head`: the query's first `q_regs` latent channels
  (`q_regs / 4` registers per thread), loaded once per query; None for 0.
  With `in_regs` False (the interpreter) the same SMEM slice."""
  if not q_regs:
    return None
  head = q_lat.at[0, :, pl.ds(0, q_regs)]
  return plgpu.load(head, layout=plgpu.Layout.WGMMA) if in_regs else head


def seesaw_scratch():
  """The seesaw's P tile (`[64, 64]` bf16) and exchange rows (`[2, 64]` f32)
  as scoped SMEM, in that order."""
  return [
      plgpu.SMEM((HEAD_TILE, TILE), jnp.bfloat16, transforms=bf16_tile()),
      plgpu.SMEM((2, HEAD_TILE), jnp.float32),
  ]


def softmax_start(cols):
  """The online softmax's start for 64 rows, in wgmma layouts.

  Returns `(acc, m, l)`: the `[64, cols]` float32 accumulator (0), the row
  maxima (-inf) and the row sums (0).
  """
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  m = plgpu.layout_cast(jnp.full((HEAD_TILE,), -jnp.inf, jnp.float32), row_layout)
  l = plgpu.layout_cast(jnp.full((HEAD_TILE,), 0.0, jnp.float32), row_layout)
  acc = plgpu.layout_cast(
      jnp.full((HEAD_TILE, cols), 0.0, jnp.float32), plgpu.Layout.WGMMA
  )
  return acc, m, l


def softmax_finish(acc, m, l):
  """The online softmax's end: `(acc / l, natural-log LSE)` for `m` in log2 units.

  Rows with no weight (`l == 0`) get O = 0 times acc (so NaN accumulated in
  "multiply" mode stays NaN) and LSE = -inf.
  """
  has = l > 0.0
  inv = jnp.where(has, 1.0 / jnp.where(has, l, 1.0), 0.0)
  o = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
  lse = jnp.where(has, (m + jnp.log2(jnp.where(has, l, 1.0))) / _LOG2E, -jnp.inf)
  return o, lse


def seesaw_barriers():
  """The seesaw's five one-arrival barriers: `(m0_bar, p0_bar, p1_bar, p0_free,
  p1_free)` (warpgroup 0's maximum is out; warpgroup 0's / 1's P half is out;
  that half has been read and may be overwritten)."""
  return [plgpu.Barrier(num_arrivals=1) for _ in range(5)]


def seesaw_p_scratch():
  """The interpreter's SMEM for each consumer's own P half (`[2, 64, 32]` bf16):
  it cannot take a register operand for a wgmma into an accumulator."""
  return plgpu.SMEM((2, HEAD_TILE, SLOT_HALF), jnp.bfloat16, transforms=bf16_tile())


def seesaw_begin(wg: int, bars) -> None:
  """Before a consumer's first tile: our half of P starts free for the other
  (one arrival ahead, consumed by its first wait)."""
  plgpu.barrier_arrive(bars[4] if wg == 0 else bars[3])


def seesaw_end(wg: int, bars) -> None:
  """After a consumer's last tile: consumes the other's last "read" arrival."""
  plgpu.barrier_wait(bars[3] if wg == 0 else bars[4])


def seesaw_pv(acc, slots, *, k_lat, slot, wg, p_smem, p_scratch, p=None, p_cols=None):
  """O[:, warpgroup wg's 256 channels] += P V over 32 of a tile's slots.

  P is `[64, 32]` bf16: `p` in registers, or `p_smem[:, p_cols]`. V is
  `k_lat[slot, wg, slots]`. Compiled (`p_scratch` None), the accumulator is
  seeded with `acc`; the interpreter can neither seed one (the sum is
  explicit) nor take a register operand (`p` goes through `p_scratch[wg]`).
  Refs are sliced inside the wgmma bodies: a slice closed over from outside
  does not lower.
  """
  if p_scratch is None:
    def body(o_acc_ref):
      a = p if p_cols is None else p_smem.at[:, p_cols]
      plgpu.wgmma(o_acc_ref, a, k_lat.at[slot, wg, slots])

    return pl.run_state(body)(plgpu.ACC.init(acc))

  if p_cols is None:
    p_scratch[wg] = p
    plgpu.commit_smem()

  def pv_fresh(o_acc_ref):
    a = p_scratch.at[wg] if p_cols is None else p_smem.at[:, p_cols]
    plgpu.wgmma(o_acc_ref, a, k_lat.at[slot, wg, slots])
    return o_acc_ref[...]

  return acc + pl.run_scoped(pv_fresh, plgpu.ACC((HEAD_TILE, HALF), jnp.float32))


def seesaw_pv_whole(acc, *, k_lat, slot, wg, p_smem, p_own, compiled: bool):
  """O[:, warpgroup wg's 256 channels] += P V over all 64 slots of a tile.

  For a KV ring under the 128-byte swizzle, where wgmma takes K in steps of
  64 slots. P is `[64, 64]` bf16: our half `p_own` (`[64, 32]`, registers)
  and the other's from `p_smem`, joined in registers. The interpreter takes
  no register operand and no seeded accumulator: there it reads the whole P
  from `p_smem`, where each warpgroup also stored its own half.
  """
  if compiled:
    other = plgpu.load(
        p_smem.at[:, pl.ds((1 - wg) * SLOT_HALF, SLOT_HALF)], layout=plgpu.Layout.WGMMA
    )
    p = jnp.concatenate([p_own, other] if wg == 0 else [other, p_own], axis=1)

    def body(o_acc_ref):
      plgpu.wgmma(o_acc_ref, p, k_lat.at[slot, wg])

    return pl.run_state(body)(plgpu.ACC.init(acc))

  def pv_fresh(o_acc_ref):
    plgpu.wgmma(o_acc_ref, p_smem, k_lat.at[slot, wg])
    return o_acc_ref[...]

  return acc + pl.run_scoped(pv_fresh, plgpu.ACC((HEAD_TILE, HALF), jnp.float32))


def region_scope(on: bool):
  """`jax.named_scope` (a profile region), or a scope that names nothing."""
  return jax.named_scope if on else (lambda name: contextlib.nullcontext())


def seesaw_tile(wg: int, s, carry, *, pv, xchg, p_smem, bars, clean=None, whole_pv=False,
                fence=True, regions=True):
  """One 64-slot tile's softmax and PV, FlashMLA's "seesaw" over its two halves.

  Warpgroup `wg` (static) scored slots `[32 wg, 32 wg + 32)`: `s` is `[64, 32]`
  float32, scaled to log2 units and masked (-inf). The running maximum
  passes from one warpgroup to the other instead of being agreed on:
  warpgroup 0 folds its half in first (m0 = max(m, its rows)), warpgroup 1
  then (m1 = max(m0, its rows)); each multiplies its own half's P (from
  registers) into its 256 channels of O at once, and the other half's P when
  it arrives through `p_smem` (warpgroup 0's rescaled by exp2(m0 - m1)), so
  one warpgroup's softmax runs beside the other's wgmma. Returns after both
  PVs, with the other's half of `p_smem` read (the caller then releases the
  stage).

  Args:
    s: this warpgroup's scores.
    carry: `(acc, m, l)`: the `[64, 256]` accumulator; m, the running
      maximum before the tile (the same in both warpgroups); l, the sum of
      our slots' weights, at the common scale.
    pv: `seesaw_pv` bound to the tile's stage.
    xchg: `[2, 64]` float32 SMEM: the maxima handed on.
    p_smem: `[64, 64]` bf16 SMEM: each warpgroup's P half, for the other.
    bars: `seesaw_barriers()`.
    clean: None, or a callable that rewrites this warpgroup's value rows
      (its 256 channels of the tile): run once both warpgroups' QKs, which
      read those rows, are done and before this warpgroup's PVs, which are
      the only other readers (warpgroup 1 cleans as soon as warpgroup 0
      has handed on m0, and warpgroup 0 hands its P on before its own PV,
      so neither waits for the other's clean).
    whole_pv: `pv` is `seesaw_pv_whole` (a KV ring under the 128-byte
      swizzle): each warpgroup multiplies the whole P in once both halves
      are out, at the tile's maximum m1 (so warpgroup 0 rescales its
      accumulator once, and hands on the copy of its half it multiplies in
      itself), instead of its own half first. The hand-offs are the same;
      each warpgroup's own half is in `p_smem` either way (the
      interpreter's whole-P PV reads it there).
    fence: each P half (and maximum) is fenced toward the async proxy before
      it is handed on (`plgpu.commit_smem`): needed where the other's wgmma
      reads it from SMEM, or where TMA writes its tile next. Without it the
      hand-off's barrier alone orders it, for plain loads (every thread
      arrives with release semantics).
    regions: name the profile regions "handoff_wait" and "pv".

  Returns:
    `(acc, m1, l)`.
  """
  m0_bar, p0_bar, p1_bar, p0_free, p1_free = bars
  acc, m_i, l_i = carry
  scope = region_scope(regions)
  own = pl.ds(wg * SLOT_HALF, SLOT_HALF)
  other = pl.ds((1 - wg) * SLOT_HALF, SLOT_HALF)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  rows = lambda k: plgpu.load(xchg.at[k], layout=row_layout, optimized=False)
  bcast = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
  if wg == 0:
    m0 = jnp.maximum(m_i, s.max(axis=1))
    scale0 = jnp.exp2(m_i - m0)
    p = jnp.exp2(s - bcast(m0, s.shape))
    l_i = l_i * scale0 + p.sum(axis=1)
    xchg[0] = m0
    plgpu.barrier_arrive(m0_bar)  # our QK is done, m0 is out
    if not whole_pv:
      acc = acc * bcast(scale0, acc.shape)
      p16 = p.astype(jnp.bfloat16)
      if clean is None:
        with scope("pv"):
          acc = pv(acc, own, p=p16)  # beside warpgroup 1's softmax
    with scope("handoff_wait"):
      plgpu.barrier_wait(p1_bar)  # P1 and m1 are out; both QKs are done
    m1 = rows(1)
    scale1 = jnp.exp2(m0 - m1)
    if clean is not None:
      clean()
    # Our P at warpgroup 1's scale, for its channels.
    p_scaled = (p * bcast(scale1, s.shape)).astype(jnp.bfloat16)
    with scope("handoff_wait"):
      plgpu.barrier_wait(p0_free)  # warpgroup 1 is done with our last P
    p_smem[:, own] = p_scaled
    if fence:
      plgpu.commit_smem()
    plgpu.barrier_arrive(p0_bar)
    l_i = l_i * scale1
    if whole_pv:
      # Both halves at m1: our accumulator is rescaled once, from m.
      acc = acc * bcast(jnp.exp2(m_i - m1), acc.shape)
      with scope("pv"):
        acc = pv(acc, p_own=p_scaled)
    else:
      if clean is not None:
        # After the hand-off: warpgroup 1 does not wait for this PV.
        with scope("pv"):
          acc = pv(acc, own, p=p16)
      acc = acc * bcast(scale1, acc.shape)
      with scope("pv"):
        acc = pv(acc, other, p_cols=other)
    plgpu.barrier_arrive(p1_free)  # we are done with warpgroup 1's P
  else:
    with scope("handoff_wait"):
      plgpu.barrier_wait(m0_bar)
    m0 = rows(0)
    m1 = jnp.maximum(m0, s.max(axis=1))
    scale = jnp.exp2(m_i - m0) * jnp.exp2(m0 - m1)
    p = jnp.exp2(s - bcast(m1, s.shape))
    l_i = l_i * scale + p.sum(axis=1)
    p16 = p.astype(jnp.bfloat16)
    with scope("handoff_wait"):
      plgpu.barrier_wait(p1_free)  # warpgroup 0 is done with our last P
    p_smem[:, own] = p16
    xchg[1] = m1
    if fence:
      plgpu.commit_smem()
    plgpu.barrier_arrive(p1_bar)
    acc = acc * bcast(scale, acc.shape)
    if clean is not None:
      # Warpgroup 0's QK, the other reader of our value rows, was done when
      # it handed on m0: our rows can be cleaned without waiting for its P.
      clean()
    if whole_pv:
      with scope("handoff_wait"):
        plgpu.barrier_wait(p0_bar)  # warpgroup 0's P at our scale
      with scope("pv"):
        acc = pv(acc, p_own=p16)
    else:
      with scope("pv"):
        acc = pv(acc, own, p=p16)  # beside warpgroup 0's rescale (and clean)
      with scope("handoff_wait"):
        plgpu.barrier_wait(p0_bar)  # warpgroup 0's P at our scale
      with scope("pv"):
        acc = pv(acc, other, p_cols=other)
    plgpu.barrier_arrive(p0_free)  # we are done with warpgroup 0's P
  return acc, m1, l_i


def seesaw_row_sums(wg: int, l_own, xchg, sync_bar, *, reuse: bool):
  """After a consumer's last tile: the row sums over both halves' slots.

  Each warpgroup's sum covers its own slots; they meet through the exchange
  rows (free then: each warpgroup read the maximum the other handed on
  before the last P half passed) at a rendezvous on `sync_bar` (two
  arrivals; neither passes phase k + 1 before the other has waited on phase
  k). With `reuse` (the rows carry a next segment's maxima), a second
  rendezvous keeps those from overwriting a sum not yet read.
  """
  def rendezvous():
    plgpu.barrier_arrive(sync_bar)
    plgpu.barrier_wait(sync_bar)

  xchg[wg] = l_own
  rendezvous()
  l = l_own + plgpu.load(xchg.at[1 - wg], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
  if reuse:
    rendezvous()
  return l


def load_query(q_ref, row, g, *, head_groups, tail_heads, q_lat, q_rope, bar):
  """Copies head group `g` of row `row` of q `[batch, q_heads, 576]` (GMEM)
  into the query tiles, q_lat `[2, 64, 256]` and q_rope `[64, 64]` (SMEM),
  three copies completing on `bar`. The last head group holds `tail_heads`
  real rows (64 when q is padded): its copies bring those alone, into the
  tiles' first rows (`zero_query_rows` zeroed the rest)."""

  def copy(src_heads, n):
    dst = (lambda ref: ref) if n == HEAD_TILE else (lambda ref: ref.at[pl.ds(0, n)])
    for h in range(2):
      plgpu.copy_gmem_to_smem(
          q_ref.at[row, src_heads, pl.ds(h * HALF, HALF)], dst(q_lat.at[h]), bar)
    plgpu.copy_gmem_to_smem(q_ref.at[row, src_heads, pl.ds(LATENT, ROPE)], dst(q_rope), bar)

  by_head_group(
      g, head_groups=head_groups, tail_heads=tail_heads,
      whole=lambda: copy(pl.ds(g * HEAD_TILE, HEAD_TILE), HEAD_TILE),
      tail=lambda: copy(pl.ds((head_groups - 1) * HEAD_TILE, tail_heads), tail_heads),
  )


def query_rows(heads: int, *, pad: bool = False) -> int:
  """The query heads the decode kernels take for `heads` real ones: `heads`
  itself where it is a multiple of 8 (a TMA box into the query's swizzled
  tiles moves whole 8-row groups), else `heads` padded to head groups of 64
  (and always with `pad`)."""
  return heads if heads % 8 == 0 and not pad else -(-heads // HEAD_TILE) * HEAD_TILE


def real_heads(out, lse, heads: int):
  """A result's first `heads` rows (`out` `[batch, rows, dv]`, `lse` `[batch,
  rows]`): no op where a kernel wrote the real heads alone, else a slice of
  the padded result (an XLA op per output)."""
  if out.shape[1] == heads:
    return out, lse
  return out[:, :heads], lse[:, :heads]


def last_group_rows(heads: int, heads_padded: int) -> int:
  """Real rows of the last head group of 64 when `heads` (`query_rows`) of
  `heads_padded` are real: 64 when none is padding."""
  assert heads_padded - HEAD_TILE < heads <= heads_padded
  assert heads == heads_padded or heads % 8 == 0
  return heads - (heads_padded - HEAD_TILE)


def by_head_group(g, *, head_groups: int, tail_heads: int, whole, tail) -> None:
  """Runs `whole()` in head group `g` when its 64 rows are real and `tail()`
  when it is a last group of `tail_heads` < 64 real rows (both static
  bodies; `g` is the grid's head-group index)."""
  if tail_heads == HEAD_TILE:
    whole()
    return
  last = g == head_groups - 1
  if head_groups > 1:
    pl.when(~last)(whole)
  pl.when(last)(tail)


def zero_query_rows(q_lat, q_rope):
  """Zeroes the query's SMEM tiles, q_lat `[2, 64, 256]` and q_rope `[64,
  64]` bf16, and fences them toward the async proxy: for a query of fewer
  real heads than the tile's 64 rows, whose copies then write the real rows
  alone (after the fence, in the same thread). The padded rows stay zero: no
  copy writes them. Called by the producer before its register decrease (a
  64x64 tile of zeros takes 16 registers per thread)."""
  zero = plgpu.layout_cast(jnp.zeros((HEAD_TILE, CLEAN_COLS), jnp.bfloat16), plgpu.Layout.WGMMA)
  for h in range(2):
    for c in range(HALF // CLEAN_COLS):
      q_lat.at[h, :, pl.ds(c * CLEAN_COLS, CLEAN_COLS)][...] = zero
  q_rope[...] = zero
  plgpu.commit_smem()


def stage_store(buf, value, dst, *, src=None):
  """Stores `value` to GMEM `dst` through SMEM `buf` by one TMA copy (of
  `src`, a slice of `buf` shaped like `dst`, when given: the rows of `value`
  that exist in `dst`, which a register store cannot pick out).

  For 16-bit values: from registers, two 16-bit values per thread and row fill half of each
  32-byte sector a warp store touches, which cost far more than their bytes
  on the H200 (sparse decode's result 4-5.5% of a call, the merge's output
  1.8-3.4 µs at batch 128; kernels/mla_decode/NOTES.md); the copy writes
  whole rows. The caller owns `buf` until
  `plgpu.wait_smem_to_gmem(0, wait_read_only=True)`: only then may it be
  reused, released or left (the copy's writes land before the kernel
  completes).
  """
  buf[...] = value
  plgpu.commit_smem()  # the copy (async proxy) reads what the stores wrote
  plgpu.copy_smem_to_gmem(buf if src is None else src, dst)


def split_outputs(batch, num_splits, heads_padded, partial_cols=None):
  """Each split's normalised partial O and its LSE, float32: O
  `[batch, num_splits, heads_padded, 512]` and LSE `[batch, num_splits,
  heads_padded]`, or with `partial_cols` O `[batch, 512 / partial_cols,
  heads_padded / 64, num_splits, 64, partial_cols]` and LSE `[batch,
  heads_padded / 64, num_splits, 64]` (`merge.wide_partials` of the first
  two)."""
  groups = heads_padded // HEAD_TILE
  if partial_cols is None:
    o_shape = (batch, num_splits, heads_padded, LATENT)
    lse_shape = (batch, num_splits, heads_padded)
  else:
    o_shape = (batch, LATENT // partial_cols, groups, num_splits, HEAD_TILE, partial_cols)
    lse_shape = (batch, groups, num_splits, HEAD_TILE)
  return (
      jax.ShapeDtypeStruct(o_shape, jnp.float32),
      jax.ShapeDtypeStruct(lse_shape, jnp.float32),
  )


def launch(body, *, grid, grid_names, out_type, kernel_name, interpret, profile_dir=None):
  """The launch of both MLA decode kernels: three warpgroups ("wg") per CTA.

  The last grid axis varies fastest: make it the head group, so that the
  CTAs reading the same KV bytes run side by side and share them in L2.
  Pallas's automatic warpgroup barriers around SMEM stores and before TMA
  copies are off (`unsafe_no_auto_barriers`): the body orders every
  cross-thread hazard itself with commit_smem or mbarriers.

  Args:
    body: the kernel body, `(*input refs, *output refs) -> None`.
    grid, grid_names: the grid and its axis names.
    out_type: the outputs' shapes and dtypes.
    kernel_name: the name profiles show.
    interpret: None (compiled) or the interpreter's parameters.
    profile_dir: where the in-kernel profiler writes each call's trace (it
      records `PROFILE_RANGES` ranges per warpgroup; None: no profiler).

  Returns:
    The kernel call.
  """
  return plgpu.kernel(
      body,
      out_type=out_type,
      grid=grid,
      grid_names=grid_names,
      num_threads=NUM_THREADS,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          approx_math=True, unsafe_no_auto_barriers=True,
          **(dict(profile_space=PROFILE_RANGES, profile_dir=profile_dir,
                  profile_bounds_check=True) if profile_dir else {}),
      ),
      kernel_name=kernel_name,
      interpret=interpret,
  )
