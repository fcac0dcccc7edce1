"""Dense MLA decode tests' problems: random queries, caches and block tables,
NaN poisoning, and the kernel and reference calls they compare."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode import (
    MLADecodeConfig,
    mla_decode,
    mla_decode_reference,
)

BS = 64
SCALE = 576**-0.5
RACES = plgpu.InterpretGPUParams(detect_races=True)
FAST = plgpu.InterpretGPUParams()
TUNING = pathlib.Path(__file__).parents[1] / "configs/tuning/mla_decode/nvidia_h200.json"


def problem(seed, seq_lens, heads, max_blocks=None, bs=BS):
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


def poison(cache, table, seq_lens):
  """NaN in every slot no row holds: tails, the null block, unused blocks."""
  bs = cache.shape[1]
  bad = np.full(cache.shape[:2], True)
  for b, s in enumerate(seq_lens):
    for t in range(s):
      bad[table[b, t // bs], t % bs] = False
  out = cache.copy()
  out[bad] = np.nan
  return out, bad


def run_decode(q, cache, table, seq_lens, *, splits, mask_mode="select", interpret=FAST, plan=None):
  return mla_decode(
      q, jnp.asarray(cache, jnp.bfloat16), jnp.asarray(table), jnp.asarray(seq_lens),
      sm_scale=SCALE, mask_mode=mask_mode,
      config=MLADecodeConfig(num_splits=splits, min_chunk_blocks=1),
      plan=plan, interpret=interpret,
  )


def run_reference(q, cache, table, seq_lens, mask_mode="select"):
  return mla_decode_reference(
      q, jnp.asarray(cache, jnp.bfloat16), jnp.asarray(table), jnp.asarray(seq_lens),
      sm_scale=SCALE, mask_mode=mask_mode,
  )


def assert_close(got, want):
  out, lse = got
  ref_out, ref_lse = want
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  out = np.asarray(out, np.float32)
  ref_out = np.asarray(ref_out, np.float32)
  assert np.isfinite(out).all()
  err = np.linalg.norm(out - ref_out) / max(np.linalg.norm(ref_out), 1e-6)
  assert err < 1e-2, err
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-3, atol=1e-3)


def segments(plan, seq_lens):
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


def scaled_half_spec(o):
  """`layout.scaled_half` in NumPy, per 256-channel half of `o` `[..., 512]`
  f32: (o / scale as float16, scale `[..., 2]`), scale the least power of two
  at or above the half's largest finite |o| (1 where there is none)."""
  halves = o.reshape(*o.shape[:-1], 2, 256)
  mag = np.where(np.isfinite(halves), np.abs(halves), 0).max(axis=-1)
  exp = np.ceil(np.log2(np.where(mag > 0, mag, 1.0)))
  scale = np.where(mag > 0, 2.0**exp, 1.0).astype(np.float32)
  return (halves / scale[..., None]).astype(np.float16).reshape(o.shape), scale


def unscaled_spec(o16, scale):
  """`scaled_half_spec`'s float16 values times their scales, float32: the
  partials a float16 merge reads, as float32 values."""
  halves = o16.astype(np.float32).reshape(*o16.shape[:-1], 2, 256)
  return (halves * scale[..., None]).reshape(o16.shape)


def jitted_body(fn, *args):
  """The equations of the one jitted call `fn(*args)` traces to, one level
  in: each kernel is one op (`custom_vmap_call`), each XLA op its own."""
  (call,) = [e for e in jax.make_jaxpr(fn)(*args).eqns if "jaxpr" in e.params]
  return call.params["jaxpr"].eqns


def jitted_ops(fn, *args):
  """The names of `jitted_body`'s ops; jnp's own jitted helpers (`jnp.pad`)
  by their names."""
  return {e.params["name"].lstrip("_") if e.primitive.name == "jit" else e.primitive.name
          for e in jitted_body(fn, *args)}
