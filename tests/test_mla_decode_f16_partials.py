"""Dense MLA decode's float16 partials: the decode kernel's scaled float16
partials (staged through a segment's last KV stage and stored by TMA, or for
the grouped merge stored from registers in its column slices) against its
float32 ones, the per-split ring's and the grouped merge of them against
their merge of the same values in float32, and the whole call on values past
float16's range."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels.mla_decode import MLADecodeConfig, mla_decode_plan

from mla_problem import (
    BS,
    FAST,
    RACES,
    SCALE,
    assert_close,
    jitted_body,
    poison,
    problem,
    run_reference,
    scaled_half_spec,
    segments,
    unscaled_spec,
)


def narrow(o, lse, scale=None):
  """The grouped merge's layout (`merge_tiling.wide_partials`; the scales
  `[batch, groups, 2, splits, 64]`) back in the per-split ring's."""
  batch, _, groups, splits, rows, _ = o.shape
  o = o.transpose(0, 3, 2, 4, 1, 5).reshape(batch, splits, groups * rows, -1)
  lse = lse.transpose(0, 2, 1, 3).reshape(batch, splits, groups * rows)
  if scale is None:
    return o, lse
  return o, lse, scale.transpose(0, 3, 2, 1, 4).reshape(batch, splits, 2, groups * rows)


def varied_cache(cache, table, seed):
  """The cache with each block scaled by its own power of ten in [1e-3, 1e3],
  and row 0's blocks by 3e5: partials from far below 1 to past float16's
  largest value (65,504)."""
  rng = np.random.default_rng(seed)
  factor = 10.0 ** rng.uniform(-3, 3, size=cache.shape[0])
  factor[table[0][table[0] > 0]] = 3e5
  return cache * factor[:, None, None]


@pytest.mark.parametrize("heads, select, cols", [(64, True, None), (40, False, None),
                                                 (40, True, 8)])
def test_kernel_partials_are_its_float32_ones_scaled_and_rounded(heads, select, cols):
  """Each segment's float16 partial is, bit for bit, its float32 partial divided
  by the scale and rounded; the scale is the least power of two at or above
  each half row's largest |o| (values up to ~1e5, past float16's range); the
  LSE is the float32 build's. 40 heads: the last head group's real rows alone
  (the staged store's short branch). The race detector watches the stage that
  is held until the copy has read it. `cols`: the grouped merge's layout,
  stored from registers in slices of 8 channels."""
  from jaxkv.kernels.mla_decode import kernel

  seq_lens = [5 * BS - 3, 2 * BS, BS + 1, 3 * BS + 7]
  q, cache, table, lens = problem(23, seq_lens, heads)
  cache = varied_cache(cache, table, 23)
  if not select:
    cache, _ = poison(cache, table, lens)
  hp = 64
  q = jnp.asarray(q)
  config = MLADecodeConfig(num_splits=3, min_chunk_blocks=1, split_overhead_tiles=0)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=heads, config=config, num_sms=4)

  def run(f16):
    call = kernel.build_kernel(
        batch=len(lens), heads_padded=hp, num_parts=plan.num_parts, num_splits=plan.num_splits,
        block_size=BS, sm_scale=SCALE, select=select, interpret=RACES if f16 else FAST,
        q_heads=heads, f16_partials=f16, partial_cols=cols)
    outs = call(q, jnp.asarray(cache, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens),
                plan.row_start, plan.part_rows, plan.part_start, plan.row_part)
    outs = tuple(map(np.asarray, outs))
    return outs if cols is None else narrow(*outs)

  o32, lse32 = run(False)
  bits, lse16, scale = run(True)
  assert bits.dtype == jnp.bfloat16 and scale.shape == (len(lens), plan.num_splits, 2, hp)
  o16 = bits.view(np.float16)
  written = [(row, split) for segs in segments(plan, lens) for row, _, _, split in segs]
  assert len(written) > len(lens)  # rows cut into several splits
  for row, split in written:
    want, want_scale = scaled_half_spec(o32[row, split, :heads])
    np.testing.assert_array_equal(scale[row, split, :, :heads].T, want_scale)
    np.testing.assert_array_equal(o16[row, split, :heads], want)
    np.testing.assert_array_equal(lse16[row, split, :heads], lse32[row, split, :heads])
  rows, splits = zip(*written)
  if select:
    assert np.isfinite(o16[rows, splits, :heads]).all()
  assert (scale[rows, splits, :, :heads] > 2.0**16).any()  # o past float16's range


@pytest.mark.parametrize("chunk, group", [(None, False), (3, False), (None, True)])
def test_merge_of_float16_partials_is_its_merge_of_them_in_float32(chunk, group):
  """The per-split ring (one pass; with `chunk` the first of two passes) and
  the grouped merge (`group`: 9 splits, two copies of 8, the last
  overlapping the first) on float16 partials and their scales give, bit for
  bit, what they give on the same values as float32 (the scale a power of
  two: folded into the weight, it rounds as the product would). The ring
  reads no dead split; the grouped merge reads them with the live ones and
  selects them away (NaN bits and scales there either way)."""
  from jaxkv.kernels.mla_decode.merge import build_merge
  from jaxkv.kernels.mla_decode.merge_tiling import wide_partials

  rng = np.random.default_rng(5)
  batch, splits, heads = 4, 9 if group else 7, 64
  o = rng.standard_normal((batch, splits, heads, 512)).astype(np.float32)
  o *= 10.0 ** rng.uniform(-3, 5, size=(batch, splits, heads, 1))
  o16, scale = scaled_half_spec(o)
  o_back = unscaled_spec(o16, scale)
  lse = (rng.standard_normal((batch, splits, heads)) * 3).astype(np.float32)
  live = np.array([splits, 1, 0, 4])
  dead = np.arange(splits)[None, :] >= live[:, None]
  bits = np.where(dead[..., None, None], np.float16(np.nan), o16).view(jnp.bfloat16)
  scale_in = np.where(dead[..., None, None], np.nan, np.moveaxis(scale, -1, 2))
  o_back = np.where(dead[..., None, None], np.nan, o_back)
  lse_in = np.where(dead[..., None], np.nan, lse)
  bounds = np.minimum(np.arange(splits + 1)[None, :], live[:, None]).astype(np.int32)
  seq_lens = jnp.asarray(live * BS - 5, jnp.int32)
  common = dict(batch=batch, num_splits=splits, heads_padded=heads, dv=512, max_tokens=30 * BS,
                out_dtype=jnp.float32 if chunk else jnp.bfloat16, interpret=FAST, chunk=chunk)
  if group:
    # 64 channels per CTA (tuned: 8), two groups in flight: a grid the
    # interpreter runs in an eighth of the time, the same copies of 8 splits.
    common.update(group=True, cols=64, stages=2)
    bits, lse_wide = wide_partials(bits, lse_in, 64)
    o_back, _ = wide_partials(o_back, lse_in, 64)
    lse_in = lse_wide
    scale_in = scale_in.reshape(batch, splits, 2, 1, heads).transpose(0, 3, 2, 1, 4)
  got = build_merge(f16_partials=True, **common)(
      seq_lens, jnp.asarray(bounds), jnp.asarray(bits), jnp.asarray(lse_in),
      jnp.asarray(scale_in, jnp.float32))
  want = build_merge(**common)(seq_lens, jnp.asarray(bounds), jnp.asarray(o_back),
                               jnp.asarray(lse_in))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  assert np.isfinite(np.asarray(got[0], np.float32)).all()


@pytest.mark.parametrize("seq_lens, splits, sms, poisoned, grouped", [
    ([4 * BS + 9, 0, 2 * BS - 3, 3 * BS, BS + 1], 3, 4, True, False),  # the ring in one pass
    ([33 * BS - 5, 0], 33, 34, False, False),  # more than 32 splits: two passes
    ([10 * BS - 5, 0, 3 * BS + 7], 10, 12, True, True),  # the grouped merge
])
def test_float16_partials_end_to_end_past_float16_range(seq_lens, splits, sms, poisoned,
                                                         grouped):
  """The whole call (kernel, then the ring merge in one pass or two, or the
  grouped merge as loops) with float16 partials (the default with both), on
  values up to ~1e5: finite and within
  bf16 tolerance of the reference in "select"; in "multiply" on a poisoned
  cache (the two passes' first reads the same partials through the same
  ring step as one pass), NaN in the same elements as with float32
  partials."""
  from jaxkv.kernels.mla_decode import merge_tiling
  from jaxkv.kernels.mla_decode.wrapper import _mla_decode

  q, cache, table, lens = problem(31, seq_lens, 64)
  cache = varied_cache(cache, table, 31)
  config = MLADecodeConfig(num_splits=splits, min_chunk_blocks=1, split_overhead_tiles=0)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=64, config=config, num_sms=sms)
  assert (plan.num_splits > merge_tiling.MAX_SPLITS) == (splits > 32)
  assert merge_tiling.can_group(plan.num_splits) or not grouped
  # The grouped merge at 64 channels per CTA (tuned: 8): the interpreter's time.
  merge = dict(grouped=True, group_cols=64) if grouped else dict(grouped=False)
  f16 = None  # float16 partials: the default with either merge

  def run(c, select, f16):
    return _mla_decode(q, jnp.asarray(c, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens),
                       plan, sm_scale=SCALE, select=select, interpret=FAST, kv_swizzle=64,
                       q_regs=0, f16_partials=f16, **merge)

  got = run(cache, True, f16)
  assert np.abs(np.asarray(got[0], np.float32)).max() > 65504
  assert_close(got, run_reference(q, cache, table, lens))
  if not poisoned:
    return
  bad, _ = poison(cache, table, lens)
  nan16, nan32 = (np.isnan(np.asarray(run(bad, False, f)[0], np.float32))
                  for f in (f16, False))
  assert nan32.any()
  np.testing.assert_array_equal(nan16, nan32)


@pytest.mark.parametrize("heads, splits, kw, want", [
    (64, 3, {}, True),  # the per-split ring in one pass
    (64, 40, dict(grouped=False), True),  # two passes
    (64, 10, dict(grouped=True), True),  # the grouped merge
    (64, 40, dict(grouped=True, group_halves=True), True),  # in halves
    (16, 3, {}, False),  # rows of 8-32 heads: the stacked merge
    (16, 10, dict(grouped=True), False),  # rows of 8-32 heads, the grouped merge
    (64, 3, dict(f16_partials=False), False),
    (16, 10, dict(grouped=True, f16_partials=True), True),
])
def test_which_partials_the_default_stores(heads, splits, kw, want):
  """Float16 partials by default wherever they were timed faster (the ring,
  the grouped merge, whole or in halves), float32 for rows of 8-32 heads
  (which the stacked merge reads in float32); `f16_partials` forces
  either. Read off the traced call: the width of the decode kernel's partials
  (its first output; the kernels are the traced call's `custom_vmap_call`s)."""
  kernels = traced_kernels(heads, splits, kw)
  assert len(kernels) >= 2  # the decode kernel, then the merge or merges
  partials = kernels[0].outvars[0].aval
  assert partials.shape[0] == 2 and partials.ndim >= 4  # [batch, splits or channels, ...]
  assert partials.dtype.itemsize == (2 if want else 4)


def traced_kernels(heads, splits, kw):
  """The Pallas kernels (`custom_vmap_call`s) of a traced call on a row cut
  into `splits` splits (and an empty row), in order."""
  from jaxkv.kernels.mla_decode.wrapper import _mla_decode

  lens = [(splits + 2) * BS, 0]
  config = MLADecodeConfig(num_splits=splits, min_chunk_blocks=1, split_overhead_tiles=0)
  plan = mla_decode_plan(jnp.asarray(lens, jnp.int32), num_heads=heads, config=config,
                         num_sms=splits + 1)
  assert plan.num_splits == splits
  q = jax.ShapeDtypeStruct((2, heads, 576), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((2 * splits + 8, BS, 576), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((2, splits + 4), jnp.int32)
  body = jitted_body(lambda q, c, t, n: _mla_decode(
      q, c, t, n, plan, sm_scale=SCALE, select=True, interpret=None, kv_swizzle=64,
      q_regs=0, **kw), q, cache, table, jax.ShapeDtypeStruct((2,), jnp.int32))
  return [e for e in body if e.primitive.name == "custom_vmap_call"]


@pytest.mark.parametrize("heads", [64, 40])
def test_rows_past_one_grouped_cta_merge_in_halves_by_default(heads):
  """Past `GROUP_MAX_SPLITS` splits (1 x 64 at 133 on 132 SMs) the default
  merges in halves as loops with float16 partials: one merge kernel, where
  the per-split ring (`grouped=False`, the default before) takes two passes."""
  from jaxkv.kernels.mla_decode import merge_tiling

  splits = merge_tiling.GROUP_MAX_SPLITS + 5
  default = traced_kernels(heads, splits, {})
  assert len(default) == 2 and default[0].outvars[0].aval.dtype.itemsize == 2
  halves = traced_kernels(heads, splits, dict(grouped=True, group_halves=True))
  assert [k.outvars[0].aval for k in default] == [k.outvars[0].aval for k in halves]
  assert len(traced_kernels(heads, splits, dict(grouped=False))) == 3
  # At the one-CTA bound the grouped merge takes rows whole (never halves).
  at_bound = traced_kernels(heads, merge_tiling.GROUP_MAX_SPLITS, {})
  whole = traced_kernels(heads, merge_tiling.GROUP_MAX_SPLITS, dict(group_halves=False))
  assert [k.outvars[0].aval for k in at_bound] == [k.outvars[0].aval for k in whole]


def test_float16_partials_lower_for_hopper():
  """The compiled decode kernel with float16 partials (the stage's staged
  store, from both ring layouts) and the ring merges that read them, one pass
  and the first of two, lower for CUDA."""
  from jaxkv.kernels.mla_decode import kernel, merge

  batch, hp, parts, splits, max_blocks = 2, 128, 4, 3, 8
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  for kv_swizzle, q_heads in ((128, 72), (64, 128)):
    args = (jax.ShapeDtypeStruct((batch, q_heads, 576), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 64, 576), jnp.bfloat16),
            i32(batch, max_blocks), i32(batch), i32(batch + 1), i32(parts, 2), i32(parts + 1),
            i32(batch))
    decode = kernel.build_kernel(
        batch=batch, heads_padded=hp, num_parts=parts, num_splits=splits, block_size=64,
        sm_scale=SCALE, select=True, interpret=None, kv_swizzle=kv_swizzle, q_heads=q_heads,
        f16_partials=True)
    text = jax.jit(decode).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "wgmma.mma_async" in text
  o, lse, scale = jax.eval_shape(decode, *args)
  assert o.dtype == jnp.bfloat16 and scale.shape == (batch, splits, 2, hp)
  for chunk in (None, 2):
    combine = merge.build_merge(
        batch=batch, num_splits=splits, heads_padded=hp, dv=512, max_tokens=max_blocks * 64,
        out_dtype=jnp.float32 if chunk else jnp.bfloat16, interpret=None, chunk=chunk,
        f16_partials=True)
    text = jax.jit(combine).trace(i32(batch), i32(batch, splits + 1), o, f32(*lse.shape),
                                  f32(*scale.shape)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
