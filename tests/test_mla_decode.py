"""Dense paged MLA decode: kernel (interpret mode) against the jnp reference."""

from __future__ import annotations

import json
import pathlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode import (
    MLADecodeConfig,
    MLADecodePlan,
    combine_splits,
    heuristic_config,
    mla_decode,
    mla_decode_plan,
    mla_decode_reference,
)
from jaxkv.kernels.mla_decode.config import config_from_entries

BS = 64
SCALE = 576**-0.5
RACES = plgpu.InterpretGPUParams(detect_races=True)
FAST = plgpu.InterpretGPUParams()
TUNING = pathlib.Path(__file__).parents[1] / "configs/tuning/mla_decode/nvidia_h200.json"


def _problem(seed, seq_lens, heads, max_blocks=None, bs=BS):
  """Random q and cache; every row gets distinct random blocks (never 0)."""
  rng = np.random.default_rng(seed)
  batch = len(seq_lens)
  nblk = [-(-s // bs) for s in seq_lens]
  max_blocks = max_blocks or max(max(nblk), 1) + 1
  num_blocks = 1 + sum(nblk) + 3  # null block, rows' blocks, unused blocks
  ids = rng.permutation(np.arange(1, num_blocks))
  table = np.zeros((batch, max_blocks), np.int32)  # padded with the null block
  used = 0
  for b, k in enumerate(nblk):
    table[b, :k] = ids[used:used + k]
    used += k
  q = jnp.asarray(rng.standard_normal((batch, heads, 576)), jnp.bfloat16)
  cache = rng.standard_normal((num_blocks, bs, 576)).astype(np.float32)
  return q, cache, table, np.asarray(seq_lens, np.int32)


def _poison(cache, table, seq_lens):
  """NaN in every slot no row holds: tails, the null block, unused blocks."""
  bs = cache.shape[1]
  bad = np.full(cache.shape[:2], True)
  for b, s in enumerate(seq_lens):
    for t in range(s):
      bad[table[b, t // bs], t % bs] = False
  out = cache.copy()
  out[bad] = np.nan
  return out, bad


def _run(q, cache, table, seq_lens, *, splits, mask_mode="select", interpret=FAST, plan=None):
  return mla_decode(
      q, jnp.asarray(cache, jnp.bfloat16), jnp.asarray(table), jnp.asarray(seq_lens),
      sm_scale=SCALE, mask_mode=mask_mode,
      config=MLADecodeConfig(num_splits=splits, min_chunk_blocks=1),
      plan=plan, interpret=interpret,
  )


def _ref(q, cache, table, seq_lens, mask_mode="select"):
  return mla_decode_reference(
      q, jnp.asarray(cache, jnp.bfloat16), jnp.asarray(table), jnp.asarray(seq_lens),
      sm_scale=SCALE, mask_mode=mask_mode,
  )


def _assert_close(got, want):
  out, lse = got
  ref_out, ref_lse = want
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  out = np.asarray(out, np.float32)
  ref_out = np.asarray(ref_out, np.float32)
  assert np.isfinite(out).all()
  err = np.linalg.norm(out - ref_out) / max(np.linalg.norm(ref_out), 1e-6)
  assert err < 1e-2, err
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-3, atol=1e-3)


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
  q, cache, table, lens = _problem(0, seq_lens, heads)
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
  got = _run(q, cache, table, lens, splits=splits, interpret=interpret, plan=plan)
  _assert_close(got, _ref(q, cache, table, lens))
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
  q, cache, table, lens = _problem(3, seq_lens, 64)
  cache[table[0, 1], BS // 2:] *= 8  # row 0, tile 1: the second half
  cache[table[0, 2], :BS // 2] *= 8  # tile 2: the first half
  cache[table[1, 0]] *= 8  # row 1, tile 0: both
  cache[table[1, 2], BS // 2:] *= -8
  got = _run(q, cache, table, lens, splits=1)
  _assert_close(got, _ref(q, cache, table, lens))


def test_nan_poisoning_select_and_multiply():
  seq_lens = [BS, BS + 1, 0, 2 * BS - 3, 2 * BS]
  q, cache, table, lens = _problem(1, seq_lens, 16)
  poisoned, _ = _poison(cache, table, lens)
  clean_ref = _ref(q, cache, table, lens)
  # Rows whose last block has an unwritten tail read NaN in "multiply" mode;
  # padded entries (the null block) and unused blocks are never read.
  nan_rows = np.array([s % BS != 0 for s in seq_lens])

  _assert_close(_run(q, poisoned, table, lens, splits=2), clean_ref)

  out, lse = _run(q, poisoned, table, lens, splits=2, mask_mode="multiply")
  row_nan = np.isnan(np.asarray(out, np.float32)).any(axis=(1, 2))
  np.testing.assert_array_equal(row_nan, nan_rows)
  assert np.isnan(np.asarray(out, np.float32)[nan_rows]).all()
  assert not np.isnan(np.asarray(lse)).any()
  ref_out, _ = _ref(q, poisoned, table, lens, mask_mode="multiply")
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
  _assert_close(_run(q, zeroed, table, lens, splits=1, mask_mode="multiply"), clean_ref)


def test_nan_poisoning_after_steady_state_loop():
  # One split per row of 3-5 blocks: full blocks run the unmasked loop body
  # (the ring wraps), the partial last block runs the peeled masked step.
  seq_lens = [4 * BS + 5, 3 * BS - 1, 5 * BS, 2 * BS + 1]
  q, cache, table, lens = _problem(5, seq_lens, 16)
  poisoned, _ = _poison(cache, table, lens)
  clean_ref = _ref(q, cache, table, lens)
  nan_rows = np.array([s % BS != 0 for s in seq_lens])

  _assert_close(_run(q, poisoned, table, lens, splits=1), clean_ref)

  out, lse = _run(q, poisoned, table, lens, splits=1, mask_mode="multiply")
  out = np.asarray(out, np.float32)
  np.testing.assert_array_equal(np.isnan(out).any(axis=(1, 2)), nan_rows)
  assert not np.isnan(np.asarray(lse)).any()
  np.testing.assert_allclose(np.asarray(lse), np.asarray(clean_ref[1]), rtol=1e-3, atol=1e-3)


def test_reference_modes_on_poison():
  q, cache, table, lens = _problem(2, [BS + 5, 2 * BS, 0, 7], 8)
  poisoned, _ = _poison(cache, table, lens)
  clean = _ref(q, cache, table, lens)
  sel = _ref(q, poisoned, table, lens)
  np.testing.assert_array_equal(np.asarray(sel[0]), np.asarray(clean[0]))
  np.testing.assert_array_equal(np.asarray(sel[1]), np.asarray(clean[1]))
  mul, _ = _ref(q, poisoned, table, lens, mask_mode="multiply")
  np.testing.assert_array_equal(
      np.isnan(np.asarray(mul, np.float32)).any(axis=(1, 2)), [True, False, False, True]
  )


def test_reference_reads_blocks_outside_the_cache_as_zeros():
  """A row's block-table entry outside `[0, num_blocks)` reads as a block of
  zeros (what the kernel's out-of-bounds copies land; the benchmark checks the
  kernel on the GPU, where the interpreter refuses such reads), never the
  cache's first or last block, both of which are NaN here."""
  q, cache, table, lens = _problem(4, [3 * BS, 2 * BS + 9], 8)
  cache[0] = cache[-1] = np.nan  # neither the null block nor an unused one is any row's
  outside = table.copy()
  outside[0, 1], outside[1, 0], outside[1, 2] = cache.shape[0], -1, 2**31 - 1
  with_zeros = np.concatenate([cache, np.zeros_like(cache[:1])])
  zero_ids = np.where(outside != table, cache.shape[0], table)
  for mode in ("select", "multiply"):
    got = _ref(q, cache, outside, lens, mode)
    want = _ref(q, with_zeros, zero_ids, lens, mode)
    assert np.isfinite(np.asarray(got[0], np.float32)).all()
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_reference_jits_with_traced_lengths():
  q, cache, table, lens = _problem(3, [BS + 1, 3], 4)
  f = jax.jit(lambda t, s: _ref(q, cache, t, s))
  a = f(jnp.asarray(table), jnp.asarray(lens))
  b = _ref(q, cache, table, lens)
  np.testing.assert_allclose(np.asarray(a[1]), np.asarray(b[1]), rtol=1e-6)


def test_plan_covers_blocks_exactly():
  lens = jnp.asarray([0, 1, 64, 65, 4096, 131072, 700], jnp.int32)
  config = MLADecodeConfig(num_splits=16, ctas_per_sm=2, min_chunk_blocks=8)
  plan = jax.jit(lambda s: mla_decode_plan(s, num_heads=128, config=config))(lens)
  bounds = np.asarray(plan.bounds)
  assert plan.num_splits == 16 and bounds.shape == (7, 17)
  nblk = -(-np.asarray(lens) // 64)
  np.testing.assert_array_equal(bounds[:, 0], 0)
  np.testing.assert_array_equal(bounds[:, -1], nblk)
  assert (np.diff(bounds, axis=1) >= 0).all()
  assert (np.diff(bounds, axis=1)[nblk > 8 * 16] > 0).any()


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


def test_configs_valid():
  entries = json.loads(TUNING.read_text())["entries"]
  for entry in entries:
    for heads in entry["heads"]:
      config = config_from_entries(entries, batch=entry["max_batch"], num_heads=heads)
      assert isinstance(config, MLADecodeConfig)
  for batch in (1, 8, 128):
    for heads in (16, 64, 128):
      assert heuristic_config(batch=batch, num_heads=heads).num_splits >= 1
  with pytest.raises(ValueError, match="num_splits"):
    MLADecodeConfig(num_splits=0)
  with pytest.raises(ValueError, match="split_overhead_tiles"):
    MLADecodeConfig(split_overhead_tiles=-1)
  with pytest.raises(ValueError, match="kv_swizzle"):
    MLADecodeConfig(kv_swizzle=32)
  with pytest.raises(ValueError, match="q_regs"):
    MLADecodeConfig(q_regs=96)
  # The tuned and heuristic configs stream one head group under the 128-byte
  # swizzle; two head groups, bound by the chain, keep the 64-byte one and
  # hold 128 query channels in registers.
  for batch in (1, 8, 128):
    one, two = (heuristic_config(batch=batch, num_heads=h) for h in (64, 128))
    assert (one.kv_swizzle, one.q_regs, two.kv_swizzle, two.q_regs) == (128, 0, 64, 128)
  for entry in entries:
    config = MLADecodeConfig(**entry["config"])
    want = (128, 0) if max(entry["heads"]) <= 64 else (64, 128)
    assert (config.kv_swizzle, config.q_regs) == want, entry


def _bad_plan(**change):
  """A plan of the right shapes for batch 2 and one part, with `change` applied."""
  fields = dict(
      bounds=jnp.zeros((2, 2), jnp.int32), row_start=jnp.zeros((3,), jnp.int32),
      part_rows=jnp.zeros((1, 2), jnp.int32), part_start=jnp.zeros((2,), jnp.int32),
      row_part=jnp.zeros((2,), jnp.int32),
  )
  fields.update(change)
  return MLADecodePlan(**fields)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=jnp.zeros((2, 4, 512), jnp.bfloat16)), "q.shape"),
        (dict(q=jnp.zeros((2, 4, 576), jnp.float32)), "q.dtype"),
        (dict(cache=jnp.zeros((4, 16, 576), jnp.bfloat16)), "block_size"),
        (dict(cache=jnp.zeros((4, 96, 576), jnp.bfloat16)), "block_size"),
        (dict(cache=jnp.zeros((4, 64, 576), jnp.float16)), "cache.dtype"),
        (dict(block_table=jnp.zeros((3, 2), jnp.int32)), "block_table.shape"),
        (dict(block_table=jnp.zeros((2, 2), jnp.int64 if jax.config.x64_enabled else jnp.int16)), "block_table.dtype"),
        (dict(seq_lens=jnp.zeros((3,), jnp.int32)), "seq_lens"),
        (dict(sm_scale=-1.0), "sm_scale"),
        (dict(dv=256), "dv"),
        (dict(mask_mode="zero"), "mask_mode"),
        (dict(plan=_bad_plan(bounds=jnp.zeros((3, 2), jnp.int32))), "plan.bounds"),
        (dict(plan=_bad_plan(row_start=jnp.zeros((2,), jnp.int32))), "plan.row_start"),
        (dict(plan=_bad_plan(part_rows=jnp.zeros((1, 3), jnp.int32))), "plan.part_rows"),
        (dict(plan=_bad_plan(part_start=jnp.zeros((3,), jnp.int32))), "plan.part_start"),
        (dict(plan=_bad_plan(part_start=jnp.zeros((2,), jnp.float32))), "plan.part_start"),
        (dict(plan=_bad_plan(row_part=jnp.zeros((3,), jnp.int32))), "plan.row_part"),
    ],
)
def test_bad_inputs(change, match):
  args = dict(
      q=jnp.zeros((2, 4, 576), jnp.bfloat16), cache=jnp.zeros((4, 64, 576), jnp.bfloat16),
      block_table=jnp.zeros((2, 2), jnp.int32), seq_lens=jnp.zeros((2,), jnp.int32),
      sm_scale=0.1, dv=512, mask_mode="select", plan=None,
  )
  args.update(change)
  q, cache, table, lens = (args.pop(k) for k in ("q", "cache", "block_table", "seq_lens"))
  with pytest.raises(ValueError, match=match.replace(".", r"\.")):
    mla_decode(q, cache, table, lens, **args)


def test_profiler_needs_a_compiled_kernel():
  from jaxkv.kernels.mla_decode import kernel

  with pytest.raises(ValueError, match="profile_dir"):
    kernel.build_kernel(
        batch=1, heads_padded=64, num_parts=1, num_splits=1, block_size=64,
        sm_scale=0.1, select=True, interpret=object(), profile_dir="/tmp/trace",
    )
  with pytest.raises(ValueError, match="kv_swizzle"):
    kernel.build_kernel(
        batch=1, heads_padded=64, num_parts=1, num_splits=1, block_size=64,
        sm_scale=0.1, select=True, interpret=None, kv_swizzle=32,
    )
  with pytest.raises(ValueError, match="q_regs"):
    kernel.build_kernel(
        batch=1, heads_padded=64, num_parts=1, num_splits=1, block_size=64,
        sm_scale=0.1, select=True, interpret=None, q_regs=256,
    )


@pytest.mark.parametrize(
    "block_size, select, finish_rows, kv_swizzle, q_regs",
    [(64, True, True, 64, 0), (32, False, False, 64, 128), (128, True, False, 64, 64),
     (64, False, True, 128, 0), (32, True, False, 128, 64), (128, False, False, 128, 128),
     (64, True, True, 64, 192)],
)
def test_compiled_kernels_lower_for_hopper(block_size, select, finish_rows, kv_swizzle, q_regs):
  """The compiled kernels' own paths (the RoPE query in registers, the seeded
  accumulator) exist only for the GPU, where the interpreter cannot run them:
  lowering the decode and merge kernels for CUDA here catches a broken body on a
  CPU machine. (Their results are checked on the H200 by the benchmark script.)"""
  from jaxkv.kernels.mla_decode import kernel, merge

  batch, hp, parts, splits, max_blocks = 2, 128, 4, 3, 8
  decode = kernel.build_kernel(
      batch=batch, heads_padded=hp, num_parts=parts, num_splits=splits,
      block_size=block_size, sm_scale=SCALE, select=select, interpret=None,
      finish_rows=finish_rows, kv_swizzle=kv_swizzle, q_regs=q_regs,
  )
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  args = (
      jax.ShapeDtypeStruct((batch, hp, 576), jnp.bfloat16),
      jax.ShapeDtypeStruct((16, block_size, 576), jnp.bfloat16),
      i32(batch, max_blocks), i32(batch), i32(batch + 1), i32(parts, 2), i32(parts + 1),
      i32(batch),
  )
  text = jax.jit(decode).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "wgmma.mma_async" in text and "setmaxnreg" in text
  # The QK reads the query through `seesaw.tile_scores`' opaque index: without
  # it LLVM hoists the query's wgmma descriptors into 42 registers and the tile
  # loop spills (kernels/mla_decode/NOTES.md).
  assert "optimization_barrier" in text
  combine = merge.build_merge(
      batch=batch, num_splits=splits, heads_padded=hp, dv=512,
      max_tokens=max_blocks * block_size, out_dtype=jnp.bfloat16, interpret=None,
      finish_rows=finish_rows,
  )
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  merge_args = (i32(batch), i32(batch, splits + 1), f32(batch, splits, hp, 512), f32(batch, splits, hp))
  if finish_rows:
    merge_args += (jax.ShapeDtypeStruct((batch, hp, 512), jnp.bfloat16), f32(batch, hp))
  merge_text = jax.jit(combine).trace(*merge_args).lower(lowering_platforms=("cuda",)).as_text()
  # With finish_rows the merge writes into the decode kernel's output in place.
  assert ("output_operand_aliases" in merge_text) == finish_rows
  # The second of two passes, reading its chunks' bounds from the plan's columns.
  second = merge.build_merge(
      batch=batch, num_splits=2, heads_padded=hp, dv=512, max_tokens=max_blocks * block_size,
      out_dtype=jnp.bfloat16, interpret=None, edge_chunk=2,
  )
  second_args = (i32(batch), i32(batch, splits + 1), f32(batch, 2, hp, 512), f32(batch, 2, hp))
  assert "mosaic_gpu" in jax.jit(second).trace(*second_args).lower(lowering_platforms=("cuda",)).as_text()


def test_grouped_merge_lowers_with_bulk_copies():
  """The grouped merge's partials (`merge_tiling.wide_partials`' layout, which the
  decode kernel stores with `partial_cols`) come in by bulk copies, the
  row's LSE in one and whole groups of splits in each other, not by TMA
  boxes of narrow rows. Lowered for CUDA on the CPU, both kernels at 1 x 128 x 128K's
  shape (67 splits, 8 channels per merge CTA)."""
  from jaxkv.kernels.mla_decode import kernel, merge, merge_tiling

  batch, hp, splits, parts = 1, 128, 67, 66
  cols, _ = merge_tiling.grouped_tiling(batch=batch, head_groups=2, num_splits=splits)
  assert cols == 8
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  decode = kernel.build_kernel(
      batch=batch, heads_padded=hp, num_parts=parts, num_splits=splits, block_size=64,
      sm_scale=SCALE, select=True, interpret=None, partial_cols=cols,
  )
  args = (jax.ShapeDtypeStruct((batch, hp, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((16, 64, 576), jnp.bfloat16),
          i32(batch, 8), i32(batch), i32(batch + 1), i32(parts, 2), i32(parts + 1), i32(batch))
  o, lse = jax.eval_shape(decode, *args)
  assert o.shape == (batch, 512 // cols, 2, splits, 64, cols) and lse.shape == (batch, 2, splits, 64)
  assert "wgmma.mma_async" in jax.jit(decode).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  combine = merge.build_merge(batch=batch, num_splits=splits, heads_padded=hp, dv=512,
                              max_tokens=4096, out_dtype=jnp.bfloat16, interpret=None, group=True)
  text = jax.jit(combine).trace(i32(batch), i32(batch, splits + 1), o, lse).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "cp.async.bulk.shared::cta.global" in text  # the LSE and the groups of splits
  assert "cp.async.bulk.tensor" not in text


def test_p_hand_offs_fence_only_where_the_async_proxy_reads(monkeypatch, capsys):
  """The consumers fence P toward the async proxy (`commit_smem`) before handing
  it on only where the other's wgmma reads it from SMEM (the 64-byte ring) or
  TMA writes its tile next (a segment's last tile): under the 128-byte ring the
  steady-state tile's two hand-offs go unfenced, since the other warpgroup
  loads P with plain loads. Counted in the Mosaic GPU module the compiled
  kernel lowers to (what the GPU runs; the interpreter fences every tile, and
  the H200 check compares `p_fence=True` bitwise with the default)."""
  import functools

  from jaxkv.kernels.mla_decode import kernel, layout

  # `layout.launch` builds the call through `plgpu.kernel`.
  monkeypatch.setattr(layout.plgpu, "kernel", functools.partial(plgpu.kernel, debug=True))
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  batch, hp, parts, max_blocks = 2, 64, 4, 8
  args = (
      jax.ShapeDtypeStruct((batch, hp, 576), jnp.bfloat16),
      jax.ShapeDtypeStruct((16, 64, 576), jnp.bfloat16),
      i32(batch, max_blocks), i32(batch), i32(batch + 1), i32(parts, 2), i32(parts + 1),
      i32(batch),
  )

  def fences(kv_swizzle, p_fence):
    decode = kernel.build_kernel(
        batch=batch, heads_padded=hp, num_parts=parts, num_splits=3, block_size=64,
        sm_scale=SCALE, select=True, interpret=None, kv_swizzle=kv_swizzle, p_fence=p_fence,
    )
    capsys.readouterr()
    jax.jit(decode).trace(*args).lower(lowering_platforms=("cuda",))
    return capsys.readouterr().out.count("nvvm.fence.proxy")

  # One hand-off per consumer and tile body (the loop's and the peeled last
  # tile's): two fewer fences under the 128-byte ring, none fewer under 64.
  every = fences(128, True)
  assert every >= 4 and fences(128, None) == every - 2
  assert fences(64, None) == fences(64, True)


@pytest.mark.parametrize("op", ["mla_decode", "sparse_mla_decode"])
def test_register_split_fits_the_launch(op):
  """`setmaxnreg` can only move registers inside the launch's allocation (168
  per thread for three warpgroups); a split past it hangs the consumers on the
  GPU, where the interpreter cannot notice. Both kernels' splits must fit."""
  import importlib

  from jaxkv.kernels.mla_decode.layout import NUM_THREADS  # both kernels' launch

  k = importlib.import_module(f"jaxkv.kernels.{op}.cta")
  regs = (k.PRODUCER_REGS, k.CONSUMER_REGS)
  assert all(r % 8 == 0 and 24 <= r <= 256 for r in regs), regs
  per_thread = 65536 // (NUM_THREADS * 128) // 8 * 8
  assert per_thread == 168
  assert k.PRODUCER_REGS + 2 * k.CONSUMER_REGS <= NUM_THREADS * per_thread, regs


def test_interpreter_without_enough_cpu_threads_fails_fast(monkeypatch):
  """Where the CPU backend cannot run the three warpgroups at once, the interpreted
  kernel would wait forever: the call raises, naming the fix, before launching."""
  import importlib

  common = importlib.import_module("jaxkv.kernels._common")
  assert common.cpu_parallelism() >= 24  # the suite's 24 CPU devices
  monkeypatch.setattr(common, "cpu_parallelism", lambda: 2)
  q, cache, table, lens = (jnp.asarray(x) for x in _problem(0, [BS + 3], 16))
  with pytest.raises(ValueError, match="jax_num_cpu_devices"):
    mla_decode(q, cache.astype(jnp.bfloat16), table, lens, sm_scale=0.1, interpret=True)


def _segments(plan, seq_lens):
  """The (row, first block, count, split) each part's CTA runs, as the kernel walks them."""
  ps = np.asarray(plan.part_start)
  rs = np.asarray(plan.row_start)
  row_part = np.asarray(plan.row_part)
  nblk = -(-np.asarray(seq_lens) // BS)
  out = []
  for p, (r0, r1) in enumerate(np.asarray(plan.part_rows)):
    beg, end = ps[p], ps[p + 1]
    segs = []
    for row in range(r0, r1):
      lo = int(np.clip(beg - rs[row], 0, nblk[row]))
      hi = int(np.clip(end - rs[row], lo, nblk[row]))
      if hi > lo:
        segs.append((row, lo, hi - lo, p - row_part[row]))
    out.append(segs)
  return out


def _cut_points(ntiles, parts, chunk, overhead):
  """Each part's first tile, walking the cost line token by token: a row costs
  `overhead` (at its start) plus its tiles; part p starts at cost p * chunk."""
  line = []  # the global tile at each unit of cost (a row's overhead maps to its first tile)
  tile = 0
  for n in ntiles:
    if n:
      line += [tile] * overhead + list(range(tile, tile + n))
      tile += n
  return [line[p * chunk] if p * chunk < len(line) else tile for p in range(parts + 1)]


@pytest.mark.parametrize(
    "seq_lens,splits,ctas,overhead",
    [
        ([BS + 1, 3 * BS, 0, 2 * BS - 3, 5, 4 * BS, BS], 3, 4, 3),
        ([BS + 1, 3 * BS, 0, 2 * BS - 3, 5, 4 * BS, BS], 3, 4, 0),
        ([0, 0, 7], 2, 132, 3),
        ([4096, 131072, 1, 0, 65 * BS, 700], 16, 264, 3),
        ([BS] * 40, 2, 8, 3),
        ([BS] * 40, 2, 8, 0),
        ([5 * BS, BS, BS, 9 * BS, 2 * BS, BS + 1], 4, 3, 2),
    ],
)
def test_plan_parts_are_balanced_and_cover_every_block_once(seq_lens, splits, ctas, overhead):
  _check_plan(seq_lens, splits=splits, ctas=ctas, overhead=overhead, min_chunk=1, heads=64)


_LENGTH = st.one_of(st.just(0), st.integers(1, 3 * BS), st.integers(1, 40 * BS))


@hypothesis.given(
    # A few batch sizes only: the plan's small ops compile once per shape.
    seq_lens=st.sampled_from([5, 24]).flatmap(
        lambda n: st.lists(_LENGTH, min_size=n, max_size=n)
    ),
    splits=st.sampled_from([1, 3, 7]),
    ctas=st.sampled_from([4, 264]),
    overhead=st.integers(0, 8),
    min_chunk=st.integers(1, 40),
    heads=st.sampled_from([64, 128]),
)
@hypothesis.settings(max_examples=25)
def test_plan_invariants_on_random_steps(seq_lens, splits, ctas, overhead, min_chunk, heads):
  _check_plan(seq_lens, splits=splits, ctas=ctas, overhead=overhead, min_chunk=min_chunk, heads=heads)


def _check_plan(seq_lens, *, splits, ctas, overhead, min_chunk, heads):
  """The plan against a walk of the cost line: parts, splits, bounds, coverage."""
  lens = jnp.asarray(seq_lens, jnp.int32)
  config = MLADecodeConfig(
      num_splits=splits, ctas_per_sm=1, min_chunk_blocks=min_chunk,
      split_overhead_tiles=overhead,
  )
  plan = jax.jit(lambda s: mla_decode_plan(s, num_heads=heads, config=config, num_sms=ctas))(lens)
  nblk = -(-np.asarray(seq_lens) // BS)
  cost = int(nblk.sum() + overhead * (nblk > 0).sum())
  parts = plan.num_parts
  assert parts == max(1, min(ctas // -(-heads // 64), len(seq_lens) * splits))
  # Equal cost per part, unless a row would need more splits; one split: one part.
  if splits == 1:
    chunk = max(cost, 1)
  else:
    chunk = max(-(-cost // parts), min_chunk, -(-int(nblk.max()) // (splits - 1)))
  np.testing.assert_array_equal(plan.part_start, _cut_points(nblk, parts, chunk, overhead))
  bounds = np.asarray(plan.bounds)
  rs = np.asarray(plan.row_start)
  np.testing.assert_array_equal(rs, np.concatenate([[0], np.cumsum(nblk)]))
  seen = np.zeros((len(seq_lens), int(nblk.max()) + 1), np.int32)
  for p, segs in enumerate(_segments(plan, seq_lens)):
    # A part's tiles plus an overhead per row it starts stay within its chunk,
    # give or take one overhead where a cut falls inside a row's.
    starts_here = sum(1 for row, lo, _, _ in segs if lo == 0)
    assert sum(n for _, _, n, _ in segs) + overhead * starts_here <= chunk + overhead
    for row, lo, n, split in segs:
      assert 0 <= split < splits
      # The split's blocks are exactly what the plan's bounds say.
      assert (bounds[row, split], bounds[row, split + 1]) == (lo, lo + n)
      seen[row, lo:lo + n] += 1
  for row, k in enumerate(nblk):
    np.testing.assert_array_equal(seen[row, :k], 1)
    assert (seen[row, k:] == 0).all()
    if k:
      ps = np.asarray(plan.part_start)
      p = int(plan.row_part[row])
      assert ps[p] <= rs[row] < ps[p + 1]
  assert (np.diff(bounds, axis=1) >= 0).all()
  np.testing.assert_array_equal(bounds[:, 0], 0)
  np.testing.assert_array_equal(bounds[:, -1], nblk)


@pytest.mark.parametrize("splits", [3, 40])
def test_parts_spanning_rows_match_reference_and_stay_nan_safe(splits):
  """Parts that hold the end of one row, whole rows (one empty) and the start of
  another; a row cut mid-way into two splits; poisoned tails and null block.
  More rows than parts: the kernel finishes the whole rows itself, and the
  merge (in two passes past 32 splits) the others."""
  seq_lens = [BS + 1, 3 * BS, 0, 2 * BS - 3, 5, 4 * BS, BS]
  q, cache, table, lens = _problem(11, seq_lens, 16)
  config = MLADecodeConfig(
      num_splits=splits, ctas_per_sm=1, min_chunk_blocks=1, split_overhead_tiles=0
  )
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=16, config=config, num_sms=4)
  assert len(seq_lens) > plan.num_parts  # the kernel finishes whole rows
  segs = _segments(plan, seq_lens)
  assert max(len(s) for s in segs) >= 3  # a part runs several rows
  assert len({(r, sp) for part in segs for r, _, _, sp in part if r == 1}) == 2  # row 1 is cut
  poisoned, _ = _poison(cache, table, lens)
  clean_ref = _ref(q, cache, table, lens)

  def run(c, mode):
    return mla_decode(
        q, jnp.asarray(c, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens),
        sm_scale=SCALE, mask_mode=mode, plan=plan, interpret=FAST,
    )

  if splits == 3:  # (the poisoned runs below check the two-pass merge too)
    _assert_close(run(cache, "select"), clean_ref)
  sel = run(poisoned, "select")
  _assert_close(sel, clean_ref)
  out, lse = run(poisoned, "multiply")
  nan_rows = np.array([s % BS != 0 for s in seq_lens])
  np.testing.assert_array_equal(np.isnan(np.asarray(out, np.float32)).any(axis=(1, 2)), nan_rows)
  assert not np.isnan(np.asarray(lse)).any()


@pytest.mark.parametrize(
    "heads,bs,kv_swizzle,q_regs",
    [(128, 64, 128, 0), (16, 32, 128, 64), (64, 128, 128, 128), (16, 32, 64, 0),
     (64, 64, 64, 128), (128, 128, 64, 64), (128, 64, 64, 192)],
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
  q, cache, table, lens = _problem(31, seq_lens, heads, bs=bs)
  config = MLADecodeConfig(
      num_splits=3, ctas_per_sm=1, min_chunk_blocks=1, split_overhead_tiles=0,
      kv_swizzle=kv_swizzle, q_regs=q_regs,
  )
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=heads, block_size=bs, config=config, num_sms=6)
  segs = _segments(plan, seq_lens)
  assert max(len(s) for s in segs) >= 2  # a part runs several rows
  assert (np.diff(np.asarray(plan.bounds), axis=1) > 0).sum(axis=1).max() >= 2  # a row is cut
  poisoned, _ = _poison(cache, table, lens)
  clean_ref = _ref(q, cache, table, lens)

  def run(c, mode):
    return mla_decode(
        q, jnp.asarray(c, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens),
        sm_scale=SCALE, mask_mode=mode, plan=plan, config=config, interpret=RACES,
    )

  _assert_close(run(poisoned, "select"), clean_ref)
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
  q, cache, table, lens = _problem(11, seq_lens, 64)
  config = MLADecodeConfig(num_splits=3, ctas_per_sm=1, min_chunk_blocks=1, split_overhead_tiles=0)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=64, config=config, num_sms=4)
  segs = [seg for part in _segments(plan, seq_lens) for seg in part]
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
  ref_out, ref_lse = _ref(q, cache, table, lens)
  o, lse, out, lse_out = (np.asarray(x, np.float32) for x in (o, lse, out, lse_out))
  for row in range(len(seq_lens)):
    if whole[row]:
      _assert_close((jnp.asarray(out[row], jnp.bfloat16), lse_out[row]), (ref_out[row], ref_lse[row]))
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
  q, cache, table, lens = _problem(13, seq_lens, 16)
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
  live = [(r, sp) for part in _segments(plan, seq_lens) for r, _, _, sp in part]
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
  q, cache, table, lens = _problem(13, seq_lens, 16, max_blocks=4)
  config = MLADecodeConfig(num_splits=3, ctas_per_sm=1, min_chunk_blocks=1)
  plan = mla_decode_plan(jnp.asarray(stale_lens, jnp.int32), num_heads=16, config=config, num_sms=4)
  poisoned, _ = _poison(cache, table, lens)
  out, lse = mla_decode(
      q, jnp.asarray(poisoned, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens),
      sm_scale=SCALE, plan=plan, interpret=FAST,
  )
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert not np.isnan(np.asarray(lse)).any()
  # The empty row stays empty whatever the plan says.
  assert (np.asarray(out[2], np.float32) == 0).all() and (np.asarray(lse[2]) == -np.inf).all()


@pytest.mark.parametrize(
    "splits, group, stages", [(3, False, None), (9, False, None), (9, True, 2), (20, True, 1)]
)
def test_merge_kernel_matches_combine_and_reads_only_live_splits(splits, group, stages):
  """The merge reads a row's live splits only (more of them than its ring
  holds with 9), and leaves the rows the decode kernel finished itself (one
  split over the whole row) exactly as they were. With `group` the splits
  come 8 per copy (the last copy overlapping the one before it at 9 and 20)
  and, with one group in flight, the ring refills behind the reads."""
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
  merge = build_merge(batch=batch, num_splits=splits, heads_padded=heads, dv=512,
                      max_tokens=30 * BS, out_dtype=jnp.bfloat16, interpret=RACES,
                      finish_rows=True, group=group, **tiling)
  if group:  # the grouped merge reads the partials in its own layout
    cols = tiling["cols"]
    o_bad, lse_bad = wide_partials(o_bad, lse_bad, cols)
  out, lse_out = merge(seq_lens.astype(jnp.int32), bounds, o_bad, lse_bad, out0, lse0)
  want, want_lse = combine_splits(o, jnp.where(jnp.asarray(dead)[..., None], -jnp.inf, lse))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out[1]).view(np.uint16), np.asarray(out0[1]).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(lse_out[1]), kept_lse[1])
  rest = ~finished
  out32 = np.asarray(out, np.float32)[rest]
  want = np.asarray(want)[rest]
  err = np.linalg.norm(out32 - want) / np.linalg.norm(want)
  assert err < 5e-3, err
  np.testing.assert_allclose(np.asarray(lse_out)[rest], np.asarray(want_lse)[rest], rtol=1e-5, atol=1e-5)
  assert (np.asarray(out[2], np.float32) == 0).all() and (np.asarray(lse_out[2]) == -np.inf).all()


def test_merge_path_by_plan_shape():
  """Which merge rows of many splits take, and the grouped merge's tiling:
  the shapes measured on the H200 (merge_tiling.use_grouped's docstring)."""
  from jaxkv.kernels.mla_decode.merge_tiling import GROUP_SMEM, grouped_tiling, use_grouped

  cases = {  # (batch, head groups, splits): (grouped, cols, groups in flight)
      (1, 2, 67): (True, 8, 9),  # 1 x 128 x 128K: every group in flight
      (4, 1, 52): (True, 16, 5),  # 4 x 64 x 128K: a ring of 5 of 7 groups
      (2, 2, 52): (True, 16, 5),
      (1, 1, 133): (False, 8, 10),  # 64 CTAs: the two passes
      (8, 1, 27): (True, 8, 4),  # 512 CTAs of 8 channels, every group in flight
      (8, 2, 15): (False, 8, 2),  # 15 splits, two head groups: the per-split ring
      (1, 1, 27): (False, 8, 4),  # a grid of 64 CTAs: the per-split ring
      (4, 2, 52): (False, 32, 2),  # wide tiles: not measured, not taken
  }
  assert not use_grouped(batch=1, head_groups=2, num_splits=129)  # past GROUP_MAX_SPLITS
  for (batch, groups, splits), want in cases.items():
    cols, stages = grouped_tiling(batch=batch, head_groups=groups, num_splits=splits)
    assert (use_grouped(batch=batch, head_groups=groups, num_splits=splits), cols, stages) == want
    assert stages * 8 * 64 * cols * 4 <= GROUP_SMEM


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
  assert np.linalg.norm(out32 - want) / np.linalg.norm(want) < 5e-3
  np.testing.assert_allclose(np.asarray(lse_out), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
  assert (out32[2] == 0).all() and (np.asarray(lse_out[2]) == -np.inf).all()


def test_all_rows_empty():
  q, cache, table, lens = _problem(13, [0, 0, 0], 64)
  out, lse = _run(q, cache, table, lens, splits=3)
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
  q, cache, table, lens = _problem(21, seq_lens, heads, max_blocks=max_blocks, bs=bs)
  assert cache.shape[1] == bs
  poisoned, _ = _poison(cache, table, lens)
  clean_ref = _ref(q, cache, table, lens)
  # "select" over the poisoned cache must give the clean cache's reference.
  _assert_close(_run(q, poisoned, table, lens, splits=2), clean_ref)

  unit = min(bs, 64)
  nan_rows = np.array([s % unit != 0 for s in seq_lens])
  assert nan_rows.any() and not nan_rows.all()
  ref_out, _ = _ref(q, poisoned, table, lens, mask_mode="multiply")
  np.testing.assert_array_equal(np.isnan(np.asarray(ref_out, np.float32)).any(axis=(1, 2)), nan_rows)
  out, lse = _run(q, poisoned, table, lens, splits=2, mask_mode="multiply")
  out = np.asarray(out, np.float32)
  np.testing.assert_array_equal(np.isnan(out).any(axis=(1, 2)), nan_rows)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(clean_ref[1]), rtol=1e-3, atol=1e-3)
  good = ~nan_rows
  np.testing.assert_allclose(out[good], np.asarray(clean_ref[0], np.float32)[good], rtol=2e-2, atol=2e-2)


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
  q, cache, table, lens = _problem(37, seq_lens, 64)
  config = MLADecodeConfig(num_splits=splits, min_chunk_blocks=1, split_overhead_tiles=0)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=64, config=config, num_sms=sms)
  assert (np.diff(np.asarray(plan.bounds), axis=1) > 0).sum(axis=1).max() >= 2  # a row is cut
  poisoned, _ = _poison(cache, table, lens)
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
      _assert_close((out, lse), _ref(q, cache, table, lens))
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

  q, cache, table, lens = _problem(41, seq_lens, heads)
  config = MLADecodeConfig(num_splits=3, min_chunk_blocks=1, split_overhead_tiles=0)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=heads, config=config, num_sms=sms)
  assert (np.diff(np.asarray(plan.bounds), axis=1) > 0).sum(axis=1).max() >= 2  # a row is cut
  assert pack_rows(heads=heads, head_groups=1, num_splits=plan.num_splits) == 64 // heads
  poisoned, _ = _poison(cache, table, lens)

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
      _assert_close((out, lse), _ref(q, cache, table, lens))
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


def _call_ops(heads, seq_lens, config, num_sms=132):
  """The primitives of one `mla_decode` call's jitted body (one level in: the
  kernels are one op each; what else runs is XLA ops of its own)."""
  q, cache, table, lens = _problem(5, seq_lens, heads)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=heads, config=config, num_sms=num_sms)
  jaxpr = jax.make_jaxpr(
      lambda q, c: mla_decode(q, c, jnp.asarray(table), jnp.asarray(lens), sm_scale=SCALE,
                              plan=plan, config=config, interpret=FAST)
  )(q, jnp.asarray(cache, jnp.bfloat16))
  (call,) = [e for e in jaxpr.eqns if "jaxpr" in e.params]
  # jnp's own jitted helpers (jnp.pad) by their names.
  return {e.params["name"].lstrip("_") if e.primitive.name == "jit" else e.primitive.name
          for e in call.params["jaxpr"].eqns}


@pytest.mark.parametrize(
    "heads,seq_lens,sms,pad,cut",
    [
        (16, [3 * BS, 2 * BS], 132, False, False),  # 8 x 16 heads, unpadded
        (96, [3 * BS, 2 * BS], 132, False, False),
        (20, [3 * BS, 2 * BS], 132, True, True),  # not a multiple of 8: padded
        # More rows than parts: the kernel finishes rows in whole head groups.
        (16, [3 * BS, 2 * BS, BS, 5], 2, False, True),
    ],
)
def test_heads_below_a_head_group_need_no_pad_or_slice(heads, seq_lens, sms, pad, cut):
  """A call at a multiple of 8 heads is the kernels alone: no XLA pad of q to
  64 heads, no slice of the result (each its own launch per call: 3.5-5.4% of
  a 16-head call on the H200, kernels/mla_decode/NOTES.md), except where
  the kernel writes whole rows itself."""
  config = MLADecodeConfig(num_splits=3, min_chunk_blocks=1)
  ops = _call_ops(heads, seq_lens, config, num_sms=sms)
  assert ("pad" in ops) == pad
  assert ("slice" in ops) == cut


@pytest.mark.parametrize("heads,kv_swizzle,group", [(16, 128, False), (96, 64, True)])
def test_unpadded_heads_lower_for_hopper(heads, kv_swizzle, group):
  """The compiled decode kernel with an unpadded query (its zeroed rows and
  the last head group's shorter copies) and the merge storing the real heads
  alone (ring or grouped) lower for CUDA here."""
  from jaxkv.kernels.mla_decode import kernel, merge, merge_tiling

  batch, parts, mb = 2, 4, 8
  hp = -(-heads // 64) * 64
  splits = 40 if group else 3
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  tiling = {}
  if group:
    cols, stages = merge_tiling.grouped_tiling(batch=batch, head_groups=hp // 64, num_splits=splits)
    tiling = dict(cols=cols, stages=stages)
  decode = kernel.build_kernel(
      batch=batch, heads_padded=hp, num_parts=parts, num_splits=splits, block_size=64,
      sm_scale=SCALE, select=True, interpret=None, kv_swizzle=kv_swizzle, q_heads=heads,
      partial_cols=tiling.get("cols"),
  )
  args = (jax.ShapeDtypeStruct((batch, heads, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((16, 64, 576), jnp.bfloat16),
          i32(batch, mb), i32(batch), i32(batch + 1), i32(parts, 2), i32(parts + 1), i32(batch))
  assert "wgmma.mma_async" in jax.jit(decode).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  o, lse = jax.eval_shape(decode, *args)
  combine = merge.build_merge(
      batch=batch, num_splits=splits, heads_padded=hp, dv=512, max_tokens=mb * 64,
      out_dtype=jnp.bfloat16, interpret=None, stage_out=True, out_heads=heads, group=group,
      partial_heads=heads, **tiling)
  out, lse_out = jax.eval_shape(combine, i32(batch), i32(batch, splits + 1), o, lse)
  assert out.shape == (batch, heads, 512) and lse_out.shape == (batch, heads)
  text = jax.jit(combine).trace(i32(batch), i32(batch, splits + 1), o, lse).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_plans_count_the_devices_sms(request):
  """A GPU that reports its multiprocessors (`core_count`) sizes the split
  plan and the heuristic config; the CPU counts an H200's 132."""
  from jaxkv.kernels import _common

  assert _common.num_sms() == _common.DEFAULT_SMS == 132
  lens = jnp.full((128,), 4096, jnp.int32)
  assert mla_decode_plan(lens, num_heads=64).num_parts == 132
  request.getfixturevalue("h100_pcie")
  assert _common.num_sms() == 114 and _common.device_kind() == "nvidia_h100_pcie"
  assert mla_decode_plan(lens, num_heads=64).num_parts == 114
  assert mla_decode_plan(lens, num_heads=128).num_parts == 57
  assert heuristic_config(batch=1, num_heads=64) == heuristic_config(
      batch=1, num_heads=64, num_sms=114) != heuristic_config(batch=1, num_heads=64, num_sms=132)
