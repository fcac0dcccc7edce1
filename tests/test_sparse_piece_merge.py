"""The merge kernel of sparse decode's split and piece partials against `combine_splits`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode.combine import combine_splits
from jaxkv.kernels.sparse_mla_decode.piece_merge import (
    MAX_PIECES,
    build_piece_merge,
    merge_cols,
)
from jaxkv.kernels.sparse_mla_decode.stream import Stream

INTERPRET = plgpu.InterpretGPUParams(detect_races=True)
# Without the race detector: for many pieces, whose copies and barriers are
# those of the race-checked cases, more of them.
FAST = plgpu.InterpretGPUParams()


def _partials(seed, rows, pieces, hp, *, select):
  """Random partials with empty pieces (LSE -inf): piece 1 of row 0 in every
  head, piece 0 of row 1 in heads 8-15, every piece of the last row in heads
  0-7 (a row of empty pieces alone) and of row 1 in heads 16-23. Empty pieces
  hold NaN in "multiply" where one met a NaN null block (row 0: heads 3 and
  the last head group's first), and in "select" their tiles are 0 as the
  kernel writes them. Every row past the real ones is NaN."""
  ko, kl = jax.random.split(jax.random.key(seed))
  o = jax.random.normal(ko, (rows, pieces, hp, 512), jnp.float32)
  lse = jax.random.normal(kl, (rows, pieces, hp), jnp.float32) * 4.0
  empty = np.zeros((rows, pieces, hp), bool)
  empty[0, 1] = True
  empty[1, 0, 8:16] = True
  empty[-1, :, 0:8] = True
  empty[1, :, 16:24] = True
  lse = jnp.where(empty, -jnp.inf, lse)
  o = jnp.where(empty[..., None], 0.0, o)
  if not select:
    o = o.at[0, 1, 3, 7].set(jnp.nan).at[0, 1, hp - 64, 100].set(jnp.nan)
    o = o.at[-1, 0, 2, 5].set(jnp.nan)  # in a row of empty pieces: still 0
  return o, lse


def _check(out, lse, o, lse_in, out_heads, *, select):
  want_o, want_lse = combine_splits(o[:, :, :out_heads], lse_in[:, :, :out_heads],
                                    empty_nan=not select)
  got = np.asarray(out, np.float32)
  want = np.asarray(want_o.astype(out.dtype), np.float32)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  tol = 1e-5 if out.dtype == jnp.float32 else 8e-3
  np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=2e-5, rtol=2e-6)
  return want


@pytest.mark.parametrize(
    "select, pieces, hp, out_heads, out_dtype, cols, per_copy",
    [(True, 4, 128, 128, jnp.bfloat16, 64, None), (False, 3, 128, 72, jnp.float32, 32, None),
     (False, 8, 64, 16, jnp.bfloat16, None, None), (True, 32, 64, 64, jnp.float32, 16, None),
     (False, 16, 64, 40, jnp.bfloat16, 32, None), (False, 12, 128, 128, jnp.bfloat16, 32, 5)],
)
def test_matches_combine_splits(select, pieces, hp, out_heads, out_dtype, cols, per_copy):
  """A new result: each row's merge as `combine_splits` gives it (NaN in
  exactly its places), at 3 to 32 pieces and 8 (`merge_cols`' choice at 8
  pieces) to 64 channels, whole and partial last head groups (the rows past
  `out_heads` hold NaN and are never read), bf16 and f32; whole groups'
  tiles come 8 pieces a copy (4 copies at 32 pieces), or 5, 5 and 2."""
  rows = 3
  if cols is None:
    assert merge_cols(rows=rows, head_groups=hp // 64, pieces=pieces) == 8
  o, lse = _partials(1, rows, pieces, hp, select=select)
  o = o.at[:, :, out_heads:].set(jnp.nan)
  lse = lse.at[:, :, out_heads:].set(jnp.nan)
  merge = build_piece_merge(rows=rows, pieces=pieces, heads_padded=hp, out_heads=out_heads,
                            out_dtype=out_dtype, select=select,
                            interpret=FAST if pieces >= 16 else INTERPRET, cols=cols,
                            per_copy=per_copy)
  out, out_lse = jax.jit(merge)(o, lse)
  assert out.shape == (rows, out_heads, 512) and out.dtype == out_dtype
  want = _check(out, out_lse, o, lse, out_heads, select=select)
  assert np.isnan(want).any() != select
  assert (want[-1, :8] == 0).all() and np.isneginf(np.asarray(out_lse[-1, :8])).all()


@pytest.mark.parametrize("select, out_heads", [(True, 128), (False, 72)])
def test_in_place_leaves_other_rows(select, out_heads):
  """With `first_row`, the cut rows' merge lands in rows 3-4 of the given
  result; rows 0-2 and 5 (the decode kernel's, here random bytes) come back
  bit for bit, and so do the last head group's rows past `out_heads`."""
  batch, rows, pieces, hp = 6, 2, 4, 128
  o, lse = _partials(2, rows, pieces, hp, select=select)
  bits = jax.random.bits(jax.random.key(3), (batch, out_heads, 512), jnp.uint16)
  base = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
  base_lse = jax.random.normal(jax.random.key(4), (batch, out_heads), jnp.float32)
  merge = build_piece_merge(rows=rows, pieces=pieces, heads_padded=hp, out_heads=out_heads,
                            out_dtype=jnp.bfloat16, select=select, interpret=INTERPRET,
                            first_row=3)
  out, out_lse = jax.jit(merge)(o, lse, base, base_lse)
  same = lambda a, b: np.testing.assert_array_equal(
      np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16)),
      np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint16)))
  for r in (0, 1, 2, 5):
    same(out[r], base[r])
    np.testing.assert_array_equal(np.asarray(out_lse[r]), np.asarray(base_lse[r]))
  _check(out[3:5], out_lse[3:5], o, lse, out_heads, select=select)


def test_merge_cols():
  """Channels per CTA: 64 where the grid fills the SMs and the tiles fit,
  fewer where the grid is short or the pieces many, never under 8."""
  assert merge_cols(rows=14, head_groups=2, pieces=4, sms=132) == 64
  assert merge_cols(rows=5, head_groups=2, pieces=8, sms=132) == 32
  assert merge_cols(rows=1, head_groups=2, pieces=8, sms=132) == 8
  assert merge_cols(rows=64, head_groups=2, pieces=16, sms=132) == 32
  assert merge_cols(rows=64, head_groups=2, pieces=MAX_PIECES, sms=132) == 16
  assert MAX_PIECES == 32


@pytest.mark.parametrize("first_row", [None, 5])
def test_lowers_for_hopper(first_row):
  """The compiled merge lowers for CUDA, and in place it aliases the result."""
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  rows, pieces, hp = 2, 8, 128
  merge = build_piece_merge(rows=rows, pieces=pieces, heads_padded=hp, out_heads=72,
                            out_dtype=jnp.bfloat16, select=False, interpret=None,
                            first_row=first_row)
  args = [f32(rows, pieces, hp, 512), f32(rows, pieces, hp)]
  if first_row is not None:
    args += [jax.ShapeDtypeStruct((first_row + rows, 72, 512), jnp.bfloat16),
             f32(first_row + rows, 72)]
  text = jax.jit(merge).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  assert ("output_operand_aliases" in text) == (first_row is not None)


@pytest.mark.parametrize(
    "cols, swizzle, out_dtype, q_heads",
    [(64, True, jnp.bfloat16, None), (32, True, jnp.bfloat16, 72), (16, True, jnp.float32, None),
     (64, False, jnp.bfloat16, 72), (8, None, jnp.bfloat16, None)],
)
def test_float16_tiles_lower_swizzled_or_plain(cols, swizzle, out_dtype, q_heads):
  """The merge of float16 partials lowers for CUDA with its 16-bit SMEM
  tiles swizzled (16-64 channels: 32-128-byte rows; a float32 result's
  staging tile stays plain) and plain (`swizzle=False`, and the default,
  here at 8 channels), whole and short last head groups, in place."""
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  rows, pieces, hp, batch = 3, 5, 128, 7
  out_heads = q_heads or hp
  merge = build_piece_merge(rows=rows, pieces=pieces, heads_padded=hp, out_heads=out_heads,
                            out_dtype=out_dtype, select=False, interpret=None, first_row=2,
                            cols=cols, q_heads=q_heads, scaled=True, swizzle=swizzle)
  args = [jax.ShapeDtypeStruct((rows, pieces, hp, 512), jnp.bfloat16), f32(rows, pieces, hp),
          f32(rows, pieces, 2, hp), jax.ShapeDtypeStruct((batch, out_heads, 512), out_dtype),
          f32(batch, out_heads)]
  text = jax.jit(merge).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "output_operand_aliases" in text


@pytest.mark.parametrize("select, q_heads", [(True, None), (False, 16)])
def test_stream_pieces_merge_into_the_rows_they_cut(select, q_heads):
  """With `stream`, row i of the pieces is leftover row i of the stream
  schedule (`stream.Stream`), its first `row_pieces(i)` slots its pieces:
  7 rows of 3 tiles in 5 parts, a whole row each first (leftover rows 5 and
  6 in 3 and 2 pieces: row 6's third slot holds no piece, NaN here in its
  tile and LSE); 5 rows of 2 tiles in 3 parts (leftover row 3 in 2 pieces,
  row 4 in one run, written whole by the decode kernel: not merged); and the
  plain stream, 4 rows of 5 tiles in 3 parts (rows 1 and 2 in two pieces, 0 and 3 whole). A cut
  row gets `combine_splits` of its pieces; every other row (random bytes)
  comes back bit for bit. With `q_heads`, only the real heads' partial rows
  are read (the others are NaN) and only their result rows written."""
  hp = 64
  out_heads = hp
  for stream in (Stream(7, 3, 5, 1), Stream(5, 2, 3, 1), Stream(4, 5, 3, 0)):
    counts = [stream.row_pieces(i) for i in range(stream.left_rows)]
    rows, pieces = max(stream.left_rows, 2), max(stream.max_pieces, 2)
    o, lse = _partials(5, rows, pieces, hp, select=select)
    absent = np.arange(pieces) >= np.array(counts + [0] * (rows - len(counts)))[:, None]
    o = jnp.where(absent[:, :, None, None], jnp.nan, o)
    lse = jnp.where(absent[:, :, None], jnp.nan, lse)
    if q_heads:
      o = o.at[:, :, q_heads:].set(jnp.nan)
      lse = lse.at[:, :, q_heads:].set(jnp.nan)
    batch = stream.batch
    bits = jax.random.bits(jax.random.key(6), (batch, out_heads, 512), jnp.uint16)
    base = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    base_lse = jax.random.normal(jax.random.key(7), (batch, out_heads), jnp.float32)
    merge = build_piece_merge(rows=stream.left_rows, pieces=pieces, heads_padded=hp,
                              out_heads=out_heads, out_dtype=jnp.bfloat16, select=select,
                              interpret=INTERPRET, first_row=stream.first_left_row,
                              stream=stream, q_heads=q_heads)
    out, out_lse = jax.jit(merge)(o[:stream.left_rows], lse[:stream.left_rows], base, base_lse)
    bits16 = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))
    real = q_heads or out_heads
    merged = 0
    for r in range(batch):
      i = r - stream.first_left_row
      if i >= 0 and counts[i] > 1:
        merged += 1
        n = counts[i]
        _check(out[r:r + 1, :real], out_lse[r:r + 1, :real], o[i:i + 1, :n],
               lse[i:i + 1, :n], real, select=select)
        np.testing.assert_array_equal(bits16(out[r, real:]), bits16(base[r, real:]))
      else:
        np.testing.assert_array_equal(bits16(out[r]), bits16(base[r]))
        np.testing.assert_array_equal(np.asarray(out_lse[r]), np.asarray(base_lse[r]))
    assert merged == stream.cut_rows


@pytest.mark.parametrize("select, q_heads", [(True, None), (False, 72)])
def test_stream_merge_lowers_for_hopper(select, q_heads):
  """The compiled merge of the stream's pieces (float16, with their scales;
  rows of fewer pieces than the most) lowers for CUDA, in place: 83 rows x
  128 heads in 66 parts, a whole row each first (17 leftover rows in 4-5
  pieces); with 72 real heads, the short last head group's rows alone."""
  s = Stream(83, 32, 66, 1)
  hp = 128
  out_heads = q_heads or hp
  merge = build_piece_merge(rows=s.left_rows, pieces=s.max_pieces, heads_padded=hp,
                            out_heads=out_heads, out_dtype=jnp.bfloat16, select=select,
                            interpret=None, first_row=s.first_left_row, stream=s,
                            q_heads=q_heads, scaled=True)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  args = [jax.ShapeDtypeStruct((s.left_rows, s.max_pieces, hp, 512), jnp.bfloat16),
          f32(s.left_rows, s.max_pieces, hp), f32(s.left_rows, s.max_pieces, 2, hp),
          jax.ShapeDtypeStruct((83, out_heads, 512), jnp.bfloat16), f32(83, out_heads)]
  text = jax.jit(merge).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "output_operand_aliases" in text
