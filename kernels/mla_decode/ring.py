"""The per-split ring's online merge step: one split's tile folded into a
running `(acc, m, l)`, its slot refilled behind it. Shared by the merge of a
row per CTA (`merge.build_merge`) and of rows stacked in one CTA's tile
(`packed_merge.build_packed_merge`)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .layout import LOG2E


def ring_step(j, carry, *, bar, lse_buf, o_buf, stages: int, n, fetch, live_rows=None,
              scale_buf=None):
  """Split j of the per-split ring's online merge: waits for its slot (`j %
  stages` of `o_buf` `[stages, 64, cols]` and `lse_buf` `[stages, 64]` f32,
  landing on `bar`), refills the slot with split `j + stages` if it is below
  `n` (`fetch`), and folds split j into `carry` = `(acc, m, l)` (m in log2
  units). `live_rows(j)`, where given, is a row-layout mask of the tile rows
  whose split j is live (`packed_merge.build_packed_merge`); the others are
  selected away, and a row without a live split so far keeps weight 0.
  None: every row's split j is live (`build_merge`). With `scale_buf`
  (`[stages, 64]` f32, on the same barrier), o_buf holds float16 partials
  (`layout.scaled_half`'s bits) and their scales."""
  acc, m, l = carry
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  slot = lax.rem(j, stages)
  plgpu.barrier_wait(bar.at[slot])
  lse_j = plgpu.load(lse_buf.at[slot], layout=row_layout, optimized=False) * LOG2E
  o_j = plgpu.load(o_buf.at[slot], layout=plgpu.Layout.WGMMA, optimized=False)
  if scale_buf is not None:
    o_j = lax.bitcast_convert_type(o_j, jnp.float16).astype(jnp.float32)
    scale_j = plgpu.load(scale_buf.at[slot], layout=row_layout, optimized=False)
  # The slot is refilled at once: every thread's reads are ordered before
  # the copy (Pallas's warpgroup barrier ahead of a TMA issue).
  plgpu.commit_smem()
  pl.when(j + stages < n)(lambda: fetch(j + stages))
  if live_rows is None:
    m_new = m_ref = jnp.maximum(m, lse_j)
  else:
    live = live_rows(j)
    lse_j = jnp.where(live, lse_j, -jnp.inf)
    o_j = jnp.where(lax.broadcast_in_dim(live, o_j.shape, [0]), o_j, 0.0)
    m_new = jnp.maximum(m, lse_j)
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no live split yet: weights 0
  alpha = jnp.exp2(m - m_ref)
  w = jnp.exp2(lse_j - m_ref)
  # A power of two: w * scale_j rounds as o_j * scale_j would.
  w_o = w if scale_buf is None else w * scale_j
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + o_j * lax.broadcast_in_dim(
      w_o, acc.shape, [0]
  )
  return acc, m_new, l * alpha + w
