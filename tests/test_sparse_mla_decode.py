"""sparse_mla_decode against its jnp reference, in the Mosaic GPU interpreter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels.mla_decode import MLADecodeConfig
from jaxkv.kernels.sparse_mla_decode import (
    SparseMLADecodeConfig,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)
from jaxkv.kernels.sparse_mla_decode import wrapper as sparse_wrapper

from mla_problem import jitted_ops
from sparse_problem import (
    BLOCK_SIZE,
    FAST,
    INTERPRET,
    NUM_BLOCKS,
    SCALE,
    check,
    inputs,
    poison_unselected,
    run_decode,
)

@pytest.mark.parametrize(
    "heads, mode, splits, dup, q_regs",
    [
        (16, "select", 1, False, 0),
        (64, "multiply", 2, True, 0),
        (128, "select", 1, True, 0),
        # The query's first channels fed to the QK from apart (registers when
        # compiled; the same SMEM slice here).
        (128, "multiply", 1, False, 128),
        (16, "select", 2, True, 64),
    ],
)
def test_matches_reference(heads, mode, splits, dup, q_regs):
  q, cache, idx = inputs(
      heads, 2, heads, 64 * splits, dup=dup, dead_rows=(1,) if heads == 16 else ()
  )
  if heads == 16:  # float32 queries: one split writes the result in their dtype
    q = q.astype(jnp.float32)
  out, lse = run_decode(q, cache, idx, mode, splits, q_regs=q_regs)
  assert out.shape == (2, heads, 512) and out.dtype == q.dtype
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  if heads == 16:  # the all-invalid row
    assert (np.asarray(out[1], np.float32) == 0).all()
    assert (np.asarray(lse[1]) == -np.inf).all()
  live = np.isfinite(np.asarray(ref_lse)).all(axis=1)
  check(out[live], lse[live], ref_out[live], ref_lse[live])


@pytest.mark.parametrize(
    "heads, mode, schedule",
    [
        # One split: the result staged through the last tile's stage (race
        # detector on).
        (128, "select", dict(num_splits=1)),
        # Two splits' float16 partials through the stages, the merge kernel;
        # an unpadded partial second head group.
        (96, "multiply", dict(num_splits=2)),
        # The stream: a query per row segment, rows cut between parts.
        (16, "select", dict(parts=3)),
    ],
)
def test_the_64_byte_swizzle_matches_reference_and_stays_nan_safe(heads, mode, schedule):
  """`kv_swizzle=64` (the rest of the suite runs the default, 128): the query
  and the rings in 32-column tiles, each consumer's PV over its own half of
  a tile's P first, then the other's. The reference's result (the dead last
  row 0 and -inf); with NaN in slot 0 and in every slot no index selects,
  "select" bit-equal to clean memory and "multiply" NaN in exactly the rows
  where the reference is (those holding a -1; row 0 holds none)."""
  batch = 5 if "parts" in schedule else 3
  q, cache, idx = inputs(71 + heads, batch, heads, 128, invalid=0.2, dead_rows=(batch - 1,))
  idx = idx.at[0].set(jnp.where(idx[0] < 0, 1, idx[0]))
  config = SparseMLADecodeConfig(kv_swizzle=64, **schedule)

  def run(c, m, interpret=FAST):
    return sparse_mla_decode(q, c, idx, sm_scale=SCALE, mask_mode=m, interpret=interpret,
                             config=config)

  out, lse = run(cache, mode, interpret=INTERPRET if heads == 128 else FAST)
  assert out.shape == (batch, heads, 512) and lse.shape == (batch, heads)
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  check(out[:-1], lse[:-1], ref_out[:-1], ref_lse[:-1])
  assert (np.asarray(out[-1], np.float32) == 0).all() and (np.asarray(lse[-1]) == -np.inf).all()
  poisoned = poison_unselected(cache, idx)
  clean = (out, lse) if mode == "select" else run(cache, "select")
  for a, b in zip(run(poisoned, "select"), clean):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  ref_nan, _ = sparse_mla_decode_reference(q, poisoned, idx, sm_scale=SCALE, mask_mode="multiply")
  want = np.isnan(np.asarray(ref_nan, np.float32)).any(axis=(1, 2))
  assert not want[0] and want[1:-1].all() and not want[-1]
  mul_out, _ = run(poisoned, "multiply")
  np.testing.assert_array_equal(np.isnan(np.asarray(mul_out, np.float32)).any(axis=(1, 2)), want)


@pytest.mark.parametrize("mode", ["select", "multiply"])
def test_long_index_list(mode):
  """Eight tiles of indices in one split: the producer's index ring wraps around
  (and in "select" the query's first 192 channels are fed from apart, the same
  slice for every tile)."""
  q, cache, idx = inputs(11, 1, 16, 256, invalid=0.2 if mode == "select" else 0.0)
  out, lse = run_decode(q, cache, idx, mode, q_regs=192 if mode == "select" else 0)
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize(
    "mode, topk, heads",
    [("select", 128, 128), ("multiply", 64, 64), ("multiply", 64, 8), ("select", 128, 96)],
)
def test_result_staged_in_smem_matches_direct_stores(mode, topk, heads):
  """`stage_out`: the result goes out by TMA from the last tile's stage (stage 1
  at two tiles, 0 at one): bit for bit the registers' direct stores. At 8
  and 96 heads the query goes in unpadded and the staged stores write the
  real heads alone (the direct stores a padded result, sliced in XLA)."""
  q, cache, idx = inputs(31, 3, heads, topk, dead_rows=(2,))
  out, lse = run_decode(q, cache, idx, mode)
  assert out.shape == (3, heads, 512) and lse.shape == (3, heads)
  direct_out, direct_lse = run_decode(q, cache, idx, mode, interpret=FAST, stage_out=False)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(direct_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(direct_lse))
  assert (np.asarray(out[2], np.float32) == 0).all()
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  check(out[:2], lse[:2], ref_out[:2], ref_lse[:2])


def test_nan_poisoning():
  """NaN in slot 0 and in every slot no row indexes (values: no race detector)."""
  q, cache, idx = inputs(7, 5, 16, 128, invalid=0.0, dead_rows=(3,))
  # Rows 1, 2 and 4 hold a -1, row 0 none; row 4's second split (of two) is all -1.
  idx = idx.at[1, 5].set(-1).at[2, ::3].set(-1).at[4, 64:].set(-1)
  live = np.asarray([0, 1, 2, 4])
  poisoned = poison_unselected(cache, idx)
  clean_out, clean_lse = run_decode(q, cache, idx, "select", interpret=FAST)
  out, lse = run_decode(q, poisoned, idx, "select", interpret=FAST)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clean_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean_lse))
  # The same with two splits merged by the kernel's clusters.
  merged = [run_decode(q, c, idx, "select", splits=2, interpret=FAST, cluster_merge=True)
            for c in (cache, poisoned)]
  for a, b in zip(*merged):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE)
  check(out[live], lse[live], ref_out[live], ref_lse[live])

  # "multiply" gives NaN exactly where the reference (the production bug) does,
  # with the rows' -1s in one split, both, or a split of -1s alone; two splits
  # merged by the merge kernel, by XLA's combine, or by the kernel's clusters.
  ref_nan, _ = sparse_mla_decode_reference(q, poisoned, idx, sm_scale=SCALE, mask_mode="multiply")
  want = np.isnan(np.asarray(ref_nan, np.float32)).any(axis=(1, 2))
  np.testing.assert_array_equal(want, [False, True, True, False, True])
  for splits, cluster, combine in ((1, None, "kernel"), (2, False, "kernel"), (2, False, "xla"),
                                   (2, True, "kernel")):
    out, lse = run_decode(q, poisoned, idx, "multiply", splits=splits, interpret=FAST,
                    cluster_merge=cluster, combine=combine)
    nan_rows = np.isnan(np.asarray(out, np.float32)).any(axis=(1, 2))
    np.testing.assert_array_equal(nan_rows, want)
    assert np.isfinite(np.asarray(out[0], np.float32)).all()
    assert (np.asarray(out[3], np.float32) == 0).all()  # no valid index at all

  zeroed = poisoned.at[0, 0].set(0)
  out, lse = run_decode(q, zeroed, idx, "multiply", interpret=FAST)
  ref_out, ref_lse = sparse_mla_decode_reference(q, zeroed, idx, sm_scale=SCALE, mask_mode="multiply")
  check(out[live], lse[live], ref_out[live], ref_lse[live])


@pytest.mark.parametrize("mode, splits", [("select", 1), ("multiply", 2)])
def test_ids_outside_the_cache_are_invalid(mode, splits):
  """An id past the cache's last slot, or negative other than -1, is invalid
  exactly as -1 is: masked, never clamped onto the last slot (NaN here, so a
  clamp would show) as a valid key."""
  num_slots = NUM_BLOCKS * BLOCK_SIZE
  q, cache, idx = inputs(41, 3, 16, 128, invalid=0.2)
  idx = jnp.where(idx == num_slots - 1, 1, idx)  # the last slot is never valid here
  ks, kp = jax.random.split(jax.random.key(42))
  outside = jnp.asarray([num_slots, num_slots + 5, 2**31 - 1, -2, -(2**31)], jnp.int32)
  pick = jax.random.randint(ks, idx.shape, 0, outside.shape[0])
  odd = jnp.where(jax.random.uniform(kp, idx.shape) < 0.25, outside[pick], idx)
  odd = odd.at[2].set(jnp.where(jnp.arange(128) % 2 == 0, num_slots, -1))  # nothing valid
  as_minus_one = jnp.where((odd >= 0) & (odd < num_slots), odd, -1)
  assert (np.asarray(odd) != np.asarray(as_minus_one)).sum() > 40
  rows = cache.reshape(-1, 576)
  poisoned = rows.at[num_slots - 1].set(jnp.nan).reshape(cache.shape)

  out, lse = run_decode(q, poisoned, odd, mode, splits=splits, interpret=FAST)
  want_out, want_lse = run_decode(q, poisoned, as_minus_one, mode, splits=splits, interpret=FAST)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
  assert (np.asarray(out[2], np.float32) == 0).all() and (np.asarray(lse[2]) == -np.inf).all()
  ref_out, ref_lse = sparse_mla_decode_reference(q, poisoned, odd, sm_scale=SCALE, mask_mode=mode)
  check(out[:2], lse[:2], ref_out[:2], ref_lse[:2])


def test_inside_jit_with_traced_indices():
  q, cache, idx = inputs(3, 1, 16, 128)
  f = jax.jit(lambda q, c, i: run_decode(q, c, i, "select", 2))
  out, lse = f(q, cache, idx)
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE)
  check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize(
    "change, name",
    [
        (lambda q, c, i: (q[..., :512], c, i), "q.shape"),
        (lambda q, c, i: (q, c.astype(jnp.float32), i), "cache.shape"),
        (lambda q, c, i: (q, c, i[:, :32]), "indices.shape"),
        (lambda q, c, i: (q, c, i.astype(jnp.int16)), "indices.shape"),
        (lambda q, c, i: (q, c, i[:1]), "indices.shape"),
        (lambda q, c, i: (jnp.zeros((2, 129, 576), jnp.bfloat16), c, i), "q.shape"),
    ],
)
def test_bad_inputs(change, name):
  q, cache, idx = inputs(0, 2, 16, 64)
  with pytest.raises(ValueError, match=name.replace(".", r"\.")):
    sparse_mla_decode(*change(q, cache, idx), sm_scale=SCALE)


def test_a_step_without_rows_returns_empty_results():
  """Batch 0: empty results of the right shapes and dtypes, nothing launched;
  the inputs still validated."""
  _, cache, _ = inputs(0, 1, 16, 64)
  for dtype in (jnp.bfloat16, jnp.float32):
    out, lse = sparse_mla_decode(jnp.zeros((0, 16, 576), dtype), cache,
                                 jnp.zeros((0, 128), jnp.int32), sm_scale=SCALE)
    assert out.shape == (0, 16, 512) and out.dtype == dtype
    assert lse.shape == (0, 16) and lse.dtype == jnp.float32
  with pytest.raises(ValueError, match=r"indices\.shape"):
    sparse_mla_decode(jnp.zeros((0, 16, 576), jnp.bfloat16), cache,
                      jnp.zeros((0, 100), jnp.int32), sm_scale=SCALE)


@pytest.mark.parametrize(
    "kwargs, name",
    [({"dv": 256}, "dv"), ({"mask_mode": "zero"}, "mask_mode"),
     ({"config": SparseMLADecodeConfig(num_splits=4)}, "num_splits"),
     ({"sm_scale": -1.0}, "sm_scale"), ({"sm_scale": 0.0}, "sm_scale"),
     ({"sm_scale": float("nan")}, "sm_scale"), ({"sm_scale": float("inf")}, "sm_scale")],
)
def test_bad_options(kwargs, name):
  q, cache, idx = inputs(0, 2, 16, 64)
  with pytest.raises(ValueError, match=name):
    sparse_mla_decode(q, cache, idx, **{"sm_scale": SCALE, **kwargs})


def test_a_config_of_another_kind_is_refused():
  """(The suite's jaxtyping checks refuse it at the signature first; the
  wrapper's own check, reached here, is what a caller without them gets.)"""
  q, cache, idx = inputs(0, 2, 16, 64)
  with pytest.raises(ValueError, match="config must be a SparseMLADecodeConfig"):
    sparse_wrapper._validate(q, cache, idx, SCALE, 512, "select", MLADecodeConfig())


@pytest.mark.parametrize("mode", ["select", "multiply"])
def test_compiled_xla_implementation(mode):
  """A compiled call (interpret=False) runs config.implementation: here "xla"."""
  assert SparseMLADecodeConfig().implementation == "pallas"
  q, cache, idx = inputs(5, 3, 16, 64, dead_rows=(2,))
  poisoned = cache.at[0, 0].set(jnp.nan)
  config = SparseMLADecodeConfig(implementation="xla")
  out, lse = sparse_mla_decode(
      q, poisoned, idx, sm_scale=SCALE, mask_mode=mode, interpret=False, config=config
  )
  ref_out, ref_lse = sparse_mla_decode_reference(q, poisoned, idx, sm_scale=SCALE, mask_mode=mode)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))
  has_pad = np.asarray((idx < 0).any(axis=1) & (idx >= 0).any(axis=1))
  nan_rows = np.isnan(np.asarray(out, np.float32)).any(axis=(1, 2))
  np.testing.assert_array_equal(nan_rows, has_pad if mode == "multiply" else np.zeros_like(has_pad))


def test_interpreter_without_enough_cpu_threads_fails_fast(monkeypatch):
  """As for dense decode: raise where the three warpgroups cannot run at once."""
  import importlib

  common = importlib.import_module("jaxkv.kernels._common")
  monkeypatch.setattr(common, "cpu_parallelism", lambda: 2)
  q, cache, idx = inputs(0, 1, 16, 64)
  with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
    sparse_mla_decode(q, cache, idx, sm_scale=SCALE, interpret=INTERPRET)
  # A cluster of 4 CTAs' 12 warpgroups run at once.
  monkeypatch.setattr(common, "cpu_parallelism", lambda: 8)
  q, cache, idx = inputs(0, 1, 16, 256)
  with pytest.raises(ValueError, match="runs 12 warpgroups"):
    sparse_mla_decode(q, cache, idx, sm_scale=SCALE, interpret=INTERPRET,
                      config=SparseMLADecodeConfig(num_splits=4, cluster_merge=True))


@pytest.mark.parametrize(
    "heads, stage_out, pad, cut, splits",
    [(16, True, False, False, 1), (96, True, False, False, 1), (16, False, False, True, 1),
     (20, True, True, True, 1), (16, True, False, False, 2), (40, False, False, True, 2)],
)
def test_heads_below_a_head_group_need_no_pad_or_slice(heads, stage_out, pad, cut, splits):
  """One split, or splits merged in clusters, with a staged result at a
  multiple of 8 heads is the kernel alone: no XLA pad of q, no slice of the
  result; the direct stores write whole head groups (sliced), and other
  head counts are padded."""
  q, cache, idx = inputs(3, 2, heads, 64 * splits)
  config = SparseMLADecodeConfig(num_splits=splits, stage_out=stage_out,
                                 cluster_merge=True if splits > 1 else None)
  ops = jitted_ops(lambda q: sparse_mla_decode(
      q, cache, idx, sm_scale=SCALE, interpret=FAST, config=config), q)
  assert ("pad" in ops) == pad
  assert ("slice" in ops) == cut
