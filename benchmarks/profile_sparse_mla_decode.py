"""In-kernel timeline of sparse MLA decode's stream schedule on the GPU, by layout.

Usage: python benchmarks/profile_sparse_mla_decode.py [--shape B:H] [--mode select|multiply]
       [--parts N] [--layouts plain whole] [--segments C ...] [--tile-regions] [--keep DIR]

Builds the sparse decode kernel (top-k 2048, one split, the shape's default
config) on the stream schedule of `--parts` CTAs per head group (default: the
plan's count, `plan.rows_to_cut`), once per layout of `--layouts` ("plain":
every row's tiles laid end to end, `stream_whole=False`; "whole": whole rows
first), and per row segment cost of `--segments` (`stream_segment`: the
leftover runs cut by cost, a segment at C tiles; 0: equal tiles; by
default the plan's, `plan.stream_segment_tiles`), with Mosaic GPU's
profiler on (`build_kernel(profile_dir=...)`), runs it on the benchmark's
random data, and prints per layout: the plain and the profiled kernel's
times, then per warpgroup role the SM clock cycles each CTA
spent in each named region (`kernel.REGIONS`), the spread of the CTAs' spans
and starts, and a least-squares fit of a CTA's span on its tiles and row
segments (`profile_mla_decode.report`). The profiled kernel runs slower than
the plain one: read shares, not absolute times. A warpgroup records at most
`kernel.PROFILE_RANGES` ranges: two per tile (~40 tiles per CTA: 83 x 128 on
132 SMs fits), five to seven with `--tile-regions` (~15: more parts).
The traces (Chrome / Perfetto JSON) stay under --keep.
"""

from __future__ import annotations

import argparse
import functools
import glob
import itertools
import os
import tempfile
import warnings

import jax

import profile_mla_decode as P
from check_sparse_mla_decode import SCALE, TOPK, inputs
from jaxkv.kernels.mla_decode.layout import HEAD_TILE, query_rows
from jaxkv.kernels.sparse_mla_decode import kernel as K
from jaxkv.kernels.sparse_mla_decode.config import TILE, default_config
from jaxkv.kernels.sparse_mla_decode.plan import rows_to_cut, stream_schedule

LAYOUTS = {"plain": False, "whole": True}


def build(q, indices, *, config, stream, select, profile_dir=None, tile_regions=False):
  batch, heads, _ = q.shape
  return jax.jit(K.build_kernel(
      batch=batch, heads_padded=-(-heads // HEAD_TILE) * HEAD_TILE, topk=indices.shape[1],
      num_splits=1, sm_scale=SCALE, select=select, interpret=None, out_dtype=q.dtype,
      q_regs=config.q_regs, kv_swizzle=config.kv_swizzle, stage_out=config.stage_out,
      q_heads=heads, parts=stream.parts,
      stream_whole=stream.whole, stream_segment=stream.segment_cost,
      f16_partials=config.f16_partials, profile_dir=profile_dir, tile_regions=tile_regions,
  ))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="83:128", help="batch:heads (top-k 2048)")
  ap.add_argument("--mode", default="select", choices=("select", "multiply"))
  ap.add_argument("--parts", type=int, default=0, help="0: the plan's count")
  ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
  ap.add_argument("--segments", type=int, nargs="+", default=[None],
                  help="a row segment's cost in tiles, by which the leftover runs are cut"
                  " (stream_segment; 0: equal tiles; default: the plan's): each layout"
                  " under each")
  ap.add_argument("--tile-regions", action="store_true",
                  help="regions inside a tile (qk, handoff_wait, pv): CTAs of ~15 tiles fit")
  ap.add_argument("--keep", default=None, help="directory that keeps the traces")
  args = ap.parse_args()
  batch, heads = map(int, args.shape.split(":"))
  if query_rows(heads) != heads:
    raise SystemExit(f"--shape: {heads} heads; the profile takes a multiple of 8 (unpadded q)")
  config = default_config(batch=batch, num_heads=heads, topk=TOPK)
  if config.num_splits != 1:
    raise SystemExit(f"--shape: the default config takes {config.num_splits} splits here;"
                     " the stream runs one")
  parts = args.parts or rows_to_cut(config, batch=batch, num_heads=heads, topk=TOPK).parts
  if not 2 <= parts <= batch:
    raise SystemExit(f"--parts: {parts} parts; the stream takes 2 to the batch ({batch})"
                     " (the plan streams no parts at this shape: pass --parts)")
  q, cache, idx = inputs(batch, heads, 0.0)
  rows = cache.reshape(-1, cache.shape[-1])
  select = args.mode == "select"
  root = args.keep or tempfile.mkdtemp()
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {batch} x {heads}, top-k "
        f"{TOPK}, {args.mode}, {parts} parts x {-(-heads // HEAD_TILE)} head groups")
  for name, segment in itertools.product(args.layouts, args.segments):
    stream = stream_schedule(LAYOUTS[name], segment, batch=batch, num_heads=heads,
                             tiles=TOPK // TILE, parts=parts)
    out_dir = os.path.join(root, f"{name}_s{stream.segment_cost}")
    os.makedirs(out_dir, exist_ok=True)
    call = functools.partial(build, q, idx, config=config, stream=stream, select=select)
    plain = P.kernel_ms(call(), (q, rows, idx))
    prof = call(profile_dir=out_dir, tile_regions=args.tile_regions)
    before = set(glob.glob(os.path.join(out_dir, "*.json")))
    jax.block_until_ready(prof(q, rows, idx))
    jax.effects_barrier()
    traces = sorted(set(glob.glob(os.path.join(out_dir, "*.json"))) - before,
                    key=os.path.getmtime)
    with warnings.catch_warnings():
      # The timed calls' traces would overwrite the first one's: Mosaic GPU
      # keeps the first and warns for each of the others.
      warnings.filterwarnings("ignore", message="Failed to dump profile")
      profiled = P.kernel_ms(prof, (q, rows, idx))
    print(f"\n== {name} ({stream.whole} whole rows a part), segment {stream.segment_cost}: kernel"
          f" {plain * 1e3:.1f} us, profiled {profiled * 1e3:.1f} us; trace {traces[-1]}")
    P.report(P.ranges(traces[-1]), regions=K.REGIONS, max_ranges=K.PROFILE_RANGES)


if __name__ == "__main__":
  main()
