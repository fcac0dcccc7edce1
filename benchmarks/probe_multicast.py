"""Probe: how fast a ring of KV tiles streams, by stage layout, ring depth and sharing.

Usage: python benchmarks/probe_multicast.py [--lower-only] [--tiles N ...]
                                            [--layouts sw64 sw128 plain]
                                            [--rings S[+A] ...] [--variants ...]

132 CTAs stream 64-slot tiles of random cache blocks (two latent halves and
the RoPE part, three TMA copies per tile) into a ring of two or three stages,
with no compute (`--rings`: S stages, "S+A" also prefetching into L2 the
tile A steps past each copy), three ways over the same blocks:

- `once`: one CTA per part, 132 parts (each tile read once; the gather ceiling).
- `twice`: 66 parts, two CTAs each reading the part's tiles (the grid's last
  axis, as the decode kernel's head groups at 128 heads): every tile
  delivered twice, the second time from L2.
- `multicast`: 66 parts, a cluster of two CTAs per part; each CTA issues half
  of every copy, multicast to both (`collective_axes`), and a stage is
  refilled once both CTAs released it (a cluster barrier): every tile read
  from L2 once, delivered twice.

Layouts of the stage in SMEM: `sw64` (32-column tiles under the 64-byte
swizzle: 64-byte TMA rows, the decode kernels' `bf16_tile()`), `sw128`
(64-column tiles, 128-byte swizzle: `bf16_tile(128)`, `kv_swizzle=128`),
`plain` (row-major, as the benchmarks' gather ceiling). Each variant checks
the last tile it holds against the cache. Prints µs per call and TB/s
delivered into SMEM, per variant, layout and ring depth, from CUPTI (median of
five).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu.profiler import measure
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode import layout as L

BS, D, HALF, ROPE = 64, 576, 256, 64


LAYOUTS = {
    # the decode kernels' stage layout: 32-column tiles, 64-byte swizzle
    "sw64": L.bf16_tile(),
    "sw128": L.bf16_tile(128),
    "plain": (),  # row-major, as the benchmarks' gather ceiling
}


def build(variant: str, parts: int, n: int, stages: int, layout: str = "sw64", ahead: int = 0):
  pair = variant != "once"
  mc = variant == "multicast"
  bf16 = LAYOUTS[layout]

  def body(cache_ref, table_ref, o_ref, lat, rope, bar, *free):
    p = lax.axis_index("p")
    who = lax.axis_index("c") if mc else (lax.axis_index("g") if pair else 0)
    coll = dict(collective_axes="c") if mc else {}

    def issue(step, slot):
      blk = table_ref[p, step]
      for h in range(2):
        plgpu.copy_gmem_to_smem(cache_ref.at[blk, :, pl.ds(HALF * h, HALF)], lat.at[slot, h], bar.at[slot], **coll)
      plgpu.copy_gmem_to_smem(cache_ref.at[blk, :, pl.ds(2 * HALF, ROPE)], rope.at[slot], bar.at[slot], **coll)

    def prefetch(step):
      blk = table_ref[p, step]
      for c0, width in ((0, HALF), (HALF, HALF), (2 * HALF, ROPE)):
        plgpu.async_prefetch(cache_ref.at[blk, :, pl.ds(c0, width)])

    for i in range(stages):
      issue(i, i)
    for i in range(stages, stages + ahead):
      pl.when(i < n)(lambda i=i: prefetch(i))

    @pl.loop(0, n)
    def _(step):
      slot = lax.rem(step, stages)
      plgpu.barrier_wait(bar.at[slot])
      if mc:
        plgpu.barrier_arrive(free[0].at[slot])

      @pl.when(step + stages < n)
      def _():
        if mc:
          plgpu.barrier_wait(free[0].at[slot])
        issue(step + stages, slot)
        if ahead:
          pl.when(step + stages + ahead < n)(lambda: prefetch(step + stages + ahead))

    if mc:  # no peer may arrive here once this CTA has exited
      for i in range(stages):
        plgpu.barrier_wait(free[0].at[(n - stages + i) % stages])

    plgpu.copy_smem_to_gmem(rope.at[0], o_ref.at[p, who])
    plgpu.wait_smem_to_gmem(0)

  scratch = [
      plgpu.SMEM((stages, 2, BS, HALF), jnp.bfloat16, transforms=bf16),
      plgpu.SMEM((stages, BS, ROPE), jnp.bfloat16, transforms=bf16),
      plgpu.Barrier(num_arrivals=3, num_barriers=stages),
  ]
  if mc:
    scratch.append(plgpu.ClusterBarrier(collective_axes=("c",), num_arrivals=1, num_barriers=stages))
  kw = dict(grid=(parts,), grid_names=("p",))
  if mc:
    kw.update(cluster=(2,), cluster_names=("c",))
  elif pair:
    kw.update(grid=(parts, 2), grid_names=("p", "g"))
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((parts, 2, BS, ROPE), jnp.bfloat16),
      scratch_types=scratch, kernel_name=f"probe_{variant}", **kw)


def parse_ring(spec: str):
  """"S" or "S+A": S stages, each copy followed by an L2 prefetch of the tile
  A steps past it (0 by default)."""
  stages, _, ahead = spec.partition("+")
  return int(stages), int(ahead or 0)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--lower-only", action="store_true")
  ap.add_argument("--tiles", type=int, nargs="+", default=[32, 64])
  ap.add_argument("--layouts", nargs="+", default=["sw64"], choices=sorted(LAYOUTS))
  ap.add_argument("--rings", nargs="+", default=["2", "3"],
                  help='stages per ring, "S" or "S+A" (A: tiles prefetched into L2 ahead)')
  ap.add_argument("--variants", nargs="+", default=["once", "twice", "multicast"],
                  choices=["once", "twice", "multicast"])
  args = ap.parse_args()
  rows = []
  for per in args.tiles:  # tiles per CTA in `once`
    total = 132 * per
    num_blocks = total + 1
    rng = np.random.default_rng(per)
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    cache = jax.random.normal(jax.random.key(per), (num_blocks, BS, D), jnp.bfloat16)
    for variant in args.variants:
      parts = 132 if variant == "once" else 66
      n = total // parts
      table = jnp.asarray(ids.reshape(parts, n))
      for ring, layout in [(r, lay) for lay in args.layouts for r in args.rings]:
        stages, ahead = parse_ring(ring)
        f = jax.jit(build(variant, parts, n, stages, layout, ahead))
        if args.lower_only:
          f.trace(cache, table).lower(lowering_platforms=("cuda",))
          print("lowered", variant, layout, ring)
          continue
        out = f(cache, table)
        # Stage 0 holds the last tile of step % stages == 0, in every CTA.
        want = cache[table[:, (n - 1) // stages * stages], :, 2 * HALF:]
        ok = all(bool((out[:, w] == want).all()) for w in ((0,) if variant == "once" else (0, 1)))
        _, t = measure(f, aggregate=False, iterations=5)(cache, table)
        ms = float(np.median([sum(x for _, x in it) for it in t]))
        delivered = total * BS * D * 2 * (1 if variant == "once" else 2)
        rows.append((per, f"{variant}/{layout}", ring, ms * 1e3, delivered / (ms * 1e-3) / 1e12, ok))
  if rows:
    print(f"{'tiles':>5} {'variant':>16} {'ring':>6} {'us':>8} {'TB/s delivered':>15} ok")
    for r in rows:
      print(f"{r[0]:5d} {r[1]:>16} {r[2]:>6} {r[3]:8.1f} {r[4]:15.2f} {r[5]}")


if __name__ == "__main__":
  main()
