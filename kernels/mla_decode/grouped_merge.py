"""The grouped merge's row: a row's splits `GROUP` per bulk copy (`build_merge(group=True)`).

Each copy brings `GROUP` splits of a CTA's tile at once, so a CTA holds all
of a row's splits in a handful of copies; the row's LSE comes first and its
maximum is taken before any value tile is read, so the splits' weighted sum
is a chain of FMAs rather than one online-softmax step per split. The
decode kernel stores its partials in this layout (`merge_tiling.wide_partials`:
a CTA's splits contiguous), so that every copy is a bulk copy rather than a
TMA box of narrow rows.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .layout import HALF, HEAD_TILE, LOG2E
from .merge_tiling import GROUP, group_box_start
from .seesaw import softmax_start


def merge_row_grouped(b, n, chans, o_ref, lse_ref, o_buf, lse_buf, bar, scales, *,
                      num_splits: int, dv: int, cols: int, heads_padded: int, stages: int):
  """`(acc, m, l)` of row b's n live splits (its first n; a CTA merges all
  of a row's splits), `GROUP` per copy, weighted by their LSE maximum taken
  first; m in log2 units, -inf where no split is live.

  chans: this CTA's `pl.ds` of value channels. o_ref: `wide_partials`'
  layout flattened to `[-1, 64, cols]` (`merge.merge_call`'s `flat`), lse_ref
  `[batch, head_groups, num_splits, 64]` f32; o_buf `[stages, GROUP, 64,
  cols]` (float32, or float16 bits as bf16) and lse_buf `[num_splits, 64]`
  f32 in SMEM; bar `(o_bar [stages], lse_bar)`. scales: float16 partials'
  `(scale_ref [batch, head_groups, 2, num_splits, 64], scale_buf
  [num_splits, 64])`, else None.
  """
  o_bar, lse_bar = bar
  groups = -(-num_splits // GROUP)
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  half = lax.div(chans.start, HALF)  # the channel half these channels are in
  del chans  # o is `wide_partials`' layout, flattened
  run_start = ((b * (dv // cols) + lax.axis_index("c")) * (heads_padded // HEAD_TILE)
               + lax.axis_index("g")) * num_splits

  def fetch(k):
    # The group's `[GROUP, 64, cols]` is contiguous in GMEM and inside the
    # array (the last box ends at the row's last slot): Mosaic GPU issues
    # one bulk copy for it, not a TMA box of `cols * 4`-byte rows.
    rows = pl.ds(run_start + group_box_start(k, num_splits), GROUP)
    plgpu.copy_gmem_to_smem(o_ref.at[rows], o_buf.at[k % stages], o_bar.at[k % stages],
                            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

  # Every slot's LSE (a dead slot's bytes are selected away below), and the
  # first group whether live or not (a row with any split has split 0 live):
  # neither copy waits for the live count's loads.
  plgpu.copy_gmem_to_smem(lse_ref.at[b, lax.axis_index("g")], lse_buf, lse_bar,
                          oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
  if scales:  # every slot's scale of our half, one run like the LSE
    scale_ref, scale_buf = scales
    plgpu.copy_gmem_to_smem(scale_ref.at[b, lax.axis_index("g"), half], scale_buf, lse_bar,
                            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
  fetch(0)
  for k in range(1, min(stages, groups)):
    pl.when(k * GROUP < n)(lambda k=k: fetch(k))

  def live_rows(j):
    # Split j is live, as a row-layout mask (a scalar does not select an array).
    return plgpu.layout_cast(jnp.full((HEAD_TILE,), j, jnp.int32), row_layout) < n

  def log2_lse(j):
    # Loaded again where used: all splits' maxima held in registers would
    # not fit beside the accumulator.
    return plgpu.load(lse_buf.at[j], layout=row_layout, optimized=False) * LOG2E

  plgpu.barrier_wait(lse_bar)
  m = plgpu.layout_cast(jnp.full((HEAD_TILE,), -jnp.inf, jnp.float32), row_layout)
  for j in range(num_splits):
    m = jnp.maximum(m, jnp.where(live_rows(j), log2_lse(j), -jnp.inf))
  # No live split: m stays -inf and every weight is selected to 0, so the
  # row comes out 0 / -inf (softmax_finish).

  acc, _, l = softmax_start(cols)
  for k in range(groups):
    slot = k % stages
    if k == 0:  # fetched whatever n is
      plgpu.barrier_wait(o_bar.at[slot])
    else:
      pl.when(k * GROUP < n)(lambda slot=slot: plgpu.barrier_wait(o_bar.at[slot]))
    for j in range(k * GROUP, min((k + 1) * GROUP, num_splits)):
      live = live_rows(j)
      w = jnp.where(live, jnp.exp2(log2_lse(j) - m), 0.0)
      o_j = plgpu.load(o_buf.at[slot, j - group_box_start(k, num_splits)],
                       layout=plgpu.Layout.WGMMA, optimized=False)
      w_o = w
      if scales:
        o_j = lax.bitcast_convert_type(o_j, jnp.float16).astype(jnp.float32)
        # A power of two: w * scale rounds as o_j * scale would. A dead
        # slot's scale is whatever its bytes hold: selected away too.
        scale_j = plgpu.load(scales[1].at[j], layout=row_layout, optimized=False)
        w_o = jnp.where(live, w * scale_j, 0.0)
      o_j = jnp.where(lax.broadcast_in_dim(live, o_j.shape, [0]), o_j, 0.0)
      acc = acc + o_j * lax.broadcast_in_dim(w_o, acc.shape, [0])
      l = l + w
    if k + stages < groups:
      # Every thread's reads of the slot are ordered before its refill.
      plgpu.commit_smem()
      pl.when((k + stages) * GROUP < n)(lambda k=k: fetch(k + stages))
  return acc, m, l
