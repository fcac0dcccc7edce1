"""Mosaic GPU body of dense paged MLA decode: one CTA per (head group, split, row).

Three warpgroups per CTA. Warpgroup 2 is the TMA producer: it loads the
64-head query tile once and streams the split's KV blocks (one 64x576 block
per step, three TMA copies of 256 + 256 + 64 channels) through a two-stage
ring indexed by the block table. Warpgroups 0 and 1 consume and split every
block two ways. Scores by slots: warpgroup w computes S_w = Q K^T for slots
[32w, 32w + 32) of the block ([64, 32], 576 deep); the two swap their row
maxima through SMEM, so both rescale by the same running maximum, and each
writes its 32 columns of P (bf16) into one shared [64, 64] tile. Values by
channels: warpgroup w accumulates O[:, 256w:256w+256] += P V over all 64 slots
(a 64x256 f32 accumulator; 64x512 does not fit one warpgroup). Two
rendezvous per block (maxima, then P); each warpgroup's row sum covers its
own slots and the two are added at the end. All bf16 tiles are 32 columns
wide (64-byte swizzle), since wgmma takes A and B under the same transforms
and P's halves are 32 wide. KV bytes are read once. Only the last block of a
split can be partial: it is peeled out of the loop and alone pays for
masking.

The partial result of a split is written normalised, in float32, with its
natural-log LSE; the wrapper merges splits. A split with no blocks reads
nothing and writes only LSE = -inf (its O is left unwritten: the merge
never reads it).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

HEAD_TILE = 64  # wgmma M: heads per CTA
LATENT = 512
ROPE = 64
HALF = 256  # value channels per consumer warpgroup; also the TMA box limit
SLOT_HALF = 32  # slots of a block whose scores one consumer warpgroup computes
NUM_STAGES = 2
NUM_THREADS = 3  # warpgroups per block: two consumers and the TMA producer
_LOG2E = math.log2(math.e)


def _bf16_tile():
  # 32-column (64-byte swizzled) tiles: wgmma takes A and B under the same
  # transforms, and P and each warpgroup's score slice are 32 slots wide.
  return (plgpu.TilingTransform((8, SLOT_HALF)), plgpu.SwizzleTransform(2 * SLOT_HALF))


def build_kernel(
    *,
    batch: int,
    heads_padded: int,
    num_splits: int,
    block_size: int,
    sm_scale: float,
    select: bool,
    interpret,
):
  """Builds the kernel call.

  Returns a function `(q, cache, block_table, seq_lens, bounds) -> (o, lse)`
  with q `[batch, heads_padded, 576]` bf16, cache `[num_blocks, 64, 576]` bf16,
  block_table `[batch, max_blocks]` int32, seq_lens `[batch]` int32 (clamped
  to the table), bounds `[batch, num_splits + 1]` int32 block boundaries,
  o `[batch, num_splits, heads_padded, 512]` f32, lse
  `[batch, num_splits, heads_padded]` f32.
  """
  assert block_size == 64
  scale_log2 = float(sm_scale) * _LOG2E
  dtype = jnp.bfloat16
  rope_in_regs = interpret is None

  def mla_decode_kernel(
      q_ref,  # [batch, heads_padded, 576] bf16, GMEM
      cache_ref,  # [num_blocks, 64, 576] bf16, GMEM
      table_ref,  # [batch, max_blocks] int32, GMEM
      seq_lens_ref,  # [batch] int32, GMEM
      bounds_ref,  # [batch, num_splits + 1] int32, GMEM
      o_ref,  # [batch, num_splits, heads_padded, 512] f32, GMEM
      lse_ref,  # [batch, num_splits, heads_padded] f32, GMEM
  ):
    g = lax.axis_index("g")
    s_idx = lax.axis_index("s")
    b = lax.axis_index("b")
    start = bounds_ref[b, s_idx]
    n = bounds_ref[b, s_idx + 1] - start
    seq_len = seq_lens_ref[b]
    head0 = g * HEAD_TILE

    def scoped(union_ref, xchg, q_bar, kv_bar, free_bar, sync_bar, q_free_bar):
      # xchg [2, 64] f32: each consumer's row maxima (and at the end its row
      # sums) for the other.
      main_refs, epi_refs = union_ref
      q_lat, k_lat, k_rope, p_smem, *interp_refs = main_refs
      # q_lat [2, 64, 256] bf16, k_lat [stages, 2, 64, 256] bf16, k_rope
      # [stages, 64, 64] bf16, p_smem [64, 64] bf16 (P of the block: each
      # consumer writes the 32 columns of its slots).
      # Interpreter only: q_rope_smem [64, 64] bf16.
      q_rope_smem = interp_refs[0] if interp_refs else None
      (o_stage, lse_stage) = epi_refs
      # o_stage [2, 64, 256] f32, lse_stage [64] f32.
      wg = lax.axis_index("wg")

      def sync_consumers():
        # One barrier serves every rendezvous of the two consumers: neither
        # can pass phase k + 1 before the other has waited on phase k.
        plgpu.barrier_arrive(sync_bar)
        plgpu.barrier_wait(sync_bar)

      @pl.when(wg == 2)
      def _producer():
        plgpu.set_max_registers(40, action="decrease")

        @pl.when(n > 0)
        def _():
          heads = pl.ds(head0, HEAD_TILE)
          for h in range(2):
            plgpu.copy_gmem_to_smem(
                q_ref.at[b, heads, pl.ds(h * HALF, HALF)], q_lat.at[h], q_bar
            )
          # Compiled, the RoPE query is staged in stage 1's (still idle) RoPE
          # buffer and moved to registers by the consumers.
          plgpu.copy_gmem_to_smem(
              q_ref.at[b, heads, pl.ds(LATENT, ROPE)],
              k_rope.at[1] if rope_in_regs else q_rope_smem,
              q_bar,
          )

        def issue(step, slot):
          blk = table_ref[b, start + step]
          for h in range(2):
            plgpu.copy_gmem_to_smem(
                cache_ref.at[blk, :, pl.ds(h * HALF, HALF)],
                k_lat.at[slot, h],
                kv_bar.at[slot],
            )
          plgpu.copy_gmem_to_smem(
              cache_ref.at[blk, :, pl.ds(LATENT, ROPE)],
              k_rope.at[slot],
              kv_bar.at[slot],
          )

        pl.when(n > 0)(lambda: issue(0, 0))

        @pl.when(n > 1)
        def _():
          if rope_in_regs:
            plgpu.barrier_wait(q_free_bar)
          issue(1, 1)

        @pl.loop(NUM_STAGES, jnp.maximum(n, NUM_STAGES))
        def _(step):
          slot = lax.rem(step, NUM_STAGES)
          plgpu.barrier_wait(free_bar.at[slot])
          issue(step, slot)

        # Observe the release of the last stages too: every waiter of a
        # barrier must see each of its phases.
        @pl.loop(jnp.maximum(n - NUM_STAGES, 0), n)
        def _(step):
          plgpu.barrier_wait(free_bar.at[lax.rem(step, NUM_STAGES)])

      def consumer(wg: int):
        # `wg` is static: every SMEM slice below has a compile-time offset.
        plgpu.set_max_registers(232, action="increase")
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        m_i = plgpu.layout_cast(
            jnp.full((HEAD_TILE,), -jnp.inf, jnp.float32), row_layout
        )
        l_i = plgpu.layout_cast(jnp.full((HEAD_TILE,), 0.0, jnp.float32), row_layout)
        acc = plgpu.layout_cast(
            jnp.full((HEAD_TILE, HALF), 0.0, jnp.float32), plgpu.Layout.WGMMA
        )
        slots = pl.ds(wg * SLOT_HALF, SLOT_HALF)  # the slots whose scores are ours

        # The RoPE part of the query lives in registers (16 per thread): it
        # keeps the SMEM budget of two KV stages.
        # (The interpreter cannot take a register operand for a wgmma into
        # an accumulator ref, and has no SMEM limit: it keeps it in SMEM.)
        @pl.when(n > 0)
        def _():
          plgpu.barrier_wait(q_bar)

        if rope_in_regs:
          # Garbage when n == 0, and then unused.
          q_rope = plgpu.load(k_rope.at[1], layout=plgpu.Layout.WGMMA)
          pl.when(n > 1)(lambda: plgpu.barrier_arrive(q_free_bar))
        else:
          q_rope = q_rope_smem

        def other_rows():
          return plgpu.load(
              xchg.at[1 - wg], layout=row_layout, optimized=False
          )

        def kv_step(step, carry, *, last: bool):
          # `last` is static. Only the last block a split reads can hold
          # slots past seq_len (the bounds are clipped to the row's blocks),
          # so the steady-state loop runs the unmasked body, the same in
          # both modes, and only the peeled last step pays for masking.
          acc, m_i, l_i = carry
          slot = lax.rem(step, NUM_STAGES)
          plgpu.barrier_wait(kv_bar.at[slot])

          def qk(s_ref):
            for h in range(2):
              plgpu.wgmma(s_ref, q_lat.at[h], k_lat.at[slot, h, slots].T)
            plgpu.wgmma(s_ref, q_rope, k_rope.at[slot, slots].T)
            return s_ref[...]

          # Scores of our half of the block's slots only: [64, 32].
          s = pl.run_scoped(qk, plgpu.ACC((HEAD_TILE, SLOT_HALF), jnp.float32))
          if last:
            # Slots of this block that hold tokens of the row; the rest (the
            # unwritten tail of the last block) is masked by select in both
            # modes.
            n_valid = seq_len - (start + step) * block_size
            col = plgpu.broadcasted_iota(
                jnp.int32, (HEAD_TILE, SLOT_HALF), 1, layout=plgpu.Layout.WGMMA
            )
            s = jnp.where(col + wg * SLOT_HALF < n_valid, s * scale_log2, -jnp.inf)
          else:
            s = s * scale_log2
          # Both warpgroups need the block's row maximum: swap halves.
          m_own = s.max(axis=1)
          xchg[wg] = m_own
          sync_consumers()  # also: both QKs of this block are done
          m_new = jnp.maximum(m_i, jnp.maximum(m_own, other_rows()))

          if select and last:
            # Each warpgroup cleans the value rows it alone multiplies (its
            # 256 channels): p = 0 alone cannot stop 0 * NaN from reaching
            # the accumulator.
            @pl.when(n_valid < block_size)
            def _():
              v_ref = k_lat.at[slot, wg]
              v = plgpu.load(v_ref, layout=plgpu.Layout.WGMMA)
              row = plgpu.broadcasted_iota(
                  jnp.int32, (block_size, HALF), 0, layout=plgpu.Layout.WGMMA
              )
              v_ref[...] = jnp.where(row < n_valid, v, jnp.zeros_like(v))

          alpha = jnp.exp2(m_i - m_new)
          p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
          # l_i sums our slots only; the halves are added at the end (both
          # warpgroups rescale by the same alpha).
          l_i = l_i * alpha + p.sum(axis=1)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          p_smem[:, slots] = p.astype(dtype)
          plgpu.commit_smem()
          sync_consumers()  # both halves of P are in SMEM

          if interpret is None:
            def pv(o_acc_ref):
              plgpu.wgmma(o_acc_ref, p_smem, k_lat.at[slot, wg])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
          else:
            # The interpreter cannot seed an accumulator: the sum is explicit.
            def pv_fresh(o_acc_ref):
              plgpu.wgmma(o_acc_ref, p_smem, k_lat.at[slot, wg])
              return o_acc_ref[...]

            acc = acc + pl.run_scoped(
                pv_fresh, plgpu.ACC((HEAD_TILE, HALF), jnp.float32)
            )
          plgpu.barrier_arrive(free_bar.at[slot])
          return acc, m_new, l_i

        carry = (acc, m_i, l_i)
        carry = lax.fori_loop(
            0, n - 1, functools.partial(kv_step, last=False), carry
        )
        # At most one trip: step n - 1 when n > 0.
        acc, m_i, l_own = lax.fori_loop(
            jnp.maximum(n - 1, 0), n, functools.partial(kv_step, last=True), carry
        )
        # The other half's sum. The exchange buffer is free: the other
        # warpgroup read our last maximum before the last P rendezvous.
        xchg[wg] = l_own
        # Also orders every wgmma of both warpgroups before the epilogue
        # overwrites the (aliased) main-loop buffers.
        sync_consumers()
        l_i = l_own + other_rows()
        has = l_i > 0.0
        inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)
        o_stage[wg] = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
        lse = jnp.where(
            has, (m_i + jnp.log2(jnp.where(has, l_i, 1.0))) / _LOG2E, -jnp.inf
        )

        if wg == 0:
          lse_stage[...] = lse

        plgpu.commit_smem()
        heads = pl.ds(head0, HEAD_TILE)
        # An empty split writes only its LSE (-inf): the merge gives it weight
        # 0 and never reads its O (128 KB of float32 saved per empty split).
        pl.when(n > 0)(lambda: plgpu.copy_smem_to_gmem(
            o_stage.at[wg], o_ref.at[b, s_idx, heads, pl.ds(wg * HALF, HALF)]
        ))

        if wg == 0:
          plgpu.copy_smem_to_gmem(lse_stage, lse_ref.at[b, s_idx, heads])

        plgpu.wait_smem_to_gmem(0)

      for w in range(2):
        pl.when(wg == w)(lambda w=w: consumer(w))

    bf16 = _bf16_tile()
    f32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    main = (
        plgpu.SMEM((2, HEAD_TILE, HALF), dtype, transforms=bf16),
        plgpu.SMEM((NUM_STAGES, 2, block_size, HALF), dtype, transforms=bf16),
        plgpu.SMEM((NUM_STAGES, block_size, ROPE), dtype, transforms=bf16),
        plgpu.SMEM((HEAD_TILE, block_size), dtype, transforms=bf16),
        *([] if rope_in_regs else [
            plgpu.SMEM((HEAD_TILE, ROPE), dtype, transforms=bf16),
        ]),
    )
    epi = (
        plgpu.SMEM((2, HEAD_TILE, HALF), jnp.float32, transforms=f32),
        plgpu.SMEM((HEAD_TILE,), jnp.float32),
    )
    pl.run_scoped(
        scoped,
        plgpu.RefUnion(main, epi),
        plgpu.SMEM((2, HEAD_TILE), jnp.float32),
        plgpu.Barrier(num_arrivals=3),
        plgpu.Barrier(num_arrivals=3, num_barriers=NUM_STAGES),
        plgpu.Barrier(num_arrivals=2, num_barriers=NUM_STAGES),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )

  # No automatic barriers: each cross-thread hazard above is ordered by
  # commit_smem or an mbarrier (the select-mode value clean reads and rewrites
  # the same elements in the same thread, which needs none).
  return launch_splits(
      mla_decode_kernel,
      batch=batch,
      num_splits=num_splits,
      heads_padded=heads_padded,
      kernel_name="jaxkv_mla_decode",
      interpret=interpret,
  )


def launch_splits(body, *, batch, num_splits, heads_padded, kernel_name, interpret):
  """The launch of both MLA decode kernels: one block per (head group, split, row).

  Three warpgroups ("wg"), grid axes "g", "s", "b"; the outputs are each
  split's normalised partial O `[batch, num_splits, heads_padded, 512]` and
  LSE `[batch, num_splits, heads_padded]`, float32. Pallas's automatic
  warpgroup barriers around SMEM stores and before TMA copies are off
  (`unsafe_no_auto_barriers`): the body orders every cross-thread hazard
  itself with commit_smem or mbarriers.

  Args:
    body: the kernel body, `(*input refs, o_ref, lse_ref) -> None`.
    batch, num_splits, heads_padded: the grid (heads in groups of 64).
    kernel_name: the name profiles show.
    interpret: None (compiled) or the interpreter's parameters.

  Returns:
    The kernel call.
  """
  out_type = (
      jax.ShapeDtypeStruct((batch, num_splits, heads_padded, LATENT), jnp.float32),
      jax.ShapeDtypeStruct((batch, num_splits, heads_padded), jnp.float32),
  )
  return plgpu.kernel(
      body,
      out_type=out_type,
      grid=(heads_padded // HEAD_TILE, num_splits, batch),
      grid_names=("g", "s", "b"),
      num_threads=NUM_THREADS,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
      kernel_name=kernel_name,
      interpret=interpret,
  )
