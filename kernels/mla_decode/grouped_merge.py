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


def merge_row_grouped(b, count, chans, o_ref, lse_ref, o_buf, lse_buf, bar, scales, merged, *,
                      num_splits: int, dv: int, cols: int, heads_padded: int, stages: int,
                      halves=None, lean: bool = True):
  """Merges row b's n live splits (its first n; a CTA merges all of a row's
  splits, or in `halves` half of them), `GROUP` per copy, weighted by their
  LSE maximum taken first, and calls `merged(acc, m, l)` with the sums (m in
  log2 units, -inf where no split is live). `count()` gives n (it loads the
  row's bounds from GMEM).

  chans: this CTA's `pl.ds` of value channels. o_ref: `wide_partials`'
  layout flattened to `[-1, 64, cols]` (`merge.merge_call`'s `flat`), lse_ref
  `[batch, head_groups, num_splits, 64]` f32; o_buf `[stages, GROUP, 64,
  cols]` (float32, or float16 bits as bf16) and lse_buf `[num_splits, 64]`
  f32 in SMEM; bar `(o_bar [stages], lse_bar)`. scales: float16 partials'
  `(scale_ref [batch, head_groups, 2, num_splits, 64], scale_buf
  [num_splits, 64])`, else None.

  halves: None, or `(h, acc_ref, l_ref, sync)` for a cluster of two CTAs
  per tile (h its index in the cluster): both take the maximum over every
  split's LSE, so that their weights agree; CTA h sums groups `[h * half,
  (h + 1) * half)` of the row's (half: the groups over two, rounded up); CTA
  1 hands its `acc` `[64, cols]` and `l` `[64]` f32 on through GMEM (its
  tile's `acc_ref`, `l_ref`) and meets CTA 0 at `sync()` (the cluster's
  barrier), after which CTA 0 adds them to its own and calls `merged`. CTA 1
  calls nothing.

  The maximum and the sums are loops: over the live splits or groups for the
  maximum, over the live groups for the sums, each group's `GROUP` splits
  unrolled inside. (Straight-line code over every split slot, removed, grew
  with the splits, ~100 KB at 133, and was slower wherever it was timed:
  NOTES.md.)

  lean: n is counted after the LSE's, the scales' and the row's first group's
  copies are issued, not before (its loads then overlap theirs instead of
  holding them back), and the maximum loops over the live groups with each
  group's `GROUP` LSE loads unrolled (independent loads), not over the live
  splits one dependent load at a time (False: the loops as first timed).
  """
  o_bar, lse_bar = bar
  groups = -(-num_splits // GROUP)
  n = None if lean else count()
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  half = lax.div(chans.start, HALF)  # the channel half these channels are in
  del chans  # o is `wide_partials`' layout, flattened
  run_start = ((b * (dv // cols) + lax.axis_index("c")) * (heads_padded // HEAD_TILE)
               + lax.axis_index("g")) * num_splits

  def fetch(k, first):
    # The group's `[GROUP, 64, cols]` is contiguous in GMEM and inside the
    # array (the last box ends at the row's last slot): Mosaic GPU issues
    # one bulk copy for it, not a TMA box of `cols * 4`-byte rows. Slots
    # count from the CTA's first group.
    slot = (k - first) % stages if isinstance(k, int) else lax.rem(k - first, stages)
    rows = pl.ds(run_start + group_box_start(k, num_splits), GROUP)
    plgpu.copy_gmem_to_smem(o_ref.at[rows], o_buf.at[slot], o_bar.at[slot],
                            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

  # Every slot's LSE (a dead slot's bytes are selected away below), and the
  # CTA's first group: neither copy waits for the live count's loads (a row
  # with any split has split 0 live).
  plgpu.copy_gmem_to_smem(lse_ref.at[b, lax.axis_index("g")], lse_buf, lse_bar,
                          oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
  if scales:  # every slot's scale of our half, one run like the LSE
    scale_ref, scale_buf = scales
    plgpu.copy_gmem_to_smem(scale_ref.at[b, lax.axis_index("g"), half], scale_buf, lse_bar,
                            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

  def live_rows(j, n):
    # Split j is live, as a row-layout mask (a scalar does not select an array).
    return plgpu.layout_cast(jnp.full((HEAD_TILE,), j, jnp.int32), row_layout) < n

  def log2_lse(j):
    # Loaded again where used: all splits' maxima held in registers would
    # not fit beside the accumulator.
    return plgpu.load(lse_buf.at[j], layout=row_layout, optimized=False) * LOG2E

  def add_split(acc, l, m, j, live, slot, offset):
    # Split j's tile (`offset` in its group's copy, in ring slot `slot`),
    # weighted, added to the sums; nothing where not `live`.
    w = jnp.where(live, jnp.exp2(log2_lse(j) - m), 0.0)
    o_j = plgpu.load(o_buf.at[slot, offset], layout=plgpu.Layout.WGMMA, optimized=False)
    w_o = w
    if scales:
      o_j = lax.bitcast_convert_type(o_j, jnp.float16).astype(jnp.float32)
      # A power of two: w * scale rounds as o_j * scale would. A dead
      # slot's scale is whatever its bytes hold: selected away too.
      scale_j = plgpu.load(scales[1].at[j], layout=row_layout, optimized=False)
      w_o = jnp.where(live, w * scale_j, 0.0)
    o_j = jnp.where(lax.broadcast_in_dim(live, o_j.shape, [0]), o_j, 0.0)
    return acc + o_j * lax.broadcast_in_dim(w_o, acc.shape, [0]), l + w

  def prefetch(start, end, first, n):
    # Groups [start, first + stages) of the CTA's [first, end) that hold a
    # live split (the row's first group whatever n is).
    for k in range(start, min(first + stages, end)):
      if k == 0:
        fetch(k, first)
      else:
        pl.when(k * GROUP < n)(lambda k=k: fetch(k, first))

  if lean:  # the row's first group (live whatever n is), then n
    if halves is None:
      fetch(0, 0)
    else:
      pl.when(halves[0] == 0)(lambda: fetch(0, 0))
    n = count()

  def sums(first, end, then):
    # Groups [first, end) (static) of the row, then `then(acc, m, l)`: the
    # maximum over the live splits (`lean`: groups), the sums over the live
    # groups of [first, end) (the first group of the row waited on whatever
    # n is, as it was fetched), a group's splits unrolled.
    # (`lean`: the row's first group was fetched before n was counted.)
    prefetch(first + 1 if lean and first == 0 else first, end, first, n)
    live_end = jnp.clip((n + GROUP - 1) // GROUP, first + 1 if first == 0 else first, end)
    plgpu.barrier_wait(lse_bar)
    m = plgpu.layout_cast(jnp.full((HEAD_TILE,), -jnp.inf, jnp.float32), row_layout)
    if lean:

      def group_max(k, m):  # a group's LSE loads, independent of each other
        lses = [jnp.where(live_rows(k * GROUP + i, n),
                          log2_lse(jnp.minimum(k * GROUP + i, num_splits - 1)), -jnp.inf)
                for i in range(GROUP)]
        while len(lses) > 1:
          lses = [jnp.maximum(x, y) for x, y in zip(lses[::2], lses[1::2])]
        return jnp.maximum(m, lses[0])

      m = lax.fori_loop(0, (n + GROUP - 1) // GROUP, group_max, m)
    else:
      m = lax.fori_loop(0, n, lambda j, m: jnp.maximum(m, log2_lse(j)), m)

    def group(k, carry):
      acc, l = carry
      slot = lax.rem(k - first, stages)
      plgpu.barrier_wait(o_bar.at[slot])
      start = group_box_start(k, num_splits)
      for i in range(GROUP):
        j = k * GROUP + i  # past the row's slots in a last short group: dead
        at = jnp.minimum(j, num_splits - 1)
        acc, l = add_split(acc, l, m, at, live_rows(j, n), slot, at - start)

      @pl.when(k + stages < live_end)
      def _():
        plgpu.commit_smem()  # every thread's reads of the slot before its refill
        fetch(k + stages, first)

      return acc, l

    acc, _, l = softmax_start(cols)
    acc, l = lax.fori_loop(first, live_end, group, (acc, l))
    then(acc, m, l)

  if halves is None:
    sums(0, groups, merged)
    return
  h, acc_ref, l_ref, sync = halves
  split_at = -(-groups // 2)

  def hand_on(acc, m, l):  # CTA 1: its sums to CTA 0
    del m  # CTA 0 took the same maximum
    acc_ref[...] = acc
    l_ref[...] = l
    sync()

  def take_in(acc, m, l):  # CTA 0: CTA 1's sums added to its own
    sync()
    acc = acc + plgpu.load(acc_ref, layout=plgpu.Layout.WGMMA, optimized=False)
    merged(acc, m, l + plgpu.load(l_ref, layout=row_layout, optimized=False))

  pl.when(h == 1)(lambda: sums(split_at, groups, hand_on))
  pl.when(h == 0)(lambda: sums(0, split_at, take_in))
