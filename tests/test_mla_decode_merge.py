"""Dense MLA decode's merges of split partials (the XLA combine, the per-split
ring, the grouped and two-pass merges, the stacked merge of few heads) against
`combine_splits`, and their CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels.mla_decode import (
    MLADecodeConfig,
    combine_splits,
    mla_decode_plan,
)

from mla_problem import BS, FAST, RACES, SCALE, assert_close, poison, problem, run_reference


def assert_nan_head(out, lse, want, want_lse, *, row, head):
  """NaN exactly at (`row`, `head`) in the merge's result, LSE and the spec's."""
  mask = np.zeros(lse.shape, bool)
  mask[row, head] = True
  for o_, l_ in ((out, lse), (want, want_lse)):
    np.testing.assert_array_equal(np.isnan(l_), mask)
    np.testing.assert_array_equal(np.isnan(o_).all(axis=-1), mask)
    np.testing.assert_array_equal(np.isnan(o_).any(axis=-1), mask)


def test_combine_merges_and_handles_empty_splits():
  rng = np.random.default_rng(4)
  o = jnp.asarray(rng.standard_normal((2, 3, 4, 8)), jnp.float32)
  lse = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
  lse = lse.at[0, 1].set(-jnp.inf).at[1].set(-jnp.inf)
  o = o.at[0, 1].set(jnp.nan)  # an empty split's output is never used
  out, lse_out = combine_splits(o, lse)
  w = np.exp(np.asarray(lse[0]) - np.asarray(lse_out[0])[None])
  want = np.einsum("sh,shd->hd", np.where(np.isfinite(w), w, 0), np.nan_to_num(np.asarray(o[0])))
  np.testing.assert_allclose(np.asarray(out[0]), want, rtol=1e-5, atol=1e-6)
  assert (np.asarray(out[1]) == 0).all() and (np.asarray(lse_out[1]) == -np.inf).all()
  # One split: an empty row's unwritten output is not passed through either.
  out1, lse1 = combine_splits(o[:, 1:2], lse[:, 1:2])
  assert (np.asarray(out1) == 0).all() and (np.asarray(lse1) == -np.inf).all()


@pytest.mark.parametrize("f16", [False, True])
def test_grouped_merge_lowers_with_bulk_copies(f16):
  """The grouped merge's partials (`merge_tiling.wide_partials`' layout, which the
  decode kernel stores with `partial_cols`) come in by bulk copies, the
  row's LSE in one and whole groups of splits in each other, not by TMA
  boxes of narrow rows. Lowered for CUDA on the CPU, both kernels at 1 x 128 x 128K's
  shape (67 splits, 8 channels per merge CTA); with `f16` the partials in
  float16 (stored from registers) and their scales (one more bulk copy)."""
  from jaxkv.kernels.mla_decode import kernel, merge, merge_tiling

  batch, hp, splits, parts = 1, 128, 67, 66
  cols, _ = merge_tiling.grouped_tiling(batch=batch, head_groups=2, num_splits=splits, f16=f16)
  assert cols == 8
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  decode = kernel.build_kernel(
      batch=batch, heads_padded=hp, num_parts=parts, num_splits=splits, block_size=64,
      sm_scale=SCALE, select=True, interpret=None, partial_cols=cols, f16_partials=f16,
  )
  args = (jax.ShapeDtypeStruct((batch, hp, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((16, 64, 576), jnp.bfloat16),
          i32(batch, 8), i32(batch), i32(batch + 1), i32(parts, 2), i32(parts + 1), i32(batch))
  o, lse, *scale = jax.eval_shape(decode, *args)
  assert o.shape == (batch, 512 // cols, 2, splits, 64, cols) and lse.shape == (batch, 2, splits, 64)
  assert o.dtype == (jnp.bfloat16 if f16 else jnp.float32)
  assert [s.shape for s in scale] == ([(batch, 2, 2, splits, 64)] if f16 else [])
  assert "wgmma.mma_async" in jax.jit(decode).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  combine = merge.build_merge(batch=batch, num_splits=splits, heads_padded=hp, dv=512,
                              max_tokens=4096, out_dtype=jnp.bfloat16, interpret=None, group=True,
                              f16_partials=f16)
  text = jax.jit(combine).trace(i32(batch), i32(batch, splits + 1), o, lse, *scale).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "cp.async.bulk.shared::cta.global" in text  # the LSE and the groups of splits
  assert "cp.async.bulk.tensor" not in text


def test_grouped_merge_in_halves_lowers_for_hopper():
  """The grouped merge in halves at 1 x 64 x 128K's shape (133 splits, past one
  CTA's `GROUP_MAX_SPLITS`): 64 clusters of two CTAs at 8 channels, each
  with its 9 groups in flight, lowered for CUDA with the cluster's barrier
  and bulk copies."""
  from jaxkv.kernels.mla_decode import merge, merge_tiling

  batch, hp, splits = 1, 64, 133
  assert merge_tiling.can_group(splits, True) and not merge_tiling.can_group(splits)
  cols, stages = merge_tiling.grouped_tiling(batch=batch, head_groups=1, num_splits=splits,
                                             halves=True)
  assert (cols, stages) == (8, 9)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  o = jax.ShapeDtypeStruct((batch, 512 // cols, 1, splits, 64, cols), jnp.float32)
  lse = jax.ShapeDtypeStruct((batch, 1, splits, 64), jnp.float32)
  sizes = {}
  for lean in (True, False):  # False: the loops as first timed
    combine = merge.build_merge(batch=batch, num_splits=splits, heads_padded=hp, dv=512,
                                max_tokens=2112 * 64, out_dtype=jnp.bfloat16, interpret=None,
                                group=True, halves=True, stage_out=True, lean=lean)
    text = jax.jit(combine).trace(i32(batch), i32(batch, splits + 1), o, lse).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "barrier.cluster.arrive.release" in text
    assert "cp.async.bulk.shared::cta.global" in text  # the LSE and the groups of splits
    sizes[lean] = len(text)
  # Loops: the code does not grow with the splits as straight-line code over
  # every split slot did (2.3 MB of text here).
  assert max(sizes.values()) < 400_000, sizes


@pytest.mark.parametrize(
    "splits, group, stages, lean",
    [(3, False, None, True), (9, False, None, "both"), (9, True, 2, True),
     (20, True, 1, "both")],
)
def test_merge_kernel_matches_combine_and_reads_only_live_splits(splits, group, stages, lean):
  """The merge reads a row's live splits only (more of them than its ring
  holds with 9), and leaves the rows the decode kernel finished itself (one
  split over the whole row) exactly as they were. With `group` the splits
  come 8 per copy (the last copy overlapping the one before it at 9 and 20)
  and, with one group in flight, the ring refills behind the reads. "both":
  bit for bit the result of the merge as first timed (`lean=False`: the
  live count before the first copies; grouped, the maximum split by split;
  row 2, without a live split, waits for the ring's first copy)."""
  from jaxkv.kernels.mla_decode.merge import build_merge
  from jaxkv.kernels.mla_decode.merge_tiling import merge_tiling, wide_partials

  rng = np.random.default_rng(12)
  batch, heads = 5, 128
  o = jnp.asarray(rng.standard_normal((batch, splits, heads, 512)), jnp.float32)
  lse = jnp.asarray(rng.standard_normal((batch, splits, heads)) * 3, jnp.float32)
  # Grouped, row 3's last live split sits in a copy with dead ones, and
  # (9 splits) its last group is not fetched at all.
  live = jnp.asarray([splits, 1, 0, splits - 3 if group else 2, 1], jnp.int32)
  assert group or (splits > merge_tiling(splits)[1]) == (splits == 9)
  dead = np.arange(splits)[None, :] >= np.asarray(live)[:, None]
  # Row 0's second split met NaN in a valid slot at head 7: a NaN LSE is
  # live, and makes that head NaN (as `combine_splits` says).
  o, lse = o.at[0, 1, 7].set(jnp.nan), lse.at[0, 1, 7].set(jnp.nan)
  # Dead slots are never written by the decode kernel: NaN must not leak.
  o_bad = jnp.where(jnp.asarray(dead)[..., None, None], jnp.nan, o)
  lse_bad = jnp.where(jnp.asarray(dead)[..., None], jnp.nan, lse)
  # Bounds whose first `live` splits hold a block each, clipped by the lengths.
  bounds = jnp.minimum(jnp.arange(splits + 1)[None, :] + jnp.asarray([0, 0, 0, 0, 2])[:, None],
                       (live + jnp.asarray([0, 0, 0, 0, 2]))[:, None]).astype(jnp.int32)
  seq_lens = (live + jnp.asarray([0, 0, 0, 0, 2])) * BS - 5
  # Row 1's one split covers it whole: the decode kernel wrote it (random
  # bytes here, which must come back untouched). Row 4's one live split does
  # not start at its first tile: merged. The rest: NaN until merged.
  finished = np.array([False, True, False, False, False])
  kept = rng.standard_normal((batch, heads, 512)).astype(np.float32)
  kept_lse = rng.standard_normal((batch, heads)).astype(np.float32)
  out0 = jnp.asarray(np.where(finished[:, None, None], kept, np.nan), jnp.bfloat16)
  lse0 = jnp.asarray(np.where(finished[:, None], kept_lse, np.nan))
  # Grouped: 64 (one group in flight) or 32 channels per CTA, not the
  # tuned 8: a grid the interpreter runs in a quarter of the time, the same
  # copies of 8 splits.
  tiling = dict(cols=64 if stages == 1 else 32, stages=stages) if stages else {}
  if group:  # the grouped merge reads the partials in its own layout
    cols = tiling["cols"]
    o_bad, lse_bad = wide_partials(o_bad, lse_bad, cols)
  merge = lambda lean: build_merge(
      batch=batch, num_splits=splits, heads_padded=heads, dv=512, max_tokens=30 * BS,
      out_dtype=jnp.bfloat16, interpret=RACES, finish_rows=True, group=group, lean=lean,
      **tiling)(seq_lens.astype(jnp.int32), bounds, o_bad, lse_bad, out0, lse0)
  out, lse_out = merge(True)
  if lean == "both":
    for a, b in zip(merge(False), (out, lse_out)):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  want, want_lse = combine_splits(o, jnp.where(jnp.asarray(dead)[..., None], -jnp.inf, lse))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out[1]).view(np.uint16), np.asarray(out0[1]).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(lse_out[1]), kept_lse[1])
  rest = ~finished
  out32, want, want_lse = (np.asarray(x, np.float32)[rest] for x in (out, want, want_lse))
  assert_nan_head(out32, np.asarray(lse_out)[rest], want, want_lse, row=0, head=7)
  err = np.linalg.norm(np.nan_to_num(out32 - want)) / np.linalg.norm(np.nan_to_num(want))
  assert err < 5e-3, err
  np.testing.assert_allclose(np.asarray(lse_out)[rest], want_lse, rtol=1e-5, atol=1e-5)
  assert (np.asarray(out[2], np.float32) == 0).all() and (np.asarray(lse_out[2]) == -np.inf).all()



@pytest.mark.parametrize("stages", [1, 2])
def test_grouped_merge_in_halves_matches_combine(stages):
  """The grouped merge in halves (`build_merge(halves=True)`): a cluster of two
  CTAs per tile, the first over groups 0-1 of 20 splits, the second over
  group 2, its sums handed on through GMEM. Rows whose live splits end in
  either CTA's share, one whose second CTA has no live split, an empty row;
  NaN in every dead slot (never read), and a NaN LSE in the second CTA's
  share (head 7 of row 0, NaN there alone). With one group in flight the
  first CTA's ring refills behind its reads. Bit for bit the result of the
  loops as first timed (`lean=False`: the live count before the first
  copies, the maximum split by split)."""
  from jaxkv.kernels.mla_decode import merge_tiling
  from jaxkv.kernels.mla_decode.merge import build_merge

  rng = np.random.default_rng(14)
  batch, splits, heads = 5, 20, 64
  o = jnp.asarray(rng.standard_normal((batch, splits, heads, 512)), jnp.float32)
  lse = jnp.asarray(rng.standard_normal((batch, splits, heads)) * 3, jnp.float32)
  live = np.array([20, 9, 0, 17, 3])  # split 16 starts group 2, the second CTA's
  assert merge_tiling.can_group(splits, True) and -(-splits // merge_tiling.GROUP) == 3
  dead = np.arange(splits)[None, :] >= live[:, None]
  o, lse = o.at[0, 18, 7].set(jnp.nan), lse.at[0, 18, 7].set(jnp.nan)
  o_bad = jnp.where(jnp.asarray(dead)[..., None, None], jnp.nan, o)
  lse_bad = jnp.where(jnp.asarray(dead)[..., None], jnp.nan, lse)
  bounds = jnp.asarray(np.minimum(np.arange(splits + 1)[None, :], live[:, None]), jnp.int32)
  seq_lens = jnp.asarray(live * BS - 3, jnp.int32)
  # 64 channels per CTA, not the tuned 8: a grid the interpreter runs in an
  # eighth of the time, the same copies of 8 splits.
  def merge(lean):
    call = build_merge(batch=batch, num_splits=splits, heads_padded=heads, dv=512,
                       max_tokens=splits * BS, out_dtype=jnp.bfloat16, interpret=RACES,
                       group=True, halves=True, cols=64, stages=stages, stage_out=True,
                       lean=lean)
    return call(seq_lens, bounds, *merge_tiling.wide_partials(o_bad, lse_bad, 64))

  out, lse_out = merge(True)
  for a, b in zip(merge(False), (out, lse_out)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  want, want_lse = combine_splits(o, jnp.where(jnp.asarray(dead)[..., None], -jnp.inf, lse))
  out32, want = np.asarray(out, np.float32), np.asarray(want)
  assert out.shape == (batch, heads, 512) and out.dtype == jnp.bfloat16
  assert_nan_head(out32, np.asarray(lse_out), want, np.asarray(want_lse), row=0, head=7)
  err = np.linalg.norm(np.nan_to_num(out32 - want)) / np.linalg.norm(np.nan_to_num(want))
  assert err < 5e-3, err
  np.testing.assert_allclose(np.asarray(lse_out), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
  assert (out32[2] == 0).all() and (np.asarray(lse_out[2]) == -np.inf).all()


@pytest.mark.parametrize("f16", [False, True])
def test_grouped_merge_in_halves_end_to_end(f16):
  """One row of 40 heads over 19 live splits of 20, the grouped merge in halves
  (`_mla_decode(group_halves=True)`), whose first CTA stores the last head
  group's real rows alone. Against the reference, and against the
  grouped merge of one CTA per tile, in "select" (the same result on a
  poisoned cache as on a clean one) and "multiply" (the same NaNs); `f16`
  with the decode kernel's float16 partials and their scales."""
  from jaxkv.kernels.mla_decode import merge_tiling
  from jaxkv.kernels.mla_decode.wrapper import _mla_decode

  q, cache, table, lens = problem(43, [38 * BS - 5], 40)
  config = MLADecodeConfig(num_splits=20, min_chunk_blocks=1, split_overhead_tiles=0)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=40, config=config, num_sms=19)
  assert plan.num_splits == 20 and merge_tiling.can_group(20, True)
  # 19 live splits: 16-18 in group 2, the second CTA's.
  assert (np.diff(np.asarray(plan.bounds)) > 0).sum() == 19
  bad, _ = poison(cache, table, lens)

  def run(c, select, halves):
    # 64 channels per merge CTA (tuned: 8): the interpreter's time.
    return _mla_decode(q, jnp.asarray(c, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens),
                       plan, sm_scale=SCALE, select=select, interpret=FAST, kv_swizzle=64,
                       q_regs=0, group_cols=64, f16_partials=f16 or None, grouped=True,
                       group_halves=halves)

  got = run(cache, True, True)
  assert got[0].shape == (1, 40, 512)
  assert_close(got, run_reference(q, cache, table, lens))
  one_cta = run(cache, True, False)
  np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(one_cta[0], np.float32),
                             rtol=2**-7, atol=1e-3)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(one_cta[1]), rtol=1e-6, atol=1e-6)
  for a, b in zip(run(bad, True, True), got):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  nan_halves, nan_one = (np.isnan(np.asarray(run(bad, False, h)[0], np.float32))
                         for h in (True, False))
  assert nan_halves.any()
  np.testing.assert_array_equal(nan_halves, nan_one)

def test_merge_in_two_passes_matches_combine():
  """Chunks of a row's live splits first (split 0 alone, then 3 at a time),
  then the chunks' results: the same merge as one pass, NaN in the dead splits
  never read; a row whose live splits start past its first tile included."""
  from jaxkv.kernels.mla_decode.merge import build_merge
  from jaxkv.kernels.mla_decode.merge_tiling import chunk_edge, chunk_edges

  rng = np.random.default_rng(13)
  batch, splits, heads, chunk = 3, 8, 64, 3
  o = jnp.asarray(rng.standard_normal((batch, splits, heads, 512)), jnp.float32)
  lse = jnp.asarray(rng.standard_normal((batch, splits, heads)) * 3, jnp.float32)
  live = np.array([8, 5, 0])
  start = np.array([0, 2, 0])
  dead = np.arange(splits)[None, :] >= live[:, None]
  # Row 1's split 3 (the second chunk's) met NaN in a valid slot at head 9.
  o, lse = o.at[1, 3, 9].set(jnp.nan), lse.at[1, 3, 9].set(jnp.nan)
  o_bad = jnp.where(jnp.asarray(dead)[..., None, None], jnp.nan, o)
  lse_bad = jnp.where(jnp.asarray(dead)[..., None], jnp.nan, lse)
  bounds = jnp.asarray(np.minimum(np.arange(splits + 1)[None, :] + start[:, None],
                                  (live + start)[:, None]), jnp.int32)
  seq_lens = jnp.asarray((live + start) * BS - 7, jnp.int32)
  common = dict(batch=batch, heads_padded=heads, dv=512, max_tokens=12 * BS, interpret=RACES)
  first = build_merge(num_splits=splits, out_dtype=jnp.float32, chunk=chunk, **common)
  o1, lse1 = first(seq_lens, bounds, o_bad, lse_bad)
  edges = chunk_edges(splits, chunk)
  np.testing.assert_array_equal(edges, [0, 1, 4, 7, 8])
  for s_, c_ in ((8, 3), (67, 8), (52, 8), (33, 8), (9, 8)):  # the kernels' traced twin
    want_edges = chunk_edges(s_, c_)
    np.testing.assert_array_equal(chunk_edge(jnp.arange(len(want_edges)), c_, s_), want_edges)
  assert o1.shape == (batch, 4, heads, 512)
  second = build_merge(num_splits=4, out_dtype=jnp.bfloat16, **common)
  out, lse_out = second(seq_lens, bounds[:, edges], o1, lse1)
  # The same pass reading the chunks' bounds from the plan's own columns.
  second_own = build_merge(num_splits=4, out_dtype=jnp.bfloat16, edge_chunk=chunk, **common)
  out_own, lse_own = second_own(seq_lens, bounds, o1, lse1)
  np.testing.assert_array_equal(np.asarray(out_own, np.float32), np.asarray(out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse_own), np.asarray(lse_out))
  want, want_lse = combine_splits(o, jnp.where(jnp.asarray(dead)[..., None], -jnp.inf, lse))
  out32, want = np.asarray(out, np.float32), np.asarray(want)
  assert_nan_head(out32, np.asarray(lse_out), want, np.asarray(want_lse), row=1, head=9)
  assert np.linalg.norm(np.nan_to_num(out32 - want)) / np.linalg.norm(np.nan_to_num(want)) < 5e-3
  np.testing.assert_allclose(np.asarray(lse_out), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
  assert (out32[2] == 0).all() and (np.asarray(lse_out[2]) == -np.inf).all()


@pytest.mark.parametrize(
    "splits,grouped,sms,cols", [(3, False, 4, None), (20, True, 8, 32)]
)
def test_merge_output_staged_in_smem_matches_direct_stores(splits, grouped, sms, cols):
  """`_mla_decode(stage_merge_out=True)` (the default; False is the benchmark's
  ":mdirect"): each merge CTA's bf16 output goes out through SMEM by TMA, not
  from registers. Bit for bit the direct stores' result through the per-split ring (beside rows the kernel
  finished itself) and the grouped pass, clean in "select" (and the
  reference's) and poisoned in "multiply" (NaN rows); and it lowers for CUDA.
  (The grouped pass at 32 channels per CTA, to keep the interpreter's time
  down: the default 8-channel tiling's staged stores, and the two passes'
  staged second pass, which stores through the same `store_whole` /
  `store_tail` as the ring, are checked against the reference in
  `test_matches_reference`.)"""
  from jaxkv.kernels.mla_decode import merge
  from jaxkv.kernels.mla_decode.wrapper import _mla_decode

  seq_lens = [4 * BS + 9, 0, 2 * BS - 3]
  if splits == 3:  # more rows than parts: the kernel finishes some itself
    seq_lens = [BS + 1, 3 * BS, 0, 2 * BS - 3, 5, 4 * BS + 9]
  q, cache, table, lens = problem(37, seq_lens, 64)
  config = MLADecodeConfig(num_splits=splits, min_chunk_blocks=1, split_overhead_tiles=0)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=64, config=config, num_sms=sms)
  assert (np.diff(np.asarray(plan.bounds), axis=1) > 0).sum(axis=1).max() >= 2  # a row is cut
  poisoned, _ = poison(cache, table, lens)
  def run(c, select, staged):
    return _mla_decode(
        q, jnp.asarray(c, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens), plan,
        sm_scale=SCALE, select=select, interpret=FAST, kv_swizzle=64, q_regs=0,
        grouped=grouped, group_cols=cols, stage_merge_out=staged)

  for c, select in ((cache, True), (poisoned, False)):
    (out, lse), (want, want_lse) = run(c, select, True), run(c, select, False)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    if select:  # and both are right
      assert_close((out, lse), run_reference(q, cache, table, lens))
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  staged = merge.build_merge(
      batch=2, num_splits=3, heads_padded=128, dv=512, max_tokens=512,
      out_dtype=jnp.bfloat16, interpret=None, stage_out=True,
  )
  args = (i32(2), i32(2, 4), f32(2, 3, 128, 512), f32(2, 3, 128))
  text = jax.jit(staged).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize(
    "heads,seq_lens,sms",
    [
        # 8 heads: eight rows a CTA, the batch not a multiple of it (the last
        # CTA's other stacked rows past the batch), an empty row.
        (8, [4 * BS + 9, 0, 2 * BS - 3, 3 * BS, BS + 1, 5 * BS, 7, 2 * BS, 3 * BS + 1, 6 * BS, BS], 12),
        # 24 heads: two rows a CTA in the tile's first 48 rows; more rows than
        # parts, so the kernel finishes rows itself and the merge skips them.
        (24, [BS + 1, 3 * BS, 0, 2 * BS - 3, 5, 4 * BS + 9, 2 * BS + 2], 4),
    ],
)
def test_packed_merge_matches_one_row_per_cta(heads, seq_lens, sms):
  """`packed_merge.build_packed_merge` (rows of 8-32 heads stacked in one CTA's
  tile): the per-row ring's result, clean in "select" (and right) and
  poisoned in "multiply" (the same NaN rows), with empty rows, rows the
  kernel finished, and stacked rows past the batch. The same arithmetic,
  but not bit for bit here: the interpreter's XLA fuses the packed step's
  multiply-adds differently (an f32 rounding, up to one bf16 ulp of out)."""
  from jaxkv.kernels.mla_decode.packed_merge import pack_rows
  from jaxkv.kernels.mla_decode.wrapper import _mla_decode

  q, cache, table, lens = problem(41, seq_lens, heads)
  config = MLADecodeConfig(num_splits=3, min_chunk_blocks=1, split_overhead_tiles=0)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=heads, config=config, num_sms=sms)
  assert (np.diff(np.asarray(plan.bounds), axis=1) > 0).sum(axis=1).max() >= 2  # a row is cut
  assert pack_rows(heads=heads, head_groups=1, num_splits=plan.num_splits) == 64 // heads
  poisoned, _ = poison(cache, table, lens)

  def run(c, select, pack):
    return _mla_decode(
        q, jnp.asarray(c, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens), plan,
        sm_scale=SCALE, select=select, interpret=FAST, kv_swizzle=64, q_regs=0, pack=pack)

  for c, select in ((cache, True), (poisoned, False)):
    (out, lse), (want, want_lse) = run(c, select, True), run(c, select, False)
    assert out.shape == (len(seq_lens), heads, 512)
    out32, want32 = np.asarray(out, np.float32), np.asarray(want, np.float32)
    np.testing.assert_array_equal(np.isnan(out32), np.isnan(want32))
    np.testing.assert_allclose(out32, want32, rtol=2**-7, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6)
    if select:
      assert_close((out, lse), run_reference(q, cache, table, lens))
    else:
      assert np.isnan(np.asarray(out, np.float32)).any()


@pytest.mark.parametrize("heads,finish_rows", [(16, False), (8, True)])
def test_packed_merge_lowers_for_hopper(heads, finish_rows):
  from jaxkv.kernels.mla_decode import packed_merge

  batch, splits = 5, 3
  call = packed_merge.build_packed_merge(
      batch=batch, num_splits=splits, heads=heads, dv=512, max_tokens=512,
      out_dtype=jnp.bfloat16, interpret=None, finish_rows=finish_rows)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  args = [i32(batch), i32(batch, splits + 1), f32(batch, splits, 64, 512), f32(batch, splits, 64)]
  if finish_rows:
    args += [jax.ShapeDtypeStruct((batch, 64, 512), jnp.bfloat16), f32(batch, 64)]
  text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
