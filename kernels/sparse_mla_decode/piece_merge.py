"""The merge of a row's split or piece partials as one Mosaic GPU kernel.

Sparse decode leaves partials where a row's top-k list was cut: every row's
splits (`num_splits > 1` without clusters), or the pieces of the batch's last
rows (`cut_rows`). `combine_splits` (plain jnp) is the specification of their
merge; XLA runs it as two to four kernels after the decode kernel, each
mostly its own fixed cost, and its reduction over the pieces axis grows with
the axis (3.8-9.2 µs on the H200 for 2-17 MB of partials). This kernel took
2.1-4.9 µs there, 1.2-2.9 µs less per call (NOTES.md).

Here one CTA per (row, head group, `cols` value channels) brings all of the
row's partial tiles into SMEM at once by TMA, `pieces_per_copy` pieces a copy
and the pieces' LSE in one more, takes the LSE maximum first, then sums the
weighted tiles as they land, and stores its tile of the result by TMA. Cut
rows are merged into the decode kernel's output in place (a Pallas state
discharge aliases it): the rows the kernel finished are neither read nor
written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels._common import num_sms
from jaxkv.kernels.mla_decode.layout import (
    HALF,
    HEAD_TILE,
    LATENT,
    LOG2E,
    by_head_group,
    last_group_rows,
    stage_head_group,
)
from jaxkv.kernels.mla_decode.seesaw import softmax_finish, softmax_start
from jaxkv.kernels.sparse_mla_decode.stream import Stream

# SMEM for a CTA's partial tiles: `pieces x 64 x cols` float32.
TILES_SMEM = 128 * 1024
# Value channels per CTA: the most that fit, halved while the grid is short of
# the SMs (a CTA's copies are then smaller and more of them run at once).
MAX_COLS = 64
MIN_COLS = 8
# Pieces in SMEM at once at 16 channels, and mbarriers per group.
MAX_PIECES = 32
# A row's tiles come in at most `COPIES` TMA copies of up to `PIECES_PER_COPY`
# pieces each, the first copy's sums starting while the others land. On the
# H200 (2026-12-04), 1 x 64 heads at 32 splits merged in 11.7 µs end to end
# at 8 a copy against 13.0 at one and 12.4 at all 32; the stream's 83 x 128
# (17 rows of 4-5 pieces, 2026-12-06) in 4.5 µs at 1 or 2 a copy against 5.5
# at all of them in one.
PIECES_PER_COPY = 8
COPIES = 4
# The 16-bit SMEM tiles swizzled by default (`build_piece_merge(swizzle=)`).
# Off: on the H200 the swizzled build gave the same results and the same
# times (within 0.1 µs) and registers as plain rows, which are the simpler
# build (NOTES.md, "The swizzled merge tiles and copies of two pieces, timed").
SWIZZLE = False


def pieces_per_copy(pieces: int) -> int:
  """Pieces' tiles per TMA copy for a row of `pieces` partials."""
  return min(PIECES_PER_COPY, -(-pieces // COPIES))


def merge_cols(*, rows: int, head_groups: int, pieces: int, sms: int | None = None) -> int:
  """Value channels per CTA for `rows` rows of `pieces` partials each."""
  sms = num_sms() if sms is None else sms
  cols = MAX_COLS
  while cols > MIN_COLS and (pieces * HEAD_TILE * cols * 4 > TILES_SMEM
                             or rows * head_groups * (LATENT // cols) < sms):
    cols //= 2
  return cols


def weighted_merge(lses, parts, *, cols: int, select: bool, scales=None, present=None):
  """`combine_splits` of a row tile's partials, in registers: `(result, LSE)`.

  Args:
    lses: for each partial, a function giving its `[64]` f32 LSE (WGMMA
      rows) in log2 units (-inf: it attended to nothing, weight 0; NaN: it
      met NaN in a slot it read as valid, and poisons the row), called
      twice: for the partials' maximum first, then for each weight.
    parts: for each partial, a function giving its normalised `[64, cols]`
      f32 tile (WGMMA layout), called once, in order.
    cols: the tiles' channels.
    select: the mask mode. In "multiply" (False) a NaN in a partial of no
      weight poisons its row, as the production merge's weight-0 product
      does; in "select" such a partial's tile is never used.
    scales: None, or for each partial a function giving its `[64]` f32
      scale (WGMMA rows): `parts` are then float16 values of the partials
      divided by it (`layout.scaled_half`), and each tile's weight is
      multiplied by it. A power of two: `w * scale` rounds as `o * scale`
      would.
    present: None, or for each partial a traced bool: where False, it is
      no partial of this row (its LSE, tile and scale are whatever the
      memory held) and is weighed 0 and never added, NaN or not.

  Returns:
    the merged `[64, cols]` f32 tile (0 in a row of no live partial, even
    where "multiply" met NaN) and its natural-log LSE (-inf there); both NaN
    in a row where a live partial's LSE is NaN.
  """
  if present is not None:  # an absent partial: LSE -inf (weight 0), its tile never kept
    # (A scalar predicate broadcast first: Mosaic GPU's select takes no
    # implicit broadcast.)
    def masked(lse, p):
      x = lse()
      return jnp.where(jnp.broadcast_to(p, x.shape), x, -jnp.inf)

    lses = [functools.partial(masked, lse, p) for lse, p in zip(lses, present)]
  m = lses[0]()
  for lse in lses[1:]:
    m = jnp.maximum(m, lse())
  m_ref = jnp.where(m == -jnp.inf, 0.0, m)  # no live partial: every weight 0
  acc, _, l = softmax_start(cols)
  for j, (lse, part) in enumerate(zip(lses, parts)):
    lse_j = lse()
    live = lse_j != -jnp.inf  # NaN is live: its weight NaN poisons the row
    w = jnp.where(live, jnp.exp2(lse_j - m_ref), 0.0)
    o_j = part()
    keep = lax.broadcast_in_dim(live, o_j.shape, [0])
    if not select:
      keep = keep | jnp.isnan(o_j)
      if present is not None:
        keep = keep & jnp.broadcast_to(present[j], keep.shape)
    # (A piece of no weight takes scale 1: its scale is never a NaN's way in.)
    w_o = w if scales is None else w * jnp.where(live, scales[j](), 1.0)
    acc = acc + jnp.where(keep, o_j, 0.0) * lax.broadcast_in_dim(w_o, acc.shape, [0])
    l = l + w
  res, lse = softmax_finish(acc, m, l)
  return jnp.where(lax.broadcast_in_dim(l != 0.0, res.shape, [0]), res, 0.0), lse


def build_piece_merge(
    *, rows: int, pieces: int, heads_padded: int, out_heads: int, out_dtype, select: bool,
    interpret, first_row: int | None = None, cols: int | None = None,
    per_copy: int | None = None, stream: Stream | None = None,
    q_heads: int | None = None, scaled: bool = False, swizzle: bool | None = None,
):
  """Returns `(o, lse) -> (out, lse_out)`, or with `first_row` `(o, lse, out,
  lse_out) -> (out, lse_out)` updating `out` and `lse_out` in place; with
  `scaled`, the partials' scales follow lse: `(o, lse, scale, ...)`.

  Args:
    rows, pieces: o is `[rows, pieces, heads_padded, 512]` and lse `[rows,
      pieces, heads_padded]`, float32: each piece's normalised partial and
      natural-log LSE (-inf for a piece that attended to nothing). Rows of
      the last head group past `out_heads` are never read.
    out_heads: the result's rows per batch row, `heads_padded` or the query's
      own heads (a multiple of 8 within the last head group).
    out_dtype: the result's dtype (16- or 32-bit).
    select: the mask mode. In "multiply" (False) a NaN in a piece of no
      weight (masked slots only, one of which met NaN) poisons its row, as
      the production merge's weight-0 product does; in "select" such a
      piece's tile is never used. A row whose pieces are all empty gets 0
      and -inf in both.
    interpret: the interpreter's parameters, or None to compile.
    first_row: None, a new `[rows, out_heads, 512]` result and `[rows,
      out_heads]` LSE; else row r's merge goes to row `first_row + r` of the
      `out` `[batch, out_heads, 512]` and `lse_out` `[batch, out_heads]`
      given, whose other rows come back as they were.
    cols: value channels per CTA (default `merge_cols`).
    per_copy: pieces' tiles per TMA copy (default `pieces_per_copy`; one
      where the last head group is short).
    stream: sparse decode's stream schedule (`stream.Stream`), with `rows`
      its `left_rows`, `pieces` at least its `max_pieces` and `first_row`
      its `first_left_row`: row r of o and lse holds the `row_pieces(r)`
      pieces of leftover row r (the others are no pieces: neither used nor
      weighed), merged into batch row `first_row + r`; a row in one piece
      was written whole by the decode kernel and is not read.
    q_heads: the real heads where fewer than `out_heads` (a multiple of 8
      within the last head group): only their partial rows are read and
      their result rows written (None: `out_heads`).
    scaled: o holds float16 partials as bfloat16 bits (`layout.scaled_half`,
      `layout.split_outputs(f16=True)`), and scale `[rows, pieces, 2,
      heads_padded]` f32 their scales by channel half: a CTA reads its
      half's, on the LSE's barrier, and weights each tile by its scale.
    swizzle: the 16-bit tiles in SMEM (the partials' with `scaled`, the
      result's with a 16-bit `out_dtype`) swizzled, their rows of `cols`
      channels read and written whole by each warp, or (False) plain rows,
      which a warp's WGMMA-layout loads and stores meet eight rows to a
      bank group (`cols` 64: 128-byte rows, eight-way conflicts). Only
      `cols` 16 to 64 (rows of 32 to 128 bytes) can be swizzled. None:
      `SWIZZLE` where they can.
  """
  head_groups = heads_padded // HEAD_TILE
  assert heads_padded % HEAD_TILE == 0 and 2 <= pieces <= MAX_PIECES
  assert stream is None or (first_row == stream.first_left_row and rows == stream.left_rows
                            and pieces >= stream.max_pieces)
  if cols is None:
    cols = merge_cols(rows=rows, head_groups=head_groups, pieces=pieces)
  assert LATENT % cols == 0 and pieces * HEAD_TILE * cols * 4 <= TILES_SMEM
  tail_heads = last_group_rows(out_heads if q_heads is None else q_heads, heads_padded)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  # Pieces per copy: a copy of several pieces' tiles needs them contiguous in
  # SMEM, which a short last head group's rows are not.
  per = pieces_per_copy(pieces) if per_copy is None else per_copy
  per = per if tail_heads == HEAD_TILE else 1
  if swizzle is None:
    swizzle = SWIZZLE and 16 <= cols <= 64
  assert not swizzle or 16 <= cols <= 64
  # A 16-bit tile's transforms: tiles of 8 rows and one swizzle span of channels.
  tiles16 = (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(2 * cols)) if swizzle else ()
  o_transforms = tiles16 if scaled else ()
  out_transforms = tiles16 if jnp.dtype(out_dtype).itemsize == 2 else ()

  def merge_kernel(o_ref, lse_ref, *refs):
    scale_ref = scale_buf = None
    if scaled:
      scale_ref, *refs, scale_buf = refs
    out_ref, lse_out_ref, o_buf, lse_buf, out_buf, lse_stage, o_bar, lse_bar = refs
    b, g, c = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("c")
    heads, chans = pl.ds(g * HEAD_TILE, HEAD_TILE), pl.ds(c * cols, cols)

    def merge_row(row, count=None):
      # b's pieces (the first `count`, a traced int; None: all) into the
      # result's row `row`.
      live = lambda j: True if count is None else j < count
      # The pieces' LSE (all 64 rows: 256 bytes a piece), and scaled, the
      # scales of the channel half `chans` lie in; then their tiles.
      plgpu.copy_gmem_to_smem(lse_ref.at[b, :, heads], lse_buf, lse_bar)
      if scaled:
        half = lax.div(c * cols, HALF)
        plgpu.copy_gmem_to_smem(scale_ref.at[b, :, half, heads], scale_buf, lse_bar)

      def fetch(first_head, n, at_once):  # the tiles' first n rows, `at_once` pieces a copy
        for j in range(0, pieces, at_once):
          k = min(at_once, pieces - j)
          src = o_ref.at[pl.ds(b * pieces + j, k), pl.ds(first_head, n), chans]
          pl.when(live(j))(lambda src=src, j=j, k=k: plgpu.copy_gmem_to_smem(
              src, o_buf.at[pl.ds(j, k), pl.ds(0, n)], o_bar.at[j]))

      # A last head group of fewer real heads reads their tiles' rows alone:
      # the decode kernel writes no other rows of its partials. The tiles'
      # other rows hold whatever SMEM held; each row's merge is its own and no
      # store takes them.
      by_head_group(g, head_groups=head_groups, tail_heads=tail_heads,
                    whole=lambda: fetch(g * HEAD_TILE, HEAD_TILE, per),
                    tail=lambda: fetch(heads_padded - HEAD_TILE, tail_heads, 1))

      def log2_lse(j):
        # Loaded again where used: every piece's LSE held in registers would
        # not fit beside the accumulator at 32 pieces.
        return plgpu.load(lse_buf.at[j], layout=row_layout, optimized=False) * LOG2E

      plgpu.barrier_wait(lse_bar)

      def tile(j):  # piece j's tile, once it has landed
        if j % per == 0:
          pl.when(live(j))(lambda: plgpu.barrier_wait(o_bar.at[j]))
        o_j = plgpu.load(o_buf.at[j], layout=plgpu.Layout.WGMMA, optimized=bool(o_transforms))
        if scaled:
          o_j = lax.bitcast_convert_type(o_j, jnp.float16).astype(jnp.float32)
        return o_j

      scales = None
      if scaled:
        scales = [lambda j=j: plgpu.load(scale_buf.at[j], layout=row_layout, optimized=False)
                  for j in range(pieces)]
      res, lse = weighted_merge(
          [lambda j=j: log2_lse(j) for j in range(pieces)],
          [lambda j=j: tile(j) for j in range(pieces)], cols=cols, select=select,
          scales=scales, present=None if count is None else [live(j) for j in range(pieces)])
      res = res.astype(out_dtype)

      stage_head_group(out_buf, res, lambda rows: out_ref.at[row, rows, chans], g,
                       heads=heads, head_groups=head_groups, tail_heads=tail_heads, lse=lse,
                       lse_at=lambda rows: lse_out_ref.at[row, rows], lse_buf=lse_stage,
                       lse_when=lambda: c == 0)

    if stream is None:
      merge_row(b if first_row is None else first_row + b)
    else:  # only where the row was cut
      count = stream.row_pieces(b)
      pl.when(count > 1)(lambda: merge_row(first_row + b, count))

  outputs = (jax.ShapeDtypeStruct((rows, out_heads, LATENT), out_dtype),
             jax.ShapeDtypeStruct((rows, out_heads), jnp.float32))
  call = plgpu.kernel(
      merge_kernel,
      out_type=() if first_row is not None else outputs,
      grid=(rows, head_groups, LATENT // cols),
      grid_names=("b", "g", "c"),
      scratch_types=[
          plgpu.SMEM((pieces, HEAD_TILE, cols), jnp.bfloat16 if scaled else jnp.float32,
                     transforms=o_transforms),
          plgpu.SMEM((pieces, HEAD_TILE), jnp.float32),
          plgpu.SMEM((HEAD_TILE, cols), out_dtype, transforms=out_transforms),
          plgpu.SMEM((HEAD_TILE,), jnp.float32),
          plgpu.Barrier(num_arrivals=1, num_barriers=pieces),
          plgpu.Barrier(num_arrivals=2 if scaled else 1),  # the LSE (and scales)
          *([plgpu.SMEM((pieces, HEAD_TILE), jnp.float32)] if scaled else []),
      ],
      compiler_params=plgpu.CompilerParams(approx_math=True),
      kernel_name="jaxkv_sparse_mla_decode_merge",
      interpret=interpret,
  )
  # The partials with rows and pieces as one dimension (a free reshape): a
  # copy of several pieces' tiles is then a box of three dimensions.
  flat = lambda o: o.reshape(rows * pieces, heads_padded, LATENT)
  if first_row is None:
    return lambda o, lse, *scale: call(flat(o), lse, *scale)

  def merge_in_place(o, lse, *rest):
    scale, (out, lse_out) = rest[:-2], rest[-2:]  # (scale,) if scaled
    assert first_row + rows <= out.shape[0] and out.shape[1:] == (out_heads, LATENT)

    def in_place(refs):
      call(flat(o), lse, *scale, *refs)

    return pl.run_state(in_place)((out, lse_out))

  return merge_in_place
