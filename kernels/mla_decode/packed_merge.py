"""The per-split ring merge for rows of 8-32 heads: `64 // heads` rows of the
batch stacked in one CTA's tile (`build_packed_merge`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .layout import HEAD_TILE, TILE, query_rows
from .merge import merge_call
from .ring import ring_step
from .merge_tiling import MAX_SPLITS, kernel_wrote_row, live_splits, merge_tiling
from .seesaw import softmax_finish, softmax_start


def pack_rows(*, heads: int, head_groups: int, num_splits: int) -> int:
  """Rows of the batch one CTA of the per-split ring merges at once
  (`build_packed_merge`): `64 // heads` where a row's real heads fill at
  most half of the one head group (the tensor-parallel 8-32 heads) and one
  pass takes the rows' splits; else 1 (`build_merge`)."""
  if head_groups != 1 or heads > HEAD_TILE // 2 or num_splits > MAX_SPLITS:
    return 1
  return HEAD_TILE // heads


def rows_stack(*, heads: int, num_splits: int) -> bool:
  """Whether rows of `heads` real heads and `num_splits` splits qualify for
  the stacked merge (`pack_rows` of the query rows the decode kernels take,
  `query_rows`, in their head groups of 64, above 1). Only then can the
  wrapper's `pack` change anything; the wrapper also keeps such rows'
  partials in float32."""
  return pack_rows(heads=query_rows(heads), head_groups=-(-heads // HEAD_TILE),
                   num_splits=num_splits) > 1


def build_packed_merge(
    *, batch: int, num_splits: int, heads: int, dv: int, max_tokens: int, out_dtype,
    interpret, finish_rows: bool = False, cols: int | None = None, stages: int | None = None,
):
  """The per-split ring merge for rows of few heads: one CTA per `64 //
  heads` rows of the batch (and `cols` value channels), their heads stacked
  in the rows of one `[64, cols]` tile.

  At 16 heads a CTA of `build_merge` copies 16 real rows into a 64-row ring
  (48 KB of SMEM for three splits: three CTAs per SM), so the 1,024 CTAs of
  batch 128 ran in about three waves of latency-bound copies (7.5 µs on the
  H200 for 8 MB of partials). Stacked, each copy brings one row's real heads
  into its own rows of the tile, a quarter of the CTAs fill the SMs at once,
  and every row of the tile is real.

  Same arguments and results as `build_merge` with `partial_heads=heads`
  and `stage_out` (a 16-bit `out_dtype`): o `[batch, num_splits, 64, dv]`
  and lse `[batch, num_splits, 64]` f32 (the decode kernel's partials, of
  which the first `heads` rows are written), out `[batch, heads, dv]` and
  lse_out `[batch, heads]` (with `finish_rows`, the decode kernel's
  `[batch, 64, dv]` and `[batch, 64]`, updated in place at the rows it did
  not write, its first `heads` rows). The splits of the stacked rows are
  walked together, up to the most any of them has; a split past a row's
  live ones is still copied (in bounds, its bytes never written) and
  selected away, so each ring slot completes on a fixed count of copies.
  """
  pack = HEAD_TILE // heads
  assert heads % 8 == 0 and pack >= 2 and jnp.dtype(out_dtype).itemsize == 2
  assert num_splits <= MAX_SPLITS
  if cols is None or stages is None:
    cols, stages = merge_tiling(num_splits)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  real = pl.ds(0, heads)

  def merge_kernel(seq_ref, bounds_ref, o_ref, lse_ref, *refs):
    out_ref, lse_out_ref, o_buf, lse_buf, bar, out_buf, lse_stage = refs
    c = lax.axis_index("c")
    chans = pl.ds(c * cols, cols)
    rows = []  # per stacked row: (batch row, live splits, whether this CTA writes it)
    for k in range(pack):
      b_k = lax.axis_index("b") * pack + k
      b = jnp.minimum(b_k, batch - 1)  # past the batch: a real row's bytes, never stored
      ntiles = (jnp.clip(seq_ref[b], 0, max_tokens) + TILE - 1) // TILE

      def bound(j, b=b, ntiles=ntiles):
        return jnp.clip(bounds_ref[b, j], 0, ntiles)

      mine = b_k < batch
      if finish_rows:
        mine &= ~kernel_wrote_row(ntiles, bound(0), bound(1))
      rows.append((b, jnp.where(mine, live_splits(bound, num_splits), 0), mine))
    n = rows[0][1]
    for _, n_k, _ in rows[1:]:
      n = jnp.maximum(n, n_k)
    # Each tile row's own live splits (rows past the stacked ones: none).
    stacked = plgpu.broadcasted_iota(jnp.int32, (HEAD_TILE,), 0, layout=row_layout) // heads
    n_rows = plgpu.layout_cast(jnp.full((HEAD_TILE,), 0, jnp.int32), row_layout)
    for k, (_, n_k, _) in enumerate(rows):
      n_rows = jnp.where(stacked == k, n_k, n_rows)

    def fetch(j):
      slot = lax.rem(j, stages)
      for k, (b, _, _) in enumerate(rows):
        at = pl.ds(k * heads, heads)
        plgpu.copy_gmem_to_smem(o_ref.at[b, j, real, chans], o_buf.at[slot, at], bar.at[slot])
        # A plain bulk copy (contiguous, in bounds): a TMA box needs a
        # 128-byte aligned SMEM address, and row k's LSE starts at 4 * heads *
        # k bytes (a misaligned-address fault on the H200 otherwise).
        plgpu.copy_gmem_to_smem(lse_ref.at[b, j, real], lse_buf.at[slot, at], bar.at[slot],
                                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

    for j in range(stages):
      pl.when(j < n)(lambda j=j: fetch(j))

    def live_rows(j):  # the tile rows whose row's split j is live
      return plgpu.layout_cast(jnp.full((HEAD_TILE,), j, jnp.int32), row_layout) < n_rows

    step = functools.partial(ring_step, bar=bar, lse_buf=lse_buf, o_buf=o_buf, stages=stages,
                             n=n, fetch=fetch, live_rows=live_rows)
    acc, m, l = lax.fori_loop(0, n, step, softmax_start(cols))
    o, lse = softmax_finish(acc, m, l)
    out_buf[...] = o.astype(out_dtype)
    lse_stage[...] = lse
    plgpu.commit_smem()  # the copies (async proxy) read what the stores wrote
    for k, (b, _, mine) in enumerate(rows):
      # (The out box starts `heads * k` rows of `2 * cols` bytes in, a
      # multiple of 512 bytes for every head count and tiling that stacks, as
      # the value boxes above are; the LSE, contiguous, goes by a plain bulk
      # copy, 16-aligned.)
      at = pl.ds(k * heads, heads)
      pl.when(mine)(lambda b=b, at=at: plgpu.copy_smem_to_gmem(
          out_buf.at[at], out_ref.at[b, real, chans]))
      pl.when(mine & (c == 0))(lambda b=b, at=at: plgpu.copy_smem_to_gmem(
          lse_stage.at[at], lse_out_ref.at[b, real]))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  scratch = [
      plgpu.SMEM((stages, HEAD_TILE, cols), jnp.float32),
      plgpu.SMEM((stages, HEAD_TILE), jnp.float32),
      plgpu.Barrier(num_arrivals=2 * pack, num_barriers=stages),
      plgpu.SMEM((HEAD_TILE, cols), out_dtype),
      plgpu.SMEM((HEAD_TILE,), jnp.float32),
  ]
  call = plgpu.kernel(
      merge_kernel,
      out_type=() if finish_rows else (
          jax.ShapeDtypeStruct((batch, heads, dv), out_dtype),
          jax.ShapeDtypeStruct((batch, heads), jnp.float32),
      ),
      grid=(-(-batch // pack), dv // cols),
      grid_names=("b", "c"),
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      kernel_name="jaxkv_mla_decode_merge",
      interpret=interpret,
  )
  return merge_call(call, finish_rows=finish_rows)
