"""zero_blocks on one GPU: byte-exact check against the reference, then write
bandwidth against ceilings measured in the same run (a Pallas TMA fill and an
XLA fill of the same number of bytes, XLA's scatter of zeros).

Run: python benchmarks/bench_zero_blocks.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu.profiler import measure
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.zero_blocks import (
    ZeroBlocksConfig,
    zero_blocks,
    zero_blocks_reference,
)


def random_cache(key, shape, dtype):
  bits = jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")
  return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, bits), dtype)


def same_bytes(a, b):
  bits = jnp.dtype(f"uint{8 * a.dtype.itemsize}")
  return bool(jnp.all(jax.lax.bitcast_convert_type(a, bits)
                      == jax.lax.bitcast_convert_type(b, bits)))


# ---- ceilings -------------------------------------------------------------

_FILL_COLS, _FILL_ROWS, _FILL_CTAS = 256, 32, 264


def _fill_kernel(out_ref, zero_smem):
  # out_ref: [rows, 256] uint32 GMEM; zero_smem: [32, 256] uint32 SMEM
  zero_smem[...] = jnp.zeros(zero_smem.shape, zero_smem.dtype)
  plgpu.commit_smem()
  cta, n = jax.lax.axis_index("cta"), jax.lax.axis_size("cta")
  tiles = out_ref.shape[0] // _FILL_ROWS

  def step(j, c):
    t = cta + j * n

    @pl.when(t < tiles)
    def _():
      plgpu.copy_smem_to_gmem(
          zero_smem, out_ref.at[pl.ds(t * _FILL_ROWS, _FILL_ROWS)])

    return c

  jax.lax.fori_loop(0, pl.cdiv(tiles, n), step, None)
  plgpu.wait_smem_to_gmem(0)


def pallas_fill(nbytes):
  rows = nbytes // (4 * _FILL_COLS) // _FILL_ROWS * _FILL_ROWS
  return plgpu.kernel(
      _fill_kernel,
      out_type=jax.ShapeDtypeStruct((rows, _FILL_COLS), jnp.uint32),
      grid=(_FILL_CTAS,), grid_names=("cta",),
      scratch_types=[plgpu.SMEM((_FILL_ROWS, _FILL_COLS), jnp.uint32)],
      kernel_name="bench_fill",
  ), rows * 4 * _FILL_COLS


def time_ms(f, *args, iterations=10):
  _, ts = measure(f, iterations=iterations)(*args)
  return statistics.median(ts)


def loop_ms(step, cache, sets, n1=4, n2=24):
  """Per-iteration time of `step(cache, sets[i % len])` in a device loop.

  The cache is the loop carry (updated in place); the difference of two trip
  counts cancels the one copy into the loop and the launch.
  """
  @jax.jit
  def run(cache, sets, n):
    def body(i, c):
      return step(c, jax.tree.map(lambda s: s[i % s.shape[0]], sets))
    return jax.lax.fori_loop(0, n, body, cache)

  t1 = time_ms(run, cache, sets, jnp.int32(n1), iterations=3)
  t2 = time_ms(run, cache, sets, jnp.int32(n2), iterations=3)
  return (t2 - t1) / (n2 - n1)


def kernel_only_ms(step, cache, sets):
  """Median CUPTI time of the zero_blocks kernels alone (no plan fusions)."""
  @jax.jit
  def run(cache, sets):
    def body(i, c):
      return step(c, jax.tree.map(lambda s: s[i], sets))
    return jax.lax.fori_loop(0, sets[0].shape[0], body, cache)

  _, per_kernel = measure(run, aggregate=False)(cache, sets)
  ts = [t for name, t in per_kernel if "zero_blocks" in name]
  return statistics.median(ts) if ts else float("nan")


# ---- cases ----------------------------------------------------------------

def case_list(quick):
  mla = (32768, 64, 576)
  full = (61, 2048 if not quick else 512, 16, 8, 128)
  return [
      # name, layout, shape, kind, count
      ("mla 4096 blocks", "BNC", mla, "blocks", 4096),
      ("mla 8192 tails", "BNC", mla, "tails", 8192),
      ("mla 64 blocks", "BNC", mla, "blocks", 64),
      ("61L LBNHC 256 blocks", "LBNHC", full, "blocks", 256),
      ("61L LBNHC 256 tails", "LBNHC", full, "tails", 256),
  ]


def draw_sets(key, kind, count, nlb, block_size, n_sets):
  sets_ids, sets_v = [], []
  for i in range(n_sets):
    k1, k2 = jax.random.split(jax.random.fold_in(key, i))
    sets_ids.append(jax.random.permutation(k1, nlb)[:count].astype(jnp.int32))
    sets_v.append(jax.random.randint(k2, (count,), 0, block_size, jnp.int32))
  return jnp.stack(sets_ids), jnp.stack(sets_v)


def bytes_written(kind, shape, layout, ids, valid):
  per_slot = np.prod(shape) // (shape[layout.index("B")] * shape[layout.index("N")])
  per_slot *= 2  # bf16
  k = shape[layout.index("N")]
  if kind == "blocks":
    return int(ids.shape[0] * k * per_slot)
  return int(np.sum(k - np.asarray(valid)) * per_slot)


def xla_step(layout, kind):
  ax = layout.index("B")
  n_ax = layout.index("N")

  def step(c, s):
    ids, v = s
    idx = (slice(None),) * ax + (ids,)
    if kind == "blocks":
      return c.at[idx].set(0)
    old = c[idx]
    shape = [1] * old.ndim
    shape[ax], shape[n_ax] = v.shape[0], old.shape[n_ax]
    slot = jax.lax.broadcasted_iota(jnp.int32, shape, n_ax)
    mask = slot >= v.reshape([-1 if d == ax else 1 for d in range(old.ndim)])
    return c.at[idx].set(jnp.where(mask, jnp.zeros((), c.dtype), old))

  return step


def zb_step(layout, kind, config=None):
  def step(c, s):
    ids, v = s
    if kind == "blocks":
      return zero_blocks(c, ids, layout=layout, config=config)
    return zero_blocks(c, jnp.zeros((0,), jnp.int32), layout=layout,
                       tails=(ids, v), config=config)
  return step


def sweep(key):
  """Kernel-only bandwidth of config variants on the 4,096-block MLA case."""
  shape, layout = (32768, 64, 576), "BNC"
  cache = random_cache(key, shape, jnp.bfloat16)
  sets = draw_sets(key, "blocks", 4096, shape[0], 64, 8)
  nbytes = 4096 * 64 * 576 * 2
  variants = [
      ZeroBlocksConfig(),
      ZeroBlocksConfig(prefetch=1),
      ZeroBlocksConfig(prefetch=4),
      ZeroBlocksConfig(num_ctas=132),
      ZeroBlocksConfig(num_ctas=528),
      ZeroBlocksConfig(num_ctas=528, prefetch=4),
      ZeroBlocksConfig(tile_bytes=16 * 1024),
      ZeroBlocksConfig(tile_bytes=64 * 1024, item_rows=512),
      ZeroBlocksConfig(item_rows=64),
  ]
  fill, fill_bytes = pallas_fill(nbytes)
  t_fill = time_ms(fill)
  print(f"sweep: pallas fill {fill_bytes / t_fill / 1e9:.2f} TB/s", flush=True)
  for cfg in variants:
    t = kernel_only_ms(zb_step(layout, "blocks", cfg), cache, sets)
    print(f"sweep: {cfg} kern {nbytes / t / 1e9:.2f} TB/s"
          f" = {(nbytes / t) / (fill_bytes / t_fill):.2f} of fill", flush=True)


def check_small(key):
  """Byte-exact GPU check on small caches covering both kernel paths."""
  rows = []
  specs = [
      ("BNC", (64, 16, 576), jnp.bfloat16, 64),
      ("LBHNC", (3, 32, 4, 16, 64), jnp.float8_e4m3fn, 32),
      ("BLNHC", (32, 2, 16, 2, 128), jnp.float32, 64),
      ("LHBNC", (2, 4, 32, 8, 32), jnp.uint8, 32),
      ("BHCN", (32, 2, 24, 16), jnp.bfloat16, 64),  # slot axis innermost
      ("NBC", (8, 64, 8), jnp.float8_e4m3fn, 32),
  ]
  for i, (layout, shape, dt, bs) in enumerate(specs):
    k1, k2, k3 = jax.random.split(jax.random.fold_in(key, i), 3)
    cache = random_cache(k1, shape, dt)
    r = bs // shape[layout.index("N")]
    nlb = shape[layout.index("B")] // r
    perm = jax.random.permutation(k2, nlb).astype(jnp.int32)
    ids = jnp.concatenate([perm[:3], jnp.array([-1], jnp.int32)])
    tails = (perm[3:6], jax.random.randint(k3, (3,), 0, bs + 1, jnp.int32))
    ref = zero_blocks_reference(cache, ids, layout=layout, block_size=bs, tails=tails)
    f = jax.jit(functools.partial(zero_blocks, layout=layout, block_size=bs),
                donate_argnums=0)
    name = f"{layout} {shape} {jnp.dtype(dt).name} bs={bs}"
    try:
      out = f(jnp.copy(cache), ids, tails=tails)
      rows.append((name, same_bytes(out, ref)))
    except Exception as e:  # keep going: one failing layout must not hide the rest
      print(f"check {name} raised {type(e).__name__}: {str(e)[-1500:]}", flush=True)
      rows.append((name, False))
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--sweep", action="store_true", help="config variants only")
  args = ap.parse_args()
  key = jax.random.key(0)
  print("device:", jax.devices()[0].device_kind, "jax", jax.__version__)
  if args.sweep:
    sweep(key)
    return
  ok_rows = check_small(key)
  for name, ok in ok_rows:
    print(f"check {name}: {'OK' if ok else 'MISMATCH'}", flush=True)
  table = []
  for ci, (name, layout, shape, kind, count) in enumerate(case_list(args.quick)):
    try:
      table.append(run_case(key, ci, name, layout, shape, kind, count))
      print("done", table[-1], flush=True)
    except Exception as e:
      print(f"case {name} raised {type(e).__name__}: {str(e)[-1500:]}", flush=True)
      table.append((name, False) + (float("nan"),) * 8)
  print_table(table)
  if not all(ok for _, ok in ok_rows) or not all(r[1] for r in table):
    sys.exit(1)


def run_case(key, ci, name, layout, shape, kind, count):
  kc = jax.random.fold_in(key, 100 + ci)
  cache = random_cache(kc, shape, jnp.bfloat16)
  k = shape[layout.index("N")]
  nlb = shape[layout.index("B")]
  sets = draw_sets(kc, kind, count, nlb, k, 8)
  # Correctness on the benchmark shape itself, set 0.
  s0 = (sets[0][0], sets[1][0])
  ref = xla_step(layout, kind)(cache, s0)
  out = jax.jit(zb_step(layout, kind))(cache, s0)
  ok = same_bytes(out, ref)
  del ref, out
  nbytes = bytes_written(kind, shape, layout, sets[0][0], sets[1][0])
  t_zb = loop_ms(zb_step(layout, kind), cache, sets)
  t_kern = kernel_only_ms(zb_step(layout, kind), cache, sets)
  t_xla = loop_ms(xla_step(layout, kind), cache, sets, n1=2, n2=6)
  fill, fill_bytes = pallas_fill(nbytes)
  t_fill = time_ms(fill)
  xla_fill = jax.jit(lambda: jnp.full((fill_bytes // 4,), 0, jnp.uint32))
  t_xfill = time_ms(xla_fill)
  tb = lambda b, ms: b / ms / 1e9  # TB/s
  return (name, ok, nbytes / 1e6, t_zb * 1e3, t_kern * 1e3,
          tb(nbytes, t_zb), tb(nbytes, t_kern), tb(fill_bytes, t_fill),
          tb(fill_bytes, t_xfill), tb(nbytes, t_xla))


def print_table(table):
  hdr = ("case", "exact", "MB", "step_us", "kern_us", "step_TB/s", "kern_TB/s",
         "pl_fill", "xla_fill", "xla_scat", "kern/fill", "step/scat")
  print("\n" + " | ".join(hdr))
  for (name, ok, mb, us, kus, bw, kbw, fbw, xfbw, sbw) in table:
    print(f"{name} | {ok} | {mb:.1f} | {us:.1f} | {kus:.1f} | {bw:.2f} | {kbw:.2f}"
          f" | {fbw:.2f} | {xfbw:.2f} | {sbw:.3f} | {kbw / fbw:.2f} | {bw / sbw:.1f}")


if __name__ == "__main__":
  main()
