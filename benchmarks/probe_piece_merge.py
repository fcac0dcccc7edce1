"""Probe: where sparse decode's stream merge (`piece_merge`) spends its time.

Usage: python benchmarks/probe_piece_merge.py [--shapes B:H ...] [--interpret]
       ncu ... python benchmarks/probe_piece_merge.py --ncu  (no CUPTI timing)

For each shape, the plan's stream (whole rows first) and the plain layout:
the merge kernel alone on random float16 partials laid out as the decode
kernel leaves them (`[left_rows, max_pieces, heads, 512]`, each leftover
row's `row_pieces` written), merged in place into a `[batch, heads, 512]`
bf16 result, timed (CUPTI, median of 20 calls) at each `cols` (value channels
per CTA), `per_copy` (pieces per TMA copy) and `swizzle` (the SMEM tiles
swizzled or plain rows) given; each variant's result is compared with the
first's (DIFFERS where not equal). The partials are read from L2 (the same
buffers every call, 2-17 MB against 50-60 MB of L2), as after the decode
kernel, whose leftover runs end each part. Beside it, in the same run: an
empty kernel at the merge's grid (the launch and CTA floor) and an XLA
negation of the partials (a read and a write of the same bytes).
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.kernels._common import resolve_interpret
from jaxkv.kernels.mla_decode.layout import HEAD_TILE, LATENT
from jaxkv.kernels.sparse_mla_decode.piece_merge import (
    TILES_SMEM,
    build_piece_merge,
    merge_cols,
)
from jaxkv.kernels.sparse_mla_decode.plan import stream_schedule

from probe_floor import empty_kernel, time_us

TILES = 32  # top-k 2048
PARTS = 66


def inputs(stream, heads, key):
  k = jax.random.split(key, 4)
  shape = (stream.left_rows, stream.max_pieces, heads, LATENT)
  o = lax.bitcast_convert_type(jax.random.normal(k[0], shape, jnp.float16) * 0.5,
                               jnp.bfloat16)
  lse = jax.random.normal(k[1], shape[:3], jnp.float32)
  scale = jnp.exp2(jax.random.randint(k[2], (*shape[:2], 2, heads), -4, 4).astype(jnp.float32))
  out = jax.random.normal(k[3], (stream.batch, heads, LATENT), jnp.bfloat16)
  lse_out = jnp.zeros((stream.batch, heads), jnp.float32)
  return o, lse, scale, out, lse_out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", nargs="+", default=["83:128"], help="B:H")
  ap.add_argument("--cols", nargs="+", type=int, default=[64, 32, 16])
  ap.add_argument("--per-copy", nargs="+", type=int, default=[8, 1])
  ap.add_argument("--swizzle", nargs="+", type=int, choices=(0, 1), default=[1, 0],
                  help="the merge's 16-bit SMEM tiles swizzled (1) or plain rows (0)")
  ap.add_argument("--interpret", action="store_true", help="run each merge once on the CPU")
  ap.add_argument("--ncu", action="store_true",
                  help="run each variant 5 times, untimed (for ncu's own timing)")
  args = ap.parse_args(argv)
  interpret = resolve_interpret(True if args.interpret else None)
  rows = []
  for shape in args.shapes:
    batch, heads = map(int, shape.split(":"))
    for whole in (None, False):
      stream = stream_schedule(whole, None, batch=batch, num_heads=heads, tiles=TILES,
                               parts=PARTS)
      if stream.cut_rows == 0:
        continue
      layout = "whole" if stream.whole else "plain"
      counts = [stream.row_pieces(i) for i in range(stream.left_rows)]
      o, lse, scale, out, lse_out = inputs(stream, heads, jax.random.key(batch))
      read_mb = sum(c for c in counts if c > 1) * heads * LATENT * 2 / 1e6
      write_mb = stream.cut_rows * heads * LATENT * 2 / 1e6
      head_groups = heads // HEAD_TILE
      auto = merge_cols(rows=stream.left_rows, head_groups=head_groups,
                        pieces=stream.max_pieces)
      print(f"{batch} x {heads} {layout}: {stream.left_rows} leftover rows, {stream.cut_rows}"
            f" cut, pieces {counts}; {read_mb:.1f} MB read, {write_mb:.1f} MB written;"
            f" merge_cols {auto}", flush=True)
      variants = []
      for cols in args.cols:
        if stream.max_pieces * HEAD_TILE * cols * 4 > TILES_SMEM:
          continue  # the pieces' tiles would not fit in the merge's SMEM
        for per, sw in itertools.product(args.per_copy, args.swizzle):
          merge = build_piece_merge(
              rows=stream.left_rows, pieces=stream.max_pieces, heads_padded=heads,
              out_heads=heads, out_dtype=jnp.bfloat16, select=True, interpret=interpret,
              first_row=stream.first_left_row, stream=stream, cols=cols, per_copy=per,
              scaled=True, swizzle=bool(sw))
          fn = jax.jit(merge)
          grid = stream.left_rows * head_groups * (LATENT // cols)
          variants.append((f"merge cols {cols} per_copy {per} swizzle {sw} ({grid} CTAs)", fn,
                           (o, lse, scale, out, lse_out), "merge"))
      grid = (stream.left_rows, head_groups, LATENT // auto)
      variants.append((f"empty kernel, grid {grid}",
                       jax.jit(empty_kernel(grid, None, interpret)),
                       (jnp.ones((1,), jnp.float32),), None))
      variants.append(("XLA negation of the partials", jax.jit(lambda v: -v), (o,), None))
      want = None
      for name, fn, fargs, kname in variants:
        print(f"  {name} ...", flush=True)  # before its build's own output
        res = jax.block_until_ready(fn(*fargs))
        if kname == "merge":  # every variant merges alike
          got = np.asarray(res[0].astype(jnp.float32))
          if want is None:
            want = got
          ok = np.array_equal(got, want, equal_nan=True)
          name += "" if ok else " DIFFERS"
        if args.interpret:
          print(f"  {name}: ran", flush=True)
          continue
        if args.ncu:
          for _ in range(5):
            jax.block_until_ready(fn(*fargs))
          print(f"  {name}: ran 6 times", flush=True)
          continue
        us, _ = time_us(fn, *fargs, name=kname)
        rows.append((f"{batch}x{heads} {layout}", name, us))
        print(f"  {name}: {us:.2f} us", flush=True)
  if rows:
    print("\nshape        variant                                            us")
    for s, n, us in rows:
      print(f"{s:<12} {n:<50} {us:6.2f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
