"""Sparse MLA decode's float16 partials (`SparseMLADecodeConfig.f16_partials`):
the kernel's scaled float16 partials (staged through the last tile's stage and
stored by TMA) against its float32 ones in the stream schedule, cut rows'
pieces and splits; the merge kernel on them against its merge of the same
values in float32; and whole calls, with NaN poisoning and values past
float16's range."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels.sparse_mla_decode import (
    SparseMLADecodeConfig,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)
from jaxkv.kernels.sparse_mla_decode.stream import Stream

from mla_problem import scaled_half_spec, unscaled_spec
from sparse_problem import (
    BLOCK_SIZE,
    FAST,
    INTERPRET,
    NUM_BLOCKS,
    SCALE,
    check,
    inputs,
    poison_unselected,
)


def varied(cache, seed):
  """The cache with each slot scaled by its own power of ten in [1e-3, 1e3] and
  every fifth slot by 3e5: partials from far below 1 to past float16's
  largest value (65,504)."""
  rng = np.random.default_rng(seed)
  factor = 10.0 ** rng.uniform(-3, 3, size=NUM_BLOCKS * BLOCK_SIZE)
  factor[::5] = 3e5
  rows = np.asarray(cache, np.float32).reshape(-1, 576) * factor[:, None]
  return jnp.asarray(rows.reshape(cache.shape), jnp.bfloat16)


# (heads, select, kernel arguments): the stream's 5 rows of 2 tiles in 3
# parts, a whole row each first; two rows cut in halves of one and two
# tiles; two rows of two splits.
LAYOUTS = {
    "stream": (16, True, dict(batch=5, topk=128, parts=3, stream_whole=1)),
    "pieces": (64, False, dict(batch=3, topk=192, cut_rows=2, pieces=2)),
    "splits": (96, True, dict(batch=2, topk=128, num_splits=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kernel_partials_are_its_float32_ones_scaled_and_rounded(layout):
  """Each float16 partial is, bit for bit, the float32 build's divided by its
  scale and rounded; the scales are the least powers of two at or above each
  head row's channel half's largest |o| (past float16's range here); the
  LSE is the float32 build's, and so is the whole rows' result. 16 and 96
  heads: the last head group's real rows alone (the staged store's short
  branch). The race detector watches the stream's stages, held until the
  copy has read them. "pieces": "multiply" on a poisoned cache, so that NaN
  partials go through the staged store too."""
  from jaxkv.kernels.sparse_mla_decode import kernel

  heads, select, kw = LAYOUTS[layout]
  kw = {"num_splits": 1, **kw}
  batch, hp = kw["batch"], -(-heads // 64) * 64
  q, cache, idx = inputs(71, batch, heads, kw["topk"], invalid=0.2)
  cache = varied(cache, 71)
  if not select:  # row 1 (cut row 0) without a -1: finite pieces; row 2's NaN
    idx = idx.at[1].set(inputs(72, 1, heads, kw["topk"], invalid=0.0)[2][0])
    cache = poison_unselected(cache, idx)
  rows = cache.reshape(-1, 576)

  def run(f16):
    call = kernel.build_kernel(
        heads_padded=hp, sm_scale=SCALE, select=select, q_heads=heads,
        interpret=INTERPRET if f16 and layout == "stream" else FAST,
        out_dtype=jnp.bfloat16, stage_out=True, f16_partials=f16, **kw)
    return [np.asarray(x) for x in call(q, rows, idx)]

  f32, f16 = run(False), run(True)
  if layout == "splits":
    (o32, lse32), (bits, lse16, scale) = f32, f16
    written = [(b, s) for b in range(batch) for s in range(2)]
  else:
    (out32, res_lse32, o32, lse32), (out16, res_lse16, bits, lse16, scale) = f32, f16
    written = [(r, p) for r in range(2) for p in range(2)]
    whole = [0]
    if layout == "stream":  # rows 0-2 whole, leftover row 3 in two pieces, row 4 whole
      stream = Stream(batch, 2, 3, 1)
      assert [stream.row_pieces(i) for i in range(2)] == [2, 1]
      written, whole = [(0, 0), (0, 1)], [0, 1, 2, 4]
    np.testing.assert_array_equal(out16[whole], out32[whole])
    np.testing.assert_array_equal(res_lse16[whole], res_lse32[whole])
  assert bits.dtype == jnp.bfloat16 and scale.shape == (*o32.shape[:2], 2, hp)
  o16 = bits.view(np.float16)
  for r, p in written:
    want, want_scale = scaled_half_spec(o32[r, p, :heads])
    np.testing.assert_array_equal(scale[r, p, :, :heads].T, want_scale)
    np.testing.assert_array_equal(o16[r, p, :heads], want)
    np.testing.assert_array_equal(lse16[r, p, :heads], lse32[r, p, :heads])
  got = o16[tuple(zip(*written))][:, :heads]
  assert np.isnan(got).any() != select
  assert (scale[tuple(zip(*written))][..., :heads] > 2.0**16).any()  # past float16's range


@pytest.mark.parametrize("select, first_row, swizzle",
                         [(True, None, True), (False, 1, True), (False, 1, False)])
def test_merge_of_float16_partials_is_its_merge_of_them_in_float32(select, first_row, swizzle):
  """The merge kernel on float16 pieces and their scales gives, bit for bit,
  what it gives on the same values as float32 (the scale a power of two:
  folded into the weight, it rounds as the product would), in a new result
  (5 pieces, two copies of them) and in place (two pieces), its 16-bit SMEM
  tiles swizzled or plain rows. Pieces of no weight hold NaN bits and NaN
  scales: "select" never uses them, and in "multiply" their NaN poisons the
  row as the float32 NaN does."""
  from jaxkv.kernels.sparse_mla_decode.piece_merge import build_piece_merge

  rng = np.random.default_rng(9)
  rows, pieces, hp = 3, 5 if first_row is None else 2, 64
  o = rng.standard_normal((rows, pieces, hp, 512)).astype(np.float32)
  o *= 10.0 ** rng.uniform(-3, 5, size=(rows, pieces, hp, 1))
  o16, scale = scaled_half_spec(o)
  o_back = unscaled_spec(o16, scale)
  lse = (rng.standard_normal((rows, pieces, hp)) * 3).astype(np.float32)
  dead = np.zeros((rows, pieces), bool)
  dead[0, 1] = dead[2, :] = True  # row 2: no live piece
  lse = np.where(dead[..., None], -np.inf, lse)
  bits = np.where(dead[..., None, None], np.float16(np.nan), o16).view(jnp.bfloat16)
  scale_in = np.where(dead[..., None, None], np.nan, np.moveaxis(scale, -1, 2))
  o_back = np.where(dead[..., None, None], np.nan, o_back)
  common = dict(rows=rows, pieces=pieces, heads_padded=hp, out_heads=hp, select=select,
                interpret=FAST, first_row=first_row, cols=64, per_copy=2, swizzle=swizzle)
  dtype = jnp.float32 if first_row is None else jnp.bfloat16
  dest = ()
  if first_row is not None:
    dest = (jnp.asarray(rng.standard_normal((rows + 2, hp, 512)), dtype),
            jnp.asarray(rng.standard_normal((rows + 2, hp)), jnp.float32))
  got = build_piece_merge(out_dtype=dtype, scaled=True, **common)(
      jnp.asarray(bits), jnp.asarray(lse), jnp.asarray(scale_in, jnp.float32), *dest)
  want = build_piece_merge(out_dtype=dtype, **common)(jnp.asarray(o_back), jnp.asarray(lse),
                                                      *dest)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  out = np.asarray(got[0], np.float32)
  at = 0 if first_row is None else first_row
  assert np.isnan(out[at]).all() != select  # row 0's dead piece
  assert (out[at + 2] == 0).all()  # no live piece: 0 (also where "multiply" met NaN)
  if first_row is not None:  # the other rows untouched
    np.testing.assert_array_equal(out[[0, rows + 1]], np.asarray(dest[0], np.float32)[[0, rows + 1]])


@pytest.mark.parametrize("layout", ["stream", "splits"])
def test_calls_with_float16_partials(layout):
  """Whole calls, the stream (6 rows of 3 tiles in 4 parts; row 1's first tile
  and the last row without a valid index) or 3 splits (rows 0, 1 and 5 of
  the same), values past float16's range: the reference's result, and the
  float32 partials' within float16's rounding of each partial, by the merge
  kernel (and, with splits, by XLA's combine, which unscales them). In the stream, NaN in
  slot 0 and in every slot no row indexes leaves "select" bit-equal to clean
  memory, and "multiply" gives NaN exactly where the reference does (the
  merge kernel's NaN handling of float16 pieces and of dead ones is
  `test_merge_of_float16_partials_is_its_merge_of_them_in_float32`'s)."""
  q, cache, idx = inputs(83, 6, 16, 192, invalid=0.2, dead_rows=(5,))
  idx = idx.at[1, :64].set(-1)
  cache = varied(cache, 83)
  if layout == "splits":  # (fewer rows: each row's splits are 3 decode and 64 merge CTAs)
    q, idx = q[np.array([0, 1, 5])], idx[np.array([0, 1, 5])]
  config = SparseMLADecodeConfig(**({"parts": 4} if layout == "stream" else {"num_splits": 3}))

  def run(c, mode, f16=True, combine="kernel"):
    return sparse_mla_decode(
        q, c, idx, sm_scale=SCALE, mask_mode=mode, interpret=FAST,
        config=dataclasses.replace(config, f16_partials=f16, combine=combine))

  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE)
  out32, lse32 = run(cache, "select", f16=False)
  b = np.asarray(out32, np.float32)
  # (XLA's combine of float16 partials: with splits; the stream's pieces go
  # through the same `layout.unscaled`.)
  for combine in ("kernel", "xla") if layout == "splits" else ("kernel",):
    out, lse = run(cache, "select", combine=combine)
    check(out[:-1], lse[:-1], ref_out[:-1], ref_lse[:-1])
    assert (np.asarray(out[-1], np.float32) == 0).all()
    a = np.asarray(out, np.float32)
    assert np.linalg.norm(a - b) <= 2e-3 * np.linalg.norm(b)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse32), rtol=1e-6, atol=1e-6)
    if combine == "kernel":
      kernel_out, kernel_lse = a, np.asarray(lse)
  if layout == "splits":
    return
  poisoned = poison_unselected(cache, idx)
  sel, sel_lse = run(poisoned, "select")
  np.testing.assert_array_equal(np.asarray(sel, np.float32), kernel_out)
  np.testing.assert_array_equal(np.asarray(sel_lse), kernel_lse)
  ref_nan, _ = sparse_mla_decode_reference(q, poisoned, idx, sm_scale=SCALE, mask_mode="multiply")
  want_nan = np.isnan(np.asarray(ref_nan, np.float32)).any(axis=(1, 2))
  assert want_nan[1] and not want_nan[-1]
  mul, _ = run(poisoned, "multiply")
  np.testing.assert_array_equal(np.isnan(np.asarray(mul, np.float32)).any(axis=(1, 2)), want_nan)


@pytest.mark.parametrize(
    "kw, heads",
    [(dict(batch=5, topk=128, parts=3), 64), (dict(batch=5, topk=128, parts=3), 16),
     (dict(batch=3, topk=192, cut_rows=2, pieces=2), 96), (dict(batch=2, topk=128, num_splits=2), 128)],
)
def test_float16_partials_lower_for_hopper(kw, heads):
  """The compiled kernel storing float16 partials (the stream, pieces, splits;
  whole head groups and a short last one) and the merge kernel reading them
  (in place and into a new result) lower for CUDA here."""
  from jaxkv.kernels.sparse_mla_decode import kernel
  from jaxkv.kernels.sparse_mla_decode.piece_merge import build_piece_merge

  kw = {"num_splits": 1, **kw}
  batch, hp = kw["batch"], -(-heads // 64) * 64
  call = kernel.build_kernel(heads_padded=hp, sm_scale=SCALE, select=False, interpret=None,
                             q_regs=128, stage_out=True, out_dtype=jnp.bfloat16, q_heads=heads,
                             f16_partials=True, **kw)
  args = (jax.ShapeDtypeStruct((batch, heads, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((NUM_BLOCKS * BLOCK_SIZE, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((batch, kw["topk"]), jnp.int32))
  text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "nvvm.cp.async.shared.global" in text
  outs = jax.eval_shape(call, *args)
  partials = outs[-3:]
  assert partials[0].dtype == jnp.bfloat16 and partials[2].shape[-2:] == (2, hp)
  rows, pieces = partials[0].shape[:2]
  first_row = None if kw["num_splits"] > 1 else 0
  merge = build_piece_merge(rows=rows, pieces=pieces, heads_padded=hp, out_heads=outs[0].shape[1],
                            out_dtype=jnp.bfloat16, select=False, interpret=None,
                            first_row=first_row, q_heads=heads, scaled=True)
  merge_args = (*partials, *(outs[:2] if first_row is not None else ()))
  text = jax.jit(merge).trace(*merge_args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
