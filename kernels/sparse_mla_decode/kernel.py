"""Mosaic GPU body of sparse MLA decode: one CTA per (head group, split, row).

The keys of a row are arbitrary cache slots, so a [tokens, 576] tile cannot be
fetched with one tiled TMA copy, and a one-row TMA copy cannot write into a
swizzled wgmma operand either (a tile's eight rows interleave there). Hence a
two-step data path, both steps in the producer warpgroup (warpgroup 2):

1. gather: one TMA copy per index moves its whole 576-channel row
   (`[1, 9, 64]`, inside the 256-element box limit) into a plain row-major
   "raw" tile `[TILE, 576]`; a two-stage ring of such tiles.
2. relayout: the 128 producer threads read the raw tile in 16-byte vectors
   (eight threads per 128-byte row chunk: no bank conflicts) and store it into
   the swizzled operand tiles the consumers multiply from; a second two-stage
   ring.

Warpgroups 0 and 1 both compute the scores of the whole tile (S = Q K^T,
[64, TILE], the full 576-deep contraction), so each holds the whole softmax
state and they never synchronise; each accumulates O[:, 256w:256w+256] += P V
over the tile with its half of the 512 value channels, P from registers.

Masking. The consumers read the indices (an index < 0 gets score -inf in both
modes); the producer gathers the slots the wrapper derived from them, one
unconditional copy per index: "multiply" clamps a -1 to slot 0, so that
row's value meets p = 0 in the accumulator (0 * NaN = NaN, as in production
kernels); "select" replaces a -1 by a valid slot of the same row (read again,
finite, weighted exactly 0), so no slot outside the row's selection is ever
read. (A row without a valid index reads slot 0; its splits have LSE = -inf
and the merge never uses their O.)

The partial result of a split is written normalised, in float32, with its
natural-log LSE; a split without a valid index writes LSE = -inf and O = 0
(NaN if "multiply" accumulated a NaN value row).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode.kernel import (
    NUM_THREADS,
    launch,
    softmax_finish,
    softmax_start,
    split_outputs,
)

HEAD_TILE = 64  # wgmma M: heads per CTA
HEAD_DIM = 576
LATENT = 512
ROPE = 64
CHUNK = 64  # channels per 128-byte swizzle row; 9 chunks per cache row
NUM_CHUNKS = HEAD_DIM // CHUNK
HALF = 256  # value channels per consumer warpgroup
TILE = 32  # tokens per pipeline step (SMEM: Q + 2 raw + 2 swizzled tiles)
NUM_STAGES = 2
IDX_STAGES = 4  # index tiles in flight ahead of the gathers
GATHER_UNROLL = 8
# setmaxnreg only moves registers inside the launch allocation (168 per
# thread for 384 threads): 2 * CONSUMER_REGS + PRODUCER_REGS <= 3 * 168, or
# the consumers' increase waits forever (seen: 216 + 216 + 80 hung the GPU).
PRODUCER_REGS = 72
CONSUMER_REGS = 216
SWIZZLE = TILE * 2  # bytes: one swizzle row holds one row of P
_LOG2E = math.log2(math.e)


def build_kernel(
    *,
    batch: int,
    heads_padded: int,
    topk: int,
    num_splits: int,
    sm_scale: float,
    interpret,
):
  """Builds the kernel call (the same for both mask modes: they differ only in
  the slots gathered).

  Returns a function `(q, cache_rows, indices, slots) -> (o, lse)` with q
  `[batch, heads_padded, 576]` bf16, cache_rows `[num_slots, 9, 64]` bf16 (the
  cache with blocks and slots merged, channels split in 64-wide chunks),
  indices `[batch, topk]` int32 (-1: masked), slots `[batch, topk]` int32
  (the rows to gather, `gather_slots(indices, select)`), o `[batch,
  num_splits, heads_padded, 512]` f32 and lse `[batch, num_splits,
  heads_padded]` f32.
  """
  assert topk % (TILE * num_splits) == 0
  num_tiles = topk // (TILE * num_splits)  # per split, static
  scale_log2 = float(sm_scale) * _LOG2E
  dtype = jnp.bfloat16
  copy_layout = plgpu.Layout.SMEM_GMEM_COPY((TILE, CHUNK), dtype, SWIZZLE)

  def sparse_mla_decode_kernel(
      q_ref,  # [batch, heads_padded, 576] bf16, GMEM
      cache_ref,  # [num_slots, 9, 64] bf16, GMEM
      idx_ref,  # [batch, topk] int32, GMEM
      slots_ref,  # [batch, topk] int32, GMEM
      o_ref,  # [batch, num_splits, heads_padded, 512] f32, GMEM
      lse_ref,  # [batch, num_splits, heads_padded] f32, GMEM
  ):
    g = lax.axis_index("g")
    s_idx = lax.axis_index("s")
    b = lax.axis_index("b")
    head0 = g * HEAD_TILE
    tok0 = s_idx * (num_tiles * TILE)

    def scoped(
        idx_smem, union_ref, q_bar, idx_bar, raw_bar, ready_bar, free_bar, done_bar
    ):
      # idx_smem [IDX_STAGES, TILE] int32: the producer's index ring.
      main_refs, epi_refs = union_ref
      q_lat, q_rope, raw, k_lat, k_rope, *interp_refs = main_refs
      p_smem = interp_refs[0] if interp_refs else None
      # q_lat [2, 64, 256] bf16, q_rope [64, 64] bf16, raw [stages, TILE, 9, 64]
      # bf16 (row-major), k_lat [stages, 2, TILE, 256] bf16, k_rope [stages,
      # TILE, 64] bf16; interpreter only: p_smem [2, 64, TILE] bf16 (one
      # per consumer; compiled, P stays in registers).
      o_stage, lse_stage = epi_refs
      # o_stage [2, 64, 256] f32, lse_stage [64] f32.
      wg = lax.axis_index("wg")

      @pl.when(wg == 2)
      def _producer():
        plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
        # Zeros in every raw row before the first gather: the kernel gave
        # wrong results on the H200 without this store-and-commit ahead of its
        # first gather (correct with it, and always correct in the interpreter).
        zeros = jnp.zeros((TILE, CHUNK), dtype)
        for st in range(NUM_STAGES):
          for c in range(NUM_CHUNKS):
            raw[st, :, c, :] = zeros
        plgpu.commit_smem()
        heads = pl.ds(head0, HEAD_TILE)
        for h in range(2):
          plgpu.copy_gmem_to_smem(
              q_ref.at[b, heads, pl.ds(h * HALF, HALF)], q_lat.at[h], q_bar
          )
        plgpu.copy_gmem_to_smem(
            q_ref.at[b, heads, pl.ds(LATENT, ROPE)], q_rope, q_bar
        )

        def fetch_indices(tile):
          # One small TMA copy per tile, IDX_STAGES tiles ahead of its
          # gathers: the gathers then read their indices from SMEM (tens of
          # cycles) instead of one dependent GMEM load each.
          slot = lax.rem(tile, IDX_STAGES)
          plgpu.copy_gmem_to_smem(
              slots_ref.at[b, pl.ds(tok0 + tile * TILE, TILE)],
              idx_smem.at[slot],
              idx_bar.at[slot],
          )

        for t in range(min(IDX_STAGES, num_tiles)):
          fetch_indices(t)

        def gather(tile, stage):
          slot = lax.rem(tile, IDX_STAGES)
          plgpu.barrier_wait(idx_bar.at[slot])

          @pl.loop(0, TILE // GATHER_UNROLL)
          def _(grp):
            for u in range(GATHER_UNROLL):
              r = grp * GATHER_UNROLL + u
              gather_row(idx_smem[slot, r], stage, r)

          @pl.when(tile + IDX_STAGES < num_tiles)
          def _():
            # Every thread's reads of this slot before it is overwritten
            # (automatic barriers are off, see the compiler params).
            plgpu.commit_smem()
            fetch_indices(tile + IDX_STAGES)

        def gather_row(slot_id, stage, r):
          # No branch: the wrapper's slots are valid rows in both modes (the
          # clamp only keeps a foreign caller's negative id inside the cache).
          plgpu.copy_gmem_to_smem(
              cache_ref.at[pl.ds(jnp.maximum(slot_id, 0), 1)],
              raw.at[stage, pl.ds(r, 1)],
              raw_bar.at[stage],
          )

        for i in range(min(NUM_STAGES, num_tiles)):
          gather(i, i)

        @pl.loop(0, num_tiles)
        def _(i):
          stage = lax.rem(i, NUM_STAGES)
          plgpu.barrier_wait(raw_bar.at[stage])

          @pl.when(i >= NUM_STAGES)
          def _():
            plgpu.barrier_wait(free_bar.at[stage])

          for c in range(NUM_CHUNKS):
            v = plgpu.load(raw.at[stage, :, c, :], layout=copy_layout)
            if c < LATENT // CHUNK:
              dst = k_lat.at[stage, c // 4, :, pl.ds((c % 4) * CHUNK, CHUNK)]
            else:
              dst = k_rope.at[stage]
            dst[...] = v
          # Orders the raw reads before the next gather overwrites the tile,
          # and the swizzled stores before the consumers' wgmma reads them.
          plgpu.commit_smem()
          plgpu.barrier_arrive(ready_bar.at[stage])

          @pl.when(i + NUM_STAGES < num_tiles)
          def _():
            gather(i + NUM_STAGES, stage)

        # Observe the releases of the last tiles too, so that every barrier
        # phase is consumed before the barriers go away.
        for i in range(max(num_tiles - NUM_STAGES, 0), num_tiles):
          plgpu.barrier_wait(free_bar.at[i % NUM_STAGES])

      @pl.when(wg < 2)
      def _consumer():
        plgpu.set_max_registers(CONSUMER_REGS, action="increase")
        col_layout = plgpu.Layout.WGMMA.reduce(0)
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        acc, m_i, l_i = softmax_start(HALF)
        plgpu.barrier_wait(q_bar)

        def load_idx(tile):
          start = tok0 + tile * TILE
          return plgpu.load(
              idx_ref.at[b, pl.ds(start, TILE)], layout=col_layout, optimized=False
          )

        def step(i, carry):
          acc, m_i, l_i, idx = carry
          stage = lax.rem(i, NUM_STAGES)
          # Next tile's indices: the load's latency hides behind this step.
          idx_next = load_idx(jnp.minimum(i + 1, num_tiles - 1))
          plgpu.barrier_wait(ready_bar.at[stage])

          def qk(s_ref):
            for h in range(2):
              plgpu.wgmma(s_ref, q_lat.at[h], k_lat.at[stage, h].T)
            plgpu.wgmma(s_ref, q_rope, k_rope.at[stage].T)
            return s_ref[...]

          # Both warpgroups compute the same scores of the whole tile, so
          # each holds the full softmax state and they never synchronise.
          s = pl.run_scoped(qk, plgpu.ACC((HEAD_TILE, TILE), jnp.float32))
          valid = lax.broadcast_in_dim(idx >= 0, s.shape, [1])
          s = jnp.where(valid, s * scale_log2, -jnp.inf)
          m_new = jnp.maximum(m_i, s.max(axis=1))
          # A row with no valid index so far keeps m = -inf; subtract 0 then,
          # so that p = exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
          m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)
          alpha = jnp.exp2(m_i - m_sub)
          p = jnp.exp2(s - lax.broadcast_in_dim(m_sub, s.shape, [0]))
          l_i = l_i * alpha + p.sum(axis=1)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          p16 = p.astype(dtype)

          if interpret is None:
            # P is wgmma's A operand straight from registers.
            def pv(o_acc_ref):
              plgpu.wgmma(o_acc_ref, p16, k_lat.at[stage, wg])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
          else:
            # The interpreter takes neither a register operand nor a seeded
            # accumulator here: P goes through SMEM, the sum is explicit.
            p_smem[wg] = p16
            plgpu.commit_smem()

            def pv_fresh(o_acc_ref):
              plgpu.wgmma(o_acc_ref, p_smem.at[wg], k_lat.at[stage, wg])
              return o_acc_ref[...]

            acc = acc + pl.run_scoped(
                pv_fresh, plgpu.ACC((HEAD_TILE, HALF), jnp.float32)
            )
          plgpu.barrier_arrive(free_bar.at[stage])
          return acc, m_new, l_i, idx_next

        acc, m_i, l_i, _ = lax.fori_loop(
            0, num_tiles, step, (acc, m_i, l_i, load_idx(0))
        )

        # Orders every wgmma of both warpgroups before the epilogue
        # overwrites the (aliased) main-loop buffers.
        plgpu.barrier_arrive(done_bar)
        plgpu.barrier_wait(done_bar)
        # A split without a valid index gets O = 0, except that NaN
        # accumulated in "multiply" mode stays NaN, so that merging it into
        # another split of the row poisons that row as the reference says.
        # The wrapper writes 0 where no split of a row had a valid index.
        o_stage[wg], lse = softmax_finish(acc, m_i, l_i)

        @pl.when(wg == 0)
        def _():
          lse_stage[...] = lse

        plgpu.commit_smem()
        heads = pl.ds(head0, HEAD_TILE)
        plgpu.copy_smem_to_gmem(
            o_stage.at[wg], o_ref.at[b, s_idx, heads, pl.ds(wg * HALF, HALF)]
        )

        @pl.when(wg == 0)
        def _():
          plgpu.copy_smem_to_gmem(lse_stage, lse_ref.at[b, s_idx, heads])

        plgpu.wait_smem_to_gmem(0)

    # wgmma wants A and B under the same transforms; P is [64, TILE] bf16,
    # so every bf16 operand uses TILE-wide (64-byte) swizzled tiles.
    bf16 = (plgpu.TilingTransform((8, TILE)), plgpu.SwizzleTransform(SWIZZLE))
    f32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    main = (
        plgpu.SMEM((2, HEAD_TILE, HALF), dtype, transforms=bf16),
        plgpu.SMEM((HEAD_TILE, ROPE), dtype, transforms=bf16),
        plgpu.SMEM((NUM_STAGES, TILE, NUM_CHUNKS, CHUNK), dtype),
        plgpu.SMEM((NUM_STAGES, 2, TILE, HALF), dtype, transforms=bf16),
        plgpu.SMEM((NUM_STAGES, TILE, ROPE), dtype, transforms=bf16),
        *([] if interpret is None else [
            plgpu.SMEM((2, HEAD_TILE, TILE), dtype, transforms=bf16)
        ]),
    )
    epi = (
        plgpu.SMEM((2, HEAD_TILE, HALF), jnp.float32, transforms=f32),
        plgpu.SMEM((HEAD_TILE,), jnp.float32),
    )
    pl.run_scoped(
        scoped,
        plgpu.SMEM((IDX_STAGES, TILE), jnp.int32),
        plgpu.RefUnion(main, epi),
        plgpu.Barrier(num_arrivals=3),
        plgpu.Barrier(num_arrivals=1, num_barriers=IDX_STAGES),
        plgpu.Barrier(num_arrivals=TILE, num_barriers=NUM_STAGES),
        plgpu.Barrier(num_arrivals=1, num_barriers=NUM_STAGES),
        plgpu.Barrier(num_arrivals=2, num_barriers=NUM_STAGES),
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )

  # No automatic barriers (they cost the producer 32 copies and 9 stores'
  # worth per tile): each cross-thread hazard above is ordered by an explicit
  # commit_smem or an mbarrier, and no thread reads SMEM that it wrote.
  return launch(
      sparse_mla_decode_kernel,
      grid=(batch, num_splits, heads_padded // HEAD_TILE),
      grid_names=("b", "s", "g"),
      out_type=split_outputs(batch, num_splits, heads_padded),
      kernel_name="jaxkv_sparse_mla_decode",
      interpret=interpret,
  )


def gather_slots(indices, select: bool):
  """The cache rows the producer gathers for `indices` `[batch, topk]` int32.

  Valid indices read themselves. "multiply" reads slot 0 (the null block) for
  a -1, as production kernels do; "select" reads a valid slot of the same
  row instead (its first), which the -1's score of -inf weights by exactly 0,
  so a -1 never reads anything outside the row's selection. A row with no
  valid index reads slot 0 in both modes (its result is discarded).
  """
  if not select:
    return jnp.maximum(indices, 0)
  valid = indices >= 0
  first = jnp.argmax(valid, axis=1)[:, None]
  fill = jnp.maximum(jnp.take_along_axis(indices, first, axis=1), 0)
  return jnp.where(valid, indices, fill)
