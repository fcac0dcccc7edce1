"""The merge of a row's split partials by the cluster of CTAs that computed them
(sparse decode's `cluster_merge`): no combine kernel after the decode kernel.

A row's splits (2, 4 or 8), or a cut row's two halves, are one cluster of CTAs.
Consumer w of CTA s merges piece s of its value half (channels
`[256 w + s * 256 / n, + 256 / n)`) of all n partials: it stores the other
pieces of its own partial to GMEM for the CTAs that merge them and keeps piece
s in registers; the cluster meets at a barrier (`barrier.cluster`, release and
acquire at cluster scope, so the stores are visible to every CTA of the
cluster after it); then it reads piece s of the other partials back from L2,
merges them as `combine_splits` does, and stores its piece of the result.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels._cluster import cluster_sync, interpreted_cluster_sync
from jaxkv.kernels.mla_decode.layout import (
    HALF,
    HEAD_TILE,
    LOG2E,
    stage_head_group,
    store_head_rows,
)
from jaxkv.kernels.sparse_mla_decode.piece_merge import weighted_merge


def merge_row(
    o, lse, part_o_ref, part_lse_ref, out_ref, out_lse_ref, *, wg: int, split, g,
    cluster_size: int, head_groups: int, tail_heads: int, select: bool, out_dtype,
    cluster_bar=None, stage_ref=None, lse_stage_ref=None,
) -> None:
  """One consumer's share of the merge of a row and head group in its cluster.

  Args:
    o: `[64, 256]` f32 (WGMMA layout): this CTA's normalised partial of value
      half `wg` (static).
    lse: `[64]` f32 (WGMMA rows): its natural-log LSE.
    part_o_ref, part_lse_ref: `[cluster_size, heads_padded, 512]` and
      `[cluster_size, heads_padded]` f32 (GMEM): the row's exchange, CTA k's
      partial at k (each CTA writes the pieces the others merge).
    out_ref, out_lse_ref: `[out_heads, 512]` and `[out_heads]` (GMEM): the
      row's result in `out_dtype` and its LSE; `out_heads` is the padded
      heads, or with `stage_ref` the query's own (a multiple of 8).
    split: this CTA's index in the cluster; g: the head group.
    cluster_bar: interpreted, a `ClusterBarrier` of the cluster's consumers
      (the interpreter has no `barrier.cluster`); compiled, None.
    stage_ref: None (the result's piece goes out from registers, whole head
      groups' rows) or `[64, 512 / cluster_size]` bf16 SMEM of this consumer's
      own, through which it goes out by TMA, the last head group's real rows
      alone (`lse_stage_ref`, `[64]` f32 SMEM, stages their LSE).
  """
  heads = pl.ds(g * HEAD_TILE, HEAD_TILE)
  compiled = cluster_bar is None
  merge_cols = HALF // cluster_size  # value channels each consumer merges
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  def share(k):  # piece k of our value half: the channels CTA k merges
    return o[:, k * merge_cols:(k + 1) * merge_cols]

  # Our partial for the cluster: every piece of our half but our own CTA's,
  # which stays in registers, and the LSE.
  for k in range(cluster_size):
    pl.when(split != k)(lambda k=k: store_head_rows(
        part_o_ref.at[split, heads, pl.ds(wg * HALF + k * merge_cols, merge_cols)], share(k), g,
        head_groups=head_groups, tail_heads=tail_heads, compiled=compiled))
  if wg == 0:
    part_lse_ref[split, heads] = lse
  if compiled:
    cluster_sync()
  else:
    interpreted_cluster_sync(cluster_bar)

  # Piece `split` of every partial: ours from registers, the others' from L2.
  chans = pl.ds(wg * HALF + split * merge_cols, merge_cols)
  split_rows = plgpu.layout_cast(jnp.full((HEAD_TILE,), split, jnp.int32), row_layout)
  own = share(0)
  for k in range(1, cluster_size):
    pick = lax.broadcast_in_dim(split_rows == k, own.shape, [0])
    own = jnp.where(pick, share(k), own)
  peers = [lax.rem(split + d, cluster_size) for d in range(1, cluster_size)]
  lses = [lse * LOG2E] + [
      plgpu.load(part_lse_ref.at[j, heads], layout=row_layout, optimized=False) * LOG2E
      for j in peers]
  parts = [lambda: own] + [
      lambda j=j: plgpu.load(part_o_ref.at[j, heads, chans], layout=plgpu.Layout.WGMMA,
                             optimized=False)
      for j in peers]
  res, lse_row = weighted_merge([lambda v=v: v for v in lses], parts, cols=merge_cols,
                                select=select)
  res = res.astype(out_dtype)

  if stage_ref is None:
    store_head_rows(out_ref.at[heads, chans], res, g, head_groups=head_groups,
                    tail_heads=tail_heads, compiled=compiled)
    if wg == 0:

      @pl.when(split == 0)
      def _():  # the row's LSE, once per cluster (CTA 0's first consumer)
        out_lse_ref[heads] = lse_row

    return
  # Through SMEM by TMA, as a whole row's staged result: whole rows (bf16 from
  # registers would fill half of each sector a warp store touches), and the
  # last head group's real rows alone.
  stage_head_group(stage_ref, res, lambda rows: out_ref.at[rows, chans], g, heads=heads,
                   head_groups=head_groups, tail_heads=tail_heads, lse=lse_row,
                   lse_at=lambda rows: out_lse_ref.at[rows], lse_buf=lse_stage_ref,
                   lse_when=(lambda: split == 0) if wg == 0 else False)
