"""Capture as jit tracing, and the null-block bug it used to cause (reproduced, then fixed twice).

The step below writes each row's new latent into its slot, and also has a
"compressor" that keeps a normalised summary in a ring-buffer slot derived
from the row's block table (slot `seq_len % block_size` of the row's first
block). On the warm-up's dummy batch (all-zero tables) that component targets
block 0, and its normalisation of the all-zero dummy input is 0/0 = NaN.
Sparse MLA decode in "multiply" mode clamps every -1 index to slot 0 of block
0, so afterwards every real row with a -1 in its top-k reads NaN. The two fixes:
reset the null block after capture, and map null-block slots to -1 in the
component (`slots_from_block_table(..., skip_null_block=True)`).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import jaxkv
from jaxkv.kernels import sparse_mla_decode, sparse_mla_decode_reference, write_kv

BLOCK = 16
NUM_BLOCKS = 16
HEADS = 16
TOPK = 64
SCALE = 576**-0.5
INTERPRET = plgpu.InterpretGPUParams(detect_races=True)


def _compressor(cache, batch, *, skip_null_block):
  # A unit-RMS summary of the new latent: 0/0 = NaN on an all-zero dummy row.
  kv = batch["kv"].astype(jnp.float32)
  summary = kv / jnp.sqrt(jnp.mean(kv * kv, axis=-1, keepdims=True))
  ring = batch["seq_lens"] % BLOCK
  slots = jaxkv.slots_from_block_table(batch["block_table"], ring, BLOCK, skip_null_block=skip_null_block)
  return write_kv(cache, summary.astype(cache.dtype), slots)


def _step(cache, batch, *, skip_null_block, mask_mode, kernel):
  with jax.named_scope("test.step"):
    cache = _compressor(cache, batch, skip_null_block=skip_null_block)
    cache = write_kv(cache, batch["kv"], batch["slot_mapping"])
    decode = (
        functools.partial(sparse_mla_decode, interpret=INTERPRET) if kernel else sparse_mla_decode_reference
    )
    out, lse = decode(batch["q"], cache, batch["indices"], sm_scale=SCALE, mask_mode=mask_mode)
    return cache, {"out": out, "lse": lse}


def _cache(seed=0):
  c = jax.random.normal(jax.random.key(seed), (NUM_BLOCKS, BLOCK, 576), jnp.float32).astype(jnp.bfloat16)
  return c.at[0].set(0)  # the null block starts clean


def _batch(rows, seed=1):
  """Real rows: row b owns blocks 3b+1..3b+3; its top-k mixes valid slots and -1."""
  k = jax.random.split(jax.random.key(seed), 4)
  table = np.zeros((rows, 4), np.int32)
  seq = np.zeros(rows, np.int32)
  idx = np.full((rows, TOPK), -1, np.int32)
  rng = np.random.default_rng(seed)
  for b in range(rows):
    blocks = 1 + 3 * b + np.arange(3)  # disjoint per row; at most 5 rows
    table[b, :3] = blocks
    seq[b] = 20 + 5 * b
    slots = blocks[np.arange(seq[b]) // BLOCK] * BLOCK + np.arange(seq[b]) % BLOCK
    n = TOPK - 8 * (b % 3)  # rows 1, 2 (mod 3) have -1 padding in their top-k
    idx[b, :n] = rng.choice(slots, size=n, replace=True)
  slot_mapping = np.array([table[b, seq[b] // BLOCK] * BLOCK + seq[b] % BLOCK for b in range(rows)], np.int32)
  return {
      "q": jax.random.normal(k[0], (rows, HEADS, 576), jnp.float32).astype(jnp.bfloat16),
      "kv": jax.random.normal(k[1], (rows, 576), jnp.float32).astype(jnp.bfloat16),
      "block_table": jnp.asarray(table),
      "seq_lens": jnp.asarray(seq),
      "slot_mapping": jnp.asarray(slot_mapping),
      "indices": jnp.asarray(idx),
  }


def _capture(step, sizes=(2, 4), reset=True):
  kwargs = {} if reset else {"reset": lambda c: c}
  return jaxkv.capture(step, _cache(), sizes, _batch(1), **kwargs)


def _expected(batch, skip_null_block=True):
  """The uncaptured step on a clean cache, select mode (which no stale byte can poison)."""
  step = functools.partial(_step, skip_null_block=skip_null_block, mask_mode="select", kernel=False)
  return jax.jit(step)(_cache(), batch)[1]


def test_bug_reproduced_then_fixed_by_reset_and_by_root_cause():
  batch = _batch(4)  # exactly a captured size: no padded rows at replay
  has_pad = np.asarray((batch["indices"] < 0).any(axis=1))
  assert has_pad.any() and not has_pad.all()
  want = _expected(batch)

  buggy = functools.partial(_step, skip_null_block=False, mask_mode="multiply", kernel=False)
  captured, cache = _capture(buggy, reset=False)
  assert np.isnan(np.asarray(cache[0], np.float32)).any(), "warm-up should have dirtied block 0"
  _, out = captured(cache, batch)
  got = np.asarray(out["out"], np.float32)
  # NaN exactly in the real rows whose top-k holds a -1 (clamped to slot 0).
  np.testing.assert_array_equal(np.isnan(got).any(axis=(1, 2)), has_pad)

  # Fix 1: the explicit reset after capture (component still unfixed).
  captured, cache = _capture(buggy, reset=True)
  jaxkv.assert_null_block_clean(cache, layout="BNC")
  _, out = captured(cache, batch)
  np.testing.assert_allclose(np.asarray(out["out"], np.float32), np.asarray(want["out"], np.float32), atol=2e-2, rtol=2e-2)

  # Fix 2: the root cause (null-block slots map to -1), no reset at all.
  fixed = functools.partial(_step, skip_null_block=True, mask_mode="multiply", kernel=False)
  captured, cache = _capture(fixed, reset=False)
  jaxkv.assert_null_block_clean(cache, layout="BNC")
  _, out = captured(cache, batch)
  np.testing.assert_allclose(np.asarray(out["out"], np.float32), np.asarray(want["out"], np.float32), atol=2e-2, rtol=2e-2)


def test_select_mode_survives_the_dirty_null_block():
  batch = _batch(4)
  buggy = functools.partial(_step, skip_null_block=False, mask_mode="select", kernel=False)
  captured, cache = _capture(buggy, reset=False)
  _, out = captured(cache, batch)
  assert np.isfinite(np.asarray(out["out"], np.float32)).all()


def test_padded_replay_is_finite_writes_nothing_and_never_retraces():
  @chex.assert_max_traces(n=2)
  def traced(cache, batch):
    return _step(cache, batch, skip_null_block=True, mask_mode="multiply", kernel=False)

  captured, cache = jaxkv.capture(traced, _cache(), (2, 4), _batch(1))  # one trace per size
  assert captured.batch_sizes == (2, 4)
  jaxkv.assert_null_block_clean(cache, layout="BNC")
  for rows in (1, 3, 4, 2, 3):
    batch = _batch(rows, seed=rows)
    before = np.asarray(cache, np.float32)
    cache, out = captured(cache, batch)
    assert out["out"].shape == (rows, HEADS, 512) and out["lse"].shape == (rows, HEADS)
    assert np.isfinite(np.asarray(out["out"], np.float32)).all()
    jaxkv.assert_null_block_clean(cache, layout="BNC")
    # Only the real rows' two slots each (compressor ring slot + new token) changed.
    changed = np.argwhere((np.asarray(cache, np.float32) != before).any(axis=-1))
    allowed = set()
    for b in range(rows):
      t = np.asarray(batch["block_table"][b])
      s = int(batch["seq_lens"][b])
      allowed |= {(int(t[0]), s % BLOCK), (int(t[s // BLOCK]), s % BLOCK)}
    assert {tuple(map(int, x)) for x in changed} <= allowed
  with pytest.raises(ValueError, match="fits no captured size"):
    captured(cache, _batch(5))


def test_replay_is_bitwise_the_jitted_step():
  step = functools.partial(_step, skip_null_block=True, mask_mode="multiply", kernel=False)
  captured, cache = jaxkv.capture(step, _cache(), (4,), _batch(1))
  batch = _batch(3, seed=7)
  padded = jaxkv.pad_batch(batch, 4)
  ref_cache, ref_out = jax.jit(step)(jnp.array(cache), padded)
  new_cache, out = captured(cache, batch)
  np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(ref_cache))
  for key in ("out", "lse"):
    np.testing.assert_array_equal(np.asarray(out[key]), np.asarray(ref_out[key])[:3])


def test_capture_with_the_sparse_kernel():
  """The same lifecycle through the Pallas kernel (interpret mode): bug, then both fixes."""
  batch = _batch(2)
  has_pad = np.asarray((batch["indices"] < 0).any(axis=1))
  buggy = functools.partial(_step, skip_null_block=False, mask_mode="multiply", kernel=True)
  captured, cache = _capture(buggy, sizes=(2,), reset=False)
  _, out = captured(cache, batch)
  np.testing.assert_array_equal(np.isnan(np.asarray(out["out"], np.float32)).any(axis=(1, 2)), has_pad)
  fixed = functools.partial(_step, skip_null_block=True, mask_mode="multiply", kernel=True)
  captured, cache = _capture(fixed, sizes=(2,), reset=True)
  _, out = captured(cache, batch)
  want = _expected(batch)
  np.testing.assert_allclose(np.asarray(out["out"], np.float32), np.asarray(want["out"], np.float32), atol=2e-2, rtol=2e-2)


def test_bad_capture_arguments():
  step = functools.partial(_step, skip_null_block=True, mask_mode="select", kernel=False)
  with pytest.raises(ValueError, match="batch_sizes"):
    jaxkv.capture(step, _cache(), (), _batch(1))
  captured, cache = jaxkv.capture(step, _cache(), (2,), _batch(1))
  bad = dict(_batch(2))
  bad["q"] = bad["q"][:, :8]
  with pytest.raises(ValueError, match=r"batch\['q'\]"):
    captured(cache, bad)
  with pytest.raises(ValueError, match="keys"):
    captured(cache, {"q": bad["q"]})
