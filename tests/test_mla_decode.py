"""Dense paged MLA decode: kernel (interpret mode) against the jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode import (
    MLADecodeConfig,
    mla_decode,
    mla_decode_plan,
)

from mla_problem import (
    BS,
    FAST,
    RACES,
    SCALE,
    assert_close,
    poison,
    problem,
    run_decode,
    run_reference,
    segments,
)


@pytest.mark.parametrize(
    "seq_lens,heads,splits,interpret",
    [
        # 8 heads (64 at tensor parallelism 8): one row group of the query tile.
        ([1, BS - 1, BS, BS + 1, 0, 3 * BS - 7], 8, 1, RACES),
        ([5 * BS + 3, 0, 2 * BS], 64, 3, FAST),
        ([5 * BS - 1, BS + 1], 128, 2, FAST),
        # Fewer heads than a head group, unpadded (the kernel copies 16 rows
        # of the query, the merge stores 16 rows), the race detector on.
        ([3 * BS + 5, 0, 2 * BS], 16, 3, RACES),
        # Two head groups, the second partly real (heads 64-95 real, 96-127 not).
        ([2 * BS + 1, 5], 96, 2, FAST),
        # More splits than the per-split merge takes in one pass: three rows
        # fill the grouped merge's grid (8 channels a CTA); one row does not,
        # and goes through the two passes; with 128 heads it does (two head
        # groups in the partials' per-CTA layout). 32 and 48 heads: both
        # paths store the real heads alone.
        ([9 * BS + 3, 0, 2 * BS], 32, 40, FAST),
        ([40 * BS + 3], 48, 40, FAST),
        ([40 * BS + 3], 128, 40, FAST),
        # 17-32 splits, one head group, a grid of 192 CTAs: the grouped merge
        # at 8 channels per CTA rather than the per-split ring's one pass.
        ([20 * BS + 3, 0, 9 * BS], 64, 24, FAST),
    ],
)
def test_matches_reference(seq_lens, heads, splits, interpret):
  q, cache, table, lens = problem(0, seq_lens, heads)
  plan = None
  if splits > 1:  # the case cuts a row: its splits are merged
    # Several rows of many splits: 24 SMs' parts, not 132 (mostly empty
    # CTAs, which cost the interpreter as much as busy ones). One row keeps
    # 132: it needs more than 32 splits for the two passes.
    plan = mla_decode_plan(
        jnp.asarray(lens), num_heads=heads,
        config=MLADecodeConfig(num_splits=splits, min_chunk_blocks=1),
        num_sms=24 if len(seq_lens) > 1 and splits > 16 else 132,
    )
    assert (np.diff(np.asarray(plan.bounds), axis=1) > 0).sum(axis=1).max() >= 2
    if plan.num_splits > 16:  # the merge path the comments above name
      from jaxkv.kernels.mla_decode.merge_tiling import use_grouped

      grouped = use_grouped(batch=len(seq_lens), head_groups=-(-heads // 64), num_splits=plan.num_splits)
      assert grouped == {(3, 32): True, (3, 64): True, (1, 48): False, (1, 128): True}[len(seq_lens), heads]
  got = run_decode(q, cache, table, lens, splits=splits, interpret=interpret, plan=plan)
  assert_close(got, run_reference(q, cache, table, lens))
  out, lse = got
  assert out.shape == (len(seq_lens), heads, 512) and lse.shape == (len(seq_lens), heads)
  for b, s in enumerate(seq_lens):
    if s == 0:
      assert (np.asarray(out[b], np.float32) == 0).all()
      assert (np.asarray(lse[b]) == -np.inf).all()


def test_running_maximum_handed_between_the_halves():
  # The consumers fold a tile's two 32-slot halves into the running maximum
  # one after the other: scores ~8x larger in one half of some tiles (the
  # second half's in one, the first half's in another, both in a third)
  # make the maximum jump inside a tile, in either order.
  seq_lens = [4 * BS + 17, 3 * BS]
  q, cache, table, lens = problem(3, seq_lens, 64)
  cache[table[0, 1], BS // 2:] *= 8  # row 0, tile 1: the second half
  cache[table[0, 2], :BS // 2] *= 8  # tile 2: the first half
  cache[table[1, 0]] *= 8  # row 1, tile 0: both
  cache[table[1, 2], BS // 2:] *= -8
  got = run_decode(q, cache, table, lens, splits=1)
  assert_close(got, run_reference(q, cache, table, lens))


def test_nan_poisoning_select_and_multiply():
  seq_lens = [BS, BS + 1, 0, 2 * BS - 3, 2 * BS]
  q, cache, table, lens = problem(1, seq_lens, 16)
  poisoned, _ = poison(cache, table, lens)
  clean_ref = run_reference(q, cache, table, lens)
  # Rows whose last block has an unwritten tail read NaN in "multiply" mode;
  # padded entries (the null block) and unused blocks are never read.
  nan_rows = np.array([s % BS != 0 for s in seq_lens])

  assert_close(run_decode(q, poisoned, table, lens, splits=2), clean_ref)

  out, lse = run_decode(q, poisoned, table, lens, splits=2, mask_mode="multiply")
  row_nan = np.isnan(np.asarray(out, np.float32)).any(axis=(1, 2))
  np.testing.assert_array_equal(row_nan, nan_rows)
  assert np.isnan(np.asarray(out, np.float32)[nan_rows]).all()
  assert not np.isnan(np.asarray(lse)).any()
  ref_out, _ = run_reference(q, poisoned, table, lens, mask_mode="multiply")
  np.testing.assert_array_equal(
      np.isnan(np.asarray(ref_out, np.float32)).any(axis=(1, 2)), nan_rows
  )
  good = ~nan_rows
  np.testing.assert_allclose(
      np.asarray(out, np.float32)[good], np.asarray(clean_ref[0], np.float32)[good],
      rtol=2e-2, atol=2e-2,
  )

  zeroed = poisoned.copy()
  for b, s in enumerate(seq_lens):
    if s % BS:
      zeroed[table[b, s // BS], s % BS:] = 0.0
  zeroed[0] = 0.0
  assert_close(run_decode(q, zeroed, table, lens, splits=1, mask_mode="multiply"), clean_ref)


def test_nan_poisoning_after_steady_state_loop():
  # One split per row of 3-5 blocks: full blocks run the unmasked loop body
  # (the ring wraps), the partial last block runs the peeled masked step.
  seq_lens = [4 * BS + 5, 3 * BS - 1, 5 * BS, 2 * BS + 1]
  q, cache, table, lens = problem(5, seq_lens, 16)
  poisoned, _ = poison(cache, table, lens)
  clean_ref = run_reference(q, cache, table, lens)
  nan_rows = np.array([s % BS != 0 for s in seq_lens])

  assert_close(run_decode(q, poisoned, table, lens, splits=1), clean_ref)

  out, lse = run_decode(q, poisoned, table, lens, splits=1, mask_mode="multiply")
  out = np.asarray(out, np.float32)
  np.testing.assert_array_equal(np.isnan(out).any(axis=(1, 2)), nan_rows)
  assert not np.isnan(np.asarray(lse)).any()
  np.testing.assert_allclose(np.asarray(lse), np.asarray(clean_ref[1]), rtol=1e-3, atol=1e-3)


def test_reference_modes_on_poison():
  q, cache, table, lens = problem(2, [BS + 5, 2 * BS, 0, 7], 8)
  poisoned, _ = poison(cache, table, lens)
  clean = run_reference(q, cache, table, lens)
  sel = run_reference(q, poisoned, table, lens)
  np.testing.assert_array_equal(np.asarray(sel[0]), np.asarray(clean[0]))
  np.testing.assert_array_equal(np.asarray(sel[1]), np.asarray(clean[1]))
  mul, _ = run_reference(q, poisoned, table, lens, mask_mode="multiply")
  np.testing.assert_array_equal(
      np.isnan(np.asarray(mul, np.float32)).any(axis=(1, 2)), [True, False, False, True]
  )


def test_reference_reads_blocks_outside_the_cache_as_zeros():
  """A row's block-table entry outside `[0, num_blocks)` reads as a block of
  zeros (what the kernel's out-of-bounds copies land; the benchmark checks the
  kernel on the GPU, where the interpreter refuses such reads), never the
  cache's first or last block, both of which are NaN here."""
  q, cache, table, lens = problem(4, [3 * BS, 2 * BS + 9], 8)
  cache[0] = cache[-1] = np.nan  # neither the null block nor an unused one is any row's
  outside = table.copy()
  outside[0, 1], outside[1, 0], outside[1, 2] = cache.shape[0], -1, 2**31 - 1
  with_zeros = np.concatenate([cache, np.zeros_like(cache[:1])])
  zero_ids = np.where(outside != table, cache.shape[0], table)
  for mode in ("select", "multiply"):
    got = run_reference(q, cache, outside, lens, mode)
    want = run_reference(q, with_zeros, zero_ids, lens, mode)
    assert np.isfinite(np.asarray(got[0], np.float32)).all()
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_reference_jits_with_traced_lengths():
  q, cache, table, lens = problem(3, [BS + 1, 3], 4)
  f = jax.jit(lambda t, s: run_reference(q, cache, t, s))
  a = f(jnp.asarray(table), jnp.asarray(lens))
  b = run_reference(q, cache, table, lens)
  np.testing.assert_allclose(np.asarray(a[1]), np.asarray(b[1]), rtol=1e-6)



@pytest.mark.parametrize("splits", [3, 40])
def test_parts_spanning_rows_match_reference_and_stay_nan_safe(splits):
  """Parts that hold the end of one row, whole rows (one empty) and the start of
  another; a row cut mid-way into two splits; poisoned tails and null block.
  More rows than parts: the kernel finishes the whole rows itself, and the
  merge (in two passes past 32 splits) the others."""
  seq_lens = [BS + 1, 3 * BS, 0, 2 * BS - 3, 5, 4 * BS, BS]
  q, cache, table, lens = problem(11, seq_lens, 16)
  config = MLADecodeConfig(
      num_splits=splits, ctas_per_sm=1, min_chunk_blocks=1, split_overhead_tiles=0
  )
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=16, config=config, num_sms=4)
  assert len(seq_lens) > plan.num_parts  # the kernel finishes whole rows
  segs = segments(plan, seq_lens)
  assert max(len(s) for s in segs) >= 3  # a part runs several rows
  assert len({(r, sp) for part in segs for r, _, _, sp in part if r == 1}) == 2  # row 1 is cut
  poisoned, _ = poison(cache, table, lens)
  clean_ref = run_reference(q, cache, table, lens)

  def run(c, mode):
    return mla_decode(
        q, jnp.asarray(c, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens),
        sm_scale=SCALE, mask_mode=mode, plan=plan, interpret=FAST,
    )

  if splits == 3:  # (the poisoned runs below check the two-pass merge too)
    assert_close(run(cache, "select"), clean_ref)
  sel = run(poisoned, "select")
  assert_close(sel, clean_ref)
  out, lse = run(poisoned, "multiply")
  nan_rows = np.array([s % BS != 0 for s in seq_lens])
  np.testing.assert_array_equal(np.isnan(np.asarray(out, np.float32)).any(axis=(1, 2)), nan_rows)
  assert not np.isnan(np.asarray(lse)).any()


@pytest.mark.parametrize(
    "heads,bs,kv_swizzle,q_regs",
    [(128, 64, 128, 0), (16, 32, 128, 64), (64, 128, 128, 128), (16, 32, 64, 0),
     (64, 64, 64, 128), (128, 128, 64, 64), (128, 64, 64, 192), (96, 64, 128, 128)],
)
def test_kernel_variants_match_reference_and_stay_nan_safe(heads, bs, kv_swizzle, q_regs):
  """The kernel's variants at every head count, whichever the device's config
  would pick: both layouts of the query and KV ring (kv_swizzle=64: each
  consumer multiplies its own half of P in beside the other's softmax; 128:
  64-column tiles, each consumer's PV over the whole P once both halves are
  out) and the query's first channels fed from apart (q_regs; registers when
  compiled, the same SMEM slice here). Parts of several segments (P and the
  maxima live across segment ends and row sums), a cut row, lengths around
  the tile's edges, the race detector on, poisoned tails and null block in
  both modes."""
  seq_lens = [1, BS - 1, BS + 1, 0, 3 * BS, 2 * BS - 3, 5 * BS + 7]
  q, cache, table, lens = problem(31, seq_lens, heads, bs=bs)
  config = MLADecodeConfig(
      num_splits=3, ctas_per_sm=1, min_chunk_blocks=1, split_overhead_tiles=0,
      kv_swizzle=kv_swizzle, q_regs=q_regs,
  )
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=heads, block_size=bs, config=config, num_sms=6)
  segs = segments(plan, seq_lens)
  assert max(len(s) for s in segs) >= 2  # a part runs several rows
  assert (np.diff(np.asarray(plan.bounds), axis=1) > 0).sum(axis=1).max() >= 2  # a row is cut
  poisoned, _ = poison(cache, table, lens)
  clean_ref = run_reference(q, cache, table, lens)

  def run(c, mode):
    return mla_decode(
        q, jnp.asarray(c, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens),
        sm_scale=SCALE, mask_mode=mode, plan=plan, config=config, interpret=RACES,
    )

  assert_close(run(poisoned, "select"), clean_ref)
  out, lse = run(poisoned, "multiply")
  unit = min(bs, BS)
  nan_rows = np.array([s % unit != 0 for s in seq_lens])
  np.testing.assert_array_equal(np.isnan(np.asarray(out, np.float32)).any(axis=(1, 2)), nan_rows)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(clean_ref[1]), rtol=1e-3, atol=1e-3)
  good = ~nan_rows
  np.testing.assert_allclose(
      np.asarray(out, np.float32)[good], np.asarray(clean_ref[0], np.float32)[good],
      rtol=2e-2, atol=2e-2,
  )


def test_kernel_finishes_whole_rows_and_leaves_cut_rows_to_the_merge():
  """A row that one segment covers whole is written by the decode kernel itself
  (bf16 out and its LSE; no f32 partial), a cut row only as partials, an empty
  row not at all: every output starts as NaN and is checked where it must stay
  unwritten."""
  from jaxkv.kernels.mla_decode import kernel

  seq_lens = [BS + 1, 3 * BS, 0, 2 * BS - 3, 5, 4 * BS, BS]
  q, cache, table, lens = problem(11, seq_lens, 64)
  config = MLADecodeConfig(num_splits=3, ctas_per_sm=1, min_chunk_blocks=1, split_overhead_tiles=0)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=64, config=config, num_sms=4)
  segs = [seg for part in segments(plan, seq_lens) for seg in part]
  nblk = -(-np.asarray(seq_lens) // BS)
  whole = [any(r == row and lo == 0 and n == nblk[row] for r, lo, n, _ in segs)
           for row in range(len(seq_lens))]
  # Row 1 is cut in two, row 2 is empty, the other five are whole.
  assert whole == [True, False, False, True, True, True, True], whole
  call = kernel.build_kernel(
      batch=len(seq_lens), heads_padded=64, num_parts=plan.num_parts,
      num_splits=plan.num_splits, block_size=BS, sm_scale=SCALE, select=True,
      interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan"), finish_rows=True,
  )
  o, lse, out, lse_out = call(q, jnp.asarray(cache, jnp.bfloat16), jnp.asarray(table),
                              jnp.asarray(lens), plan.row_start, plan.part_rows,
                              plan.part_start, plan.row_part)
  ref_out, ref_lse = run_reference(q, cache, table, lens)
  o, lse, out, lse_out = (np.asarray(x, np.float32) for x in (o, lse, out, lse_out))
  for row in range(len(seq_lens)):
    if whole[row]:
      assert_close((jnp.asarray(out[row], jnp.bfloat16), lse_out[row]), (ref_out[row], ref_lse[row]))
      assert np.isnan(o[row]).all() and np.isnan(lse[row]).all()
    else:
      assert np.isnan(out[row]).all() and np.isnan(lse_out[row]).all()
      live = {sp for r, _, _, sp in segs if r == row}
      assert len(live) >= 2 if nblk[row] else not live
      for sp in range(plan.num_splits):
        assert np.isfinite(o[row, sp]).all() == (sp in live)


def test_partials_of_a_short_head_group_hold_its_real_rows_alone():
  """At 16 heads the kernel writes each live split's partial O for the 16 real
  rows alone (`layout.store_head_rows`): the other 48 rows of the head group
  keep the interpreter's NaN fill, the bytes no one writes or reads."""
  from jaxkv.kernels.mla_decode import kernel

  seq_lens = [3 * BS + 5, 0, 2 * BS, 5 * BS - 1]
  q, cache, table, lens = problem(13, seq_lens, 16)
  config = MLADecodeConfig(num_splits=3, min_chunk_blocks=1, split_overhead_tiles=0)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=16, config=config, num_sms=6)
  call = kernel.build_kernel(
      batch=len(seq_lens), heads_padded=64, num_parts=plan.num_parts,
      num_splits=plan.num_splits, block_size=BS, sm_scale=SCALE, select=True,
      interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan"), q_heads=16,
  )
  o, lse = call(q, jnp.asarray(cache, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens),
                plan.row_start, plan.part_rows, plan.part_start, plan.row_part)
  o = np.asarray(o)
  live = [(r, sp) for part in segments(plan, seq_lens) for r, _, _, sp in part]
  assert len(live) > len(seq_lens)  # some row is cut
  for r, sp in live:
    assert np.isfinite(o[r, sp, :16]).all()
    assert np.isnan(o[r, sp, 16:]).all()


def test_a_stale_plan_reads_nothing_outside_the_rows():
  """A plan computed for other lengths (rows it thinks longer, shorter, empty, or
  longer than the table holds) gives wrong splits but never reads a slot outside
  the current rows' blocks: with those NaN, "select" stays finite."""
  seq_lens = [2 * BS + 5, 3, 0, 4 * BS]
  stale_lens = [BS, 6 * BS, 3 * BS, 2 * BS + 1]
  # The table is exactly as wide as the longest current row: the stale plan's
  # 6-block row would run past it.
  q, cache, table, lens = problem(13, seq_lens, 16, max_blocks=4)
  config = MLADecodeConfig(num_splits=3, ctas_per_sm=1, min_chunk_blocks=1)
  plan = mla_decode_plan(jnp.asarray(stale_lens, jnp.int32), num_heads=16, config=config, num_sms=4)
  poisoned, _ = poison(cache, table, lens)
  out, lse = mla_decode(
      q, jnp.asarray(poisoned, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens),
      sm_scale=SCALE, plan=plan, interpret=FAST,
  )
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert not np.isnan(np.asarray(lse)).any()
  # The empty row stays empty whatever the plan says.
  assert (np.asarray(out[2], np.float32) == 0).all() and (np.asarray(lse[2]) == -np.inf).all()


def test_all_rows_empty():
  q, cache, table, lens = problem(13, [0, 0, 0], 64)
  out, lse = run_decode(q, cache, table, lens, splits=3)
  assert (np.asarray(out, np.float32) == 0).all()
  assert (np.asarray(lse) == -np.inf).all()


@pytest.mark.parametrize(
    "bs,seq_lens,heads,max_blocks",
    [
        # The longest row ends in the first block of its last tile, and the
        # table is exactly as wide as its blocks: the tile's second block
        # would be past the table.
        (32, [1, 31, 32, 33, 63, 64, 65, 0, 157], 16, 5),
        (128, [1, 63, 64, 65, 127, 128, 129, 0, 3 * 128 - 5], 64, None),
    ],
)
def test_block_sizes_32_and_128(bs, seq_lens, heads, max_blocks):
  """Tiles of 64 slots over other block sizes: the reference in both modes, NaN
  in tails, the null block and unused blocks; "multiply" reads unwritten slots
  up to a multiple of min(block_size, 64) and never past a row's last block."""
  q, cache, table, lens = problem(21, seq_lens, heads, max_blocks=max_blocks, bs=bs)
  assert cache.shape[1] == bs
  poisoned, _ = poison(cache, table, lens)
  clean_ref = run_reference(q, cache, table, lens)
  # "select" over the poisoned cache must give the clean cache's reference.
  assert_close(run_decode(q, poisoned, table, lens, splits=2), clean_ref)

  unit = min(bs, 64)
  nan_rows = np.array([s % unit != 0 for s in seq_lens])
  assert nan_rows.any() and not nan_rows.all()
  ref_out, _ = run_reference(q, poisoned, table, lens, mask_mode="multiply")
  np.testing.assert_array_equal(np.isnan(np.asarray(ref_out, np.float32)).any(axis=(1, 2)), nan_rows)
  out, lse = run_decode(q, poisoned, table, lens, splits=2, mask_mode="multiply")
  out = np.asarray(out, np.float32)
  np.testing.assert_array_equal(np.isnan(out).any(axis=(1, 2)), nan_rows)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(clean_ref[1]), rtol=1e-3, atol=1e-3)
  good = ~nan_rows
  np.testing.assert_allclose(out[good], np.asarray(clean_ref[0], np.float32)[good], rtol=2e-2, atol=2e-2)


def test_float32_queries():
  """float32 queries are cast to bf16 for the kernels and their result back to
  float32: bit for bit the bf16 queries' result (these queries are bf16 values)."""
  q, cache, table, lens = problem(9, [2 * BS + 5, 7], 16)
  out, lse = run_decode(q.astype(jnp.float32), cache, table, lens, splits=1)
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
  out16, lse16 = run_decode(q, cache, table, lens, splits=1)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(out16, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse16))
