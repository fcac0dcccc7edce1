"""Probe: the fixed cost of a small decode call's pieces on this GPU.

Usage: python benchmarks/probe_floor.py [--interpret]

Times (CUPTI, median of 20 calls' summed kernel time; kernels per call):
- a Mosaic GPU kernel that stores one float per CTA, at 1, 32 and 132 CTAs
  and with the decode kernels' three warpgroups: the floor of any Pallas
  kernel's time on this device;
- a Mosaic GPU kernel whose CTAs each gather one 64-row tile of 576 bf16
  channels (72 KB, as sparse decode's producer does: a row of ids, then the
  rows by TMA) and store one float: the floor of a kernel that must read the
  ids before it can read the cache;
- `combine_splits` (XLA) on sparse decode's partials at batch 1-32: what the
  merge of split partials costs as XLA ops;
- one elementwise XLA op on 1 KB: the floor of any XLA kernel.

These bound what a small sparse or split-KV call can reach: the call is at
least one decode kernel and, with splits, one merge.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels._common import resolve_interpret
from jaxkv.kernels.mla_decode.combine import combine_splits

ITERS = 20
ROWS, DIM = 64, 576


def time_us(fn, *args, name: str | None = None) -> tuple[float, int]:
  """(median µs, kernels per call) of a call's kernels, or of those whose
  name holds `name`."""
  from jax.experimental.mosaic.gpu.profiler import measure

  _, times = measure(fn, aggregate=False, iterations=ITERS)(*args)
  per_iter = sorted(sum(ms for k, ms in it if name is None or name in k) for it in times)
  return per_iter[len(per_iter) // 2] * 1e3, len(times[0])


def empty_kernel(grid: int | tuple[int, ...], threads: int | None, interpret):
  """A kernel whose CTAs (`grid`: a count, or a grid of up to three axes)
  store one float each (those of a row of the first axis, the same one)."""
  grid = (grid,) if isinstance(grid, int) else tuple(grid)
  names = ("i", "j", "k")[:len(grid)]

  def body(x_ref, o_ref):
    o_ref[lax.axis_index("i")] = x_ref[0]

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((grid[0],), jnp.float32), grid=grid,
      grid_names=names, num_threads=threads, thread_name=None if threads is None else "wg",
      kernel_name="probe_empty", interpret=interpret)


def gather_kernel(ctas: int, interpret):
  """Each CTA: its 64 ids from GMEM, then its 64 rows by TMA, then one store."""

  def body(ids_ref, rows_ref, o_ref, buf, bar):
    i = lax.axis_index("i")

    @pl.loop(0, ROWS)
    def _(r):
      # A row as [3, 192] (a TMA box takes at most 256 elements per dimension).
      plgpu.copy_gmem_to_smem(rows_ref.at[pl.ds(ids_ref[i, r], 1)], buf.at[pl.ds(r, 1)], bar)

    plgpu.barrier_wait(bar)
    o_ref[i] = buf[0, 0, 0].astype(jnp.float32)

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((ctas,), jnp.float32), grid=(ctas,),
      grid_names=("i",),
      scratch_types=[plgpu.SMEM((ROWS, 3, DIM // 3), jnp.bfloat16),
                     plgpu.Barrier(num_arrivals=ROWS)],
      kernel_name="probe_gather", interpret=interpret)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--interpret", action="store_true", help="run each kernel once on the CPU")
  args = ap.parse_args(argv)
  interpret = resolve_interpret(True if args.interpret else None)
  x = jnp.ones((1,), jnp.float32)
  results = []
  for ctas, threads in [(1, None), (32, None), (132, None), (132, 3)]:
    fn = jax.jit(empty_kernel(ctas, threads, interpret))
    results.append((f"empty kernel, {ctas} CTAs, {threads or 1} warpgroup(s)", fn, (x,)))
  key = jax.random.key(0)
  rows = jax.random.normal(key, (8192 * 64, 3, DIM // 3), jnp.bfloat16)
  for ctas in (1, 32, 132):
    ids = jax.random.randint(key, (ctas, ROWS), 0, rows.shape[0], jnp.int32)
    fn = jax.jit(gather_kernel(ctas, interpret))
    results.append((f"ids then a 64-row gather, {ctas} CTAs", fn, (ids, rows)))
  for batch, splits, heads in [(1, 32, 16), (8, 16, 16), (8, 8, 64), (32, 4, 64), (32, 2, 128)]:
    o = jax.random.normal(key, (batch, splits, heads, 512), jnp.float32)
    lse = jax.random.normal(key, (batch, splits, heads), jnp.float32)
    fn = jax.jit(lambda o, l: combine_splits(o, l))
    results.append((f"XLA combine_splits {batch} x {heads} heads, {splits} splits", fn, (o, lse)))
  small = jnp.ones((256,), jnp.float32)
  results.append(("XLA elementwise op on 1 KB", jax.jit(lambda v: v * 2.0 + 1.0), (small,)))
  for name, fn, fargs in results:
    jax.block_until_ready(fn(*fargs))
    if args.interpret:
      print(f"{name}: ran")
      continue
    us, kernels = time_us(fn, *fargs)
    print(f"{name}: {us:.2f} us ({kernels} kernel(s))", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
