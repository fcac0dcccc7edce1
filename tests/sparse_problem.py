"""Sparse MLA decode tests' problems: random queries, caches and top-k ids
(-1 padding, duplicates, dead rows), NaN poisoning of the unselected slots,
and the kernel call and the comparison they make."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.sparse_mla_decode import (
    SparseMLADecodeConfig,
    sparse_mla_decode,
)

INTERPRET = plgpu.InterpretGPUParams(detect_races=True)
# Without the race detector (~40% faster): for tests whose subject is the values,
# on kernel paths that the race-checked tests also run.
FAST = plgpu.InterpretGPUParams()
NUM_BLOCKS, BLOCK_SIZE = 4, 16
SCALE = 576**-0.5
TUNING = pathlib.Path(__file__).parents[1] / "configs/tuning/sparse_mla_decode/nvidia_h200.json"


def inputs(seed, batch, heads, topk, *, invalid=0.3, dup=False, dead_rows=()):
  kq, kc, ki, km = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (batch, heads, 576), jnp.float32).astype(jnp.bfloat16)
  cache = jax.random.normal(kc, (NUM_BLOCKS, BLOCK_SIZE, 576), jnp.float32)
  cache = cache.astype(jnp.bfloat16)
  # Slot 0 (the null block) is never a valid index here.
  idx = jax.random.randint(ki, (batch, topk), 1, NUM_BLOCKS * BLOCK_SIZE, jnp.int32)
  if dup:
    idx = idx.at[:, 1::2].set(idx[:, 0::2])
  idx = jnp.where(jax.random.uniform(km, (batch, topk)) < invalid, -1, idx)
  for r in dead_rows:
    idx = idx.at[r].set(-1)
  return q, cache, idx


def poison_unselected(cache, idx):
  """The cache with NaN in slot 0 (the null block) and in every slot no index selects."""
  used = np.zeros(NUM_BLOCKS * BLOCK_SIZE, bool)
  used[np.asarray(idx)[np.asarray(idx) >= 0]] = True
  used[0] = False
  rows = cache.reshape(-1, 576)
  return jnp.where(jnp.asarray(used)[:, None], rows, jnp.nan).reshape(cache.shape)


def run_decode(q, cache, idx, mode, splits=1, interpret=INTERPRET, q_regs=0, stage_out=True,
         cluster_merge=None, combine="kernel", f16_partials=True):
  return sparse_mla_decode(
      q, cache, idx, sm_scale=SCALE, mask_mode=mode, interpret=interpret,
      config=SparseMLADecodeConfig(num_splits=splits, q_regs=q_regs, stage_out=stage_out,
                                   cluster_merge=cluster_merge, combine=combine,
                                   f16_partials=f16_partials),
  )


def check(out, lse, ref_out, ref_lse):
  out = np.asarray(out, np.float32)
  ref_out = np.asarray(ref_out, np.float32)
  assert np.isfinite(out).all()
  err = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
  assert err < 1e-2, err
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-4)
