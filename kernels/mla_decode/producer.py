"""The TMA producer warpgroup of dense MLA decode: per row segment the query,
then the segment's KV tiles through the two-stage ring (`kernel.py` says how)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .cta import PRODUCER_REGS, Launch, Part, Smem
from .layout import (
    HALF,
    HEAD_TILE,
    LATENT,
    NUM_STAGES,
    ROPE,
    TILE,
    load_query,
    zero_query_rows,
)


def produce(launch: Launch, cta: Part, smem: Smem, q_ref, cache_ref, table_ref) -> None:
  """The producer's whole run over the part's row segments.

  q_ref `[batch, q_heads, 576]` bf16, cache_ref `[num_blocks, block_size,
  576]` bf16 and table_ref `[batch, max_blocks]` int32 are GMEM.
  """
  block_size, pieces, piece_slots = launch.block_size, launch.pieces, launch.piece_slots
  k_lat, k_rope, kv_bar, free_bar = smem.k_lat, smem.k_rope, smem.kv_bar, smem.free_bar
  q_free_bar = smem.q_free_bar
  if launch.tail_heads < HEAD_TILE:
    zero_query_rows(smem.q_lat, smem.q_rope_smem)
  plgpu.set_max_registers(PRODUCER_REGS, action="decrease")

  def issue(row, tile, slot):
    if block_size >= TILE:
      per = block_size // TILE  # tiles per block
      srcs = [(table_ref[row, tile // per], lax.rem(tile, per) * TILE)]
    else:
      # The tile's blocks; one past the row's last block reads that
      # block again (masked), never a padded entry.
      last_blk = (cta.seq_len(row) + block_size - 1) // block_size - 1
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

  def produce_row(row, carry):
    steps, segs = carry
    lo, n, _, _ = cta.segment(row)

    @pl.when(n > 0)
    def _():
      # The query buffers are free once both consumers finished the
      # previous segment's last block (QK reads Q, PV reads P, where
      # the RoPE query lands).
      with jax.named_scope("query_free_wait"):
        pl.when(segs > 0)(lambda: plgpu.barrier_wait(q_free_bar))
      load_query(q_ref, row, cta.g, head_groups=launch.head_groups,
                 tail_heads=launch.tail_heads, q_lat=smem.q_lat, q_rope=smem.q_rope_smem,
                 bar=smem.q_bar)

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
      cta.row_lo, cta.row_hi, produce_row, (jnp.int32(0), jnp.int32(0))
  )

  # Observe the release of the last query and stages too: every waiter
  # of a barrier must see each of its phases.
  pl.when(segs > 0)(lambda: plgpu.barrier_wait(q_free_bar))

  @pl.loop(jnp.maximum(steps, NUM_STAGES) - NUM_STAGES, steps)
  def _(step):
    plgpu.barrier_wait(free_bar.at[lax.rem(step, NUM_STAGES)])
