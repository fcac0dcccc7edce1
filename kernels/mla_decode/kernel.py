"""Mosaic GPU body of dense paged MLA decode: one CTA per (head group, split, row).

Three warpgroups per CTA. Warpgroup 2 is the TMA producer: it loads the
64-head query tile once and streams the split's KV blocks (one 64x576 block
per step, three TMA copies of 256 + 256 + 64 channels) through a two-stage
ring indexed by the block table. Warpgroups 0 and 1 consume: each computes the
same scores S = Q K^T ([64, 64], 576 deep) and online softmax in registers,
and accumulates its own half of the 512 value channels, O[:, 256w:256w+256] +=
P V (a 64x256 f32 accumulator; 64x512 does not fit one warpgroup). Computing S
twice costs tensor-core time but no SMEM exchange and no barrier between the
consumers in the steady state (splitting S by slots needs wgmma B operands of
K = 32 rows, which this Mosaic GPU version rejects for 128-byte swizzled
tiles). KV bytes are read once. Only the last block of a split can be
partial: it is peeled out of the loop and alone pays for masking.

The partial result of a split is written normalised, in float32, with its
natural-log LSE; the wrapper merges splits. A split with no blocks writes
O = 0 and LSE = -inf and reads nothing.
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
NUM_STAGES = 2
_LOG2E = math.log2(math.e)


def _bf16_tile():
  return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


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
  head_groups = heads_padded // HEAD_TILE
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

    def scoped(union_ref, q_bar, kv_bar, free_bar, sync_bar, q_free_bar):
      main_refs, epi_refs = union_ref
      q_lat, k_lat, k_rope, *interp_refs = main_refs
      # Interpreter only: q_rope_smem [64, 64] bf16, p_smem [2, 64, 64] bf16.
      q_rope_smem, p_smem = interp_refs if interp_refs else (None, None)
      # q_lat [2, 64, 256] bf16, k_lat [stages, 2, 64, 256]
      # bf16, k_rope [stages, 64, 64] bf16.
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
        m_i = plgpu.layout_cast(
            jnp.full((HEAD_TILE,), -jnp.inf, jnp.float32),
            plgpu.Layout.WGMMA.reduce(1),
        )
        l_i = plgpu.layout_cast(
            jnp.full((HEAD_TILE,), 0.0, jnp.float32),
            plgpu.Layout.WGMMA.reduce(1),
        )
        acc = plgpu.layout_cast(
            jnp.full((HEAD_TILE, HALF), 0.0, jnp.float32), plgpu.Layout.WGMMA
        )

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
              plgpu.wgmma(s_ref, q_lat.at[h], k_lat.at[slot, h].T)
            plgpu.wgmma(s_ref, q_rope, k_rope.at[slot].T)
            return s_ref[...]

          # Both warpgroups compute the same scores (the price of splitting
          # the 512 value channels between them without an SMEM exchange).
          s = pl.run_scoped(qk, plgpu.ACC((HEAD_TILE, block_size), jnp.float32))
          if last:
            # Slots of this block that hold tokens of the row; the rest (the
            # unwritten tail of the last block) is masked by select in both
            # modes.
            n_valid = seq_len - (start + step) * block_size
            col = plgpu.broadcasted_iota(
                jnp.int32, (HEAD_TILE, block_size), 1, layout=plgpu.Layout.WGMMA
            )
            s = jnp.where(col < n_valid, s * scale_log2, -jnp.inf)
          else:
            s = s * scale_log2
          m_new = jnp.maximum(m_i, s.max(axis=1))

          if select and last:
            # Once both warpgroups are past their QK of this slot, each may
            # clean the value rows it alone reads: p = 0 alone cannot stop
            # 0 * NaN from reaching the accumulator.
            @pl.when(n_valid < block_size)
            def _():
              sync_consumers()
              v_ref = k_lat.at[slot, wg]
              v = plgpu.load(v_ref, layout=plgpu.Layout.WGMMA)
              row = plgpu.broadcasted_iota(
                  jnp.int32, (block_size, HALF), 0, layout=plgpu.Layout.WGMMA
              )
              v_ref[...] = jnp.where(row < n_valid, v, jnp.zeros_like(v))
              plgpu.commit_smem()

          alpha = jnp.exp2(m_i - m_new)
          p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
          l_i = l_i * alpha + p.sum(axis=1)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          p16 = p.astype(dtype)

          if interpret is None:
            def pv(o_acc_ref):
              plgpu.wgmma(o_acc_ref, p16, k_lat.at[slot, wg])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
          else:
            # The interpreter takes neither a register operand nor a seeded
            # accumulator here: P goes through SMEM, the sum is explicit.
            p_smem[wg] = p16
            plgpu.commit_smem()

            def pv_fresh(o_acc_ref):
              plgpu.wgmma(o_acc_ref, p_smem.at[wg], k_lat.at[slot, wg])
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
        acc, m_i, l_i = lax.fori_loop(
            jnp.maximum(n - 1, 0), n, functools.partial(kv_step, last=True), carry
        )

        # Orders every wgmma of both warpgroups before the epilogue
        # overwrites the (aliased) main-loop buffers.
        sync_consumers()
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
        plgpu.copy_smem_to_gmem(
            o_stage.at[wg], o_ref.at[b, s_idx, heads, pl.ds(wg * HALF, HALF)]
        )

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
        *([] if rope_in_regs else [
            plgpu.SMEM((HEAD_TILE, ROPE), dtype, transforms=bf16),
            plgpu.SMEM((2, HEAD_TILE, block_size), dtype, transforms=bf16),
        ]),
    )
    epi = (
        plgpu.SMEM((2, HEAD_TILE, HALF), jnp.float32, transforms=f32),
        plgpu.SMEM((HEAD_TILE,), jnp.float32),
    )
    pl.run_scoped(
        scoped,
        plgpu.RefUnion(main, epi),
        plgpu.Barrier(num_arrivals=3),
        plgpu.Barrier(num_arrivals=3, num_barriers=NUM_STAGES),
        plgpu.Barrier(num_arrivals=2, num_barriers=NUM_STAGES),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )

  out_type = (
      jax.ShapeDtypeStruct((batch, num_splits, heads_padded, LATENT), jnp.float32),
      jax.ShapeDtypeStruct((batch, num_splits, heads_padded), jnp.float32),
  )
  return plgpu.kernel(
      mla_decode_kernel,
      out_type=out_type,
      grid=(head_groups, num_splits, batch),
      grid_names=("g", "s", "b"),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      kernel_name="jaxkv_mla_decode",
      interpret=interpret,
  )
