"""In-kernel timeline of dense MLA decode on the GPU: where each CTA's time goes.

Usage: python benchmarks/profile_mla_decode.py [--shape B:H:CTX] [--mode select|multiply]
       [--keep DIR] [--coarse]

Builds the kernel with Mosaic GPU's profiler on (`build_kernel(profile_dir=...)`),
runs it on random data laid out like bench_mla_decode.py, and prints per warpgroup
role the SM clock cycles each CTA spent in each named region (`kernel.REGIONS`),
the spread of the CTAs' spans, and a least-squares fit of a CTA's span on its tiles
and row segments (what one more segment costs, in tiles, is what
`MLADecodeConfig.split_overhead_tiles` should be). The profiled kernel runs ~30%
slower than the plain one (both are timed): read shares, not absolute times. Inside
a tile the consumers record its QK ("qk"), their waits for the other's maximum or P
half ("handoff_wait") and their PVs ("pv"); what a tile spends beside those is its
softmax and hand-off stores. A warpgroup records at most `PROFILE_RANGES` ranges,
five to seven per tile for the consumers, so a CTA of more than ~22 tiles is cut
short: profile a shorter context (batch 128 at 1K: ~16 tiles per CTA), or pass
--coarse (no regions inside a tile: two per tile, ~80 tiles per CTA). The trace
(Chrome / Perfetto JSON) stays under --keep.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile

import jax
import numpy as np
from jax.experimental.mosaic.gpu.profiler import measure

import bench_mla_decode as B
from jaxkv.kernels.mla_decode import kernel as K
from jaxkv.kernels.mla_decode import layout as L
from jaxkv.kernels.mla_decode.config import default_config

ROLES = {0: "consumer 0", 1: "consumer 1", 2: "producer"}


def build(q, cache, plan, select, profile_dir=None, tile_regions=True):
  # The kernel the shape's default config runs (its ring layout and query
  # registers), on the shape's default plan.
  heads = q.shape[1]
  if L.query_rows(heads) != heads:
    raise SystemExit(f"--shape: {heads} heads; the profile takes a multiple of 8 (unpadded q)")
  config = default_config(batch=q.shape[0], num_heads=heads)
  return jax.jit(K.build_kernel(
      batch=q.shape[0], heads_padded=-(-heads // L.HEAD_TILE) * L.HEAD_TILE, q_heads=heads,
      num_parts=plan.num_parts,
      num_splits=plan.num_splits, block_size=cache.shape[1], sm_scale=B.D**-0.5,
      select=select, interpret=None, profile_dir=profile_dir,
      kv_swizzle=config.kv_swizzle, q_regs=config.q_regs, tile_regions=tile_regions,
  ))


def kernel_ms(fn, args):
  _, t = measure(fn, aggregate=False, iterations=5)(*args)
  return float(np.median([sum(ms for _, ms in it) for it in t]))


def ranges(trace_path):
  """{(cta, warpgroup): [(region, begin, end), ...]} from a trace file."""
  events = json.load(open(trace_path))["traceEvents"]
  open_, out = {}, {}
  for e in events:
    key = divmod(e["tid"] - 1, L.NUM_THREADS)
    if e["ph"] == "B":
      open_.setdefault(key, []).append(e)
    else:
      b = open_[key].pop()
      out.setdefault(key, []).append((e["name"], b["ts"], e["ts"]))
  return out


def report(rr, regions=K.REGIONS, max_ranges=L.PROFILE_RANGES):
  """Prints a trace's spans, its regions' (`regions`) cycles by role and the
  span fit (`max_ranges`: the ranges a warpgroup records)."""
  ctas = sorted({c for c, _ in rr})
  n = len(ctas)
  full = sum(1 for v in rr.values() if len(v) >= max_ranges)
  if full:
    print(f"warning: {full} warpgroup traces hit {max_ranges} ranges and were cut short")
  # Within a CTA the trace's timestamps count thousands of SM clock cycles.
  span, tiles, segs, start = [], [], [], []
  for c in ctas:
    evs = [x for w in range(L.NUM_THREADS) for x in rr.get((c, w), [])]
    start.append(min(x[1] for x in evs))
    span.append(max(x[2] for x in evs) - start[-1])
    tiles.append(sum(1 for x in rr.get((c, 0), []) if x[0] == "kv_wait"))
    segs.append(sum(1 for x in rr.get((c, 0), []) if x[0] == "epilogue"))
  span, tiles, segs, start = map(np.asarray, (span, tiles, segs, start))
  # Each warpgroup's first event is stamped with the GPU's global timer (ns,
  # common to all CTAs; the trace's "ts" is in µs), its later ones with SM
  # clock cycles since that event: starts compare across CTAs, spans count
  # cycles.
  start = (start - start.min()) * 1e3
  pct = lambda x: " / ".join(f"{v:.1f}" for v in np.percentile(x, [0, 50, 90, 100]))
  print(f"{n} CTAs; span (kcycles) min/median/p90/max {pct(span)}; "
        f"start (ns after the first) {pct(start)}")
  def seg_tiles(c):
    # Consumer 0's tiles per segment, in order (a segment ends at its epilogue).
    out, k = [], 0
    for name, _, _ in sorted(rr.get((c, 0), []), key=lambda x: x[1]):
      if name == "kv_wait":
        k += 1
      elif name == "epilogue":
        out.append(k)
        k = 0
    return out

  order = np.argsort(span)
  for label, pick in (("long", order[::-1][:5]), ("median", order[n // 2 - 2:n // 2 + 3])):
    for c in pick:
      print(f"  {label} CTA {ctas[c]}: span {span[c]:.1f}k, start {start[c]:.0f} ns, "
            f"{tiles[c]} tiles, segments of {seg_tiles(ctas[c])} tiles")
  print("role        region           kcycles per CTA   count per CTA   cycles each")
  for w in range(L.NUM_THREADS):
    for region in regions:
      xs = [z - a for c in ctas for nm, a, z in rr.get((c, w), []) if nm == region]
      if xs:
        print(f"{ROLES[w]:11s} {region:16s} {sum(xs) / n:14.1f} "
              f"{len(xs) / n:15.1f} {np.mean(xs) * 1e3:13.0f}")
  live = tiles > 0
  if live.sum() > 3 and len(set(segs[live])) > 1:
    a = np.stack([np.ones(live.sum()), tiles[live], segs[live]], axis=1)
    (c0, per_tile, per_seg), *_ = np.linalg.lstsq(a, span[live], rcond=None)
    print(f"fit: span = {c0:.1f}k + {per_tile:.2f}k x tiles + {per_seg:.2f}k x segments"
          f" cycles: one segment costs {per_seg / per_tile:.1f} tiles")
    for k in sorted(set(segs[live])):
      m = live & (segs == k)
      print(f"  CTAs with {k} segments: {m.sum():3d}, mean span {span[m].mean():.1f}k, "
            f"mean tiles {tiles[m].mean():.1f}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="128:64:2048", help="batch:heads:mean ctx")
  ap.add_argument("--mode", default="select", choices=("select", "multiply"))
  ap.add_argument("--keep", default=None, help="directory that keeps the trace")
  ap.add_argument("--coarse", action="store_true",
                  help="no regions inside a tile (qk, handoff_wait, pv): CTAs of ~80 tiles fit")
  args = ap.parse_args()
  b, h, ctx = map(int, args.shape.split(":"))
  q, cache, table, lens, plan = B.shape_problem(args.shape)
  call_args = (q, cache, table, lens, plan.row_start, plan.part_rows,
               plan.part_start, plan.row_part)
  select = args.mode == "select"
  out_dir = args.keep or tempfile.mkdtemp()
  os.makedirs(out_dir, exist_ok=True)
  plain = kernel_ms(build(q, cache, plan, select), call_args)
  prof = build(q, cache, plan, select, out_dir, tile_regions=not args.coarse)
  before = set(glob.glob(os.path.join(out_dir, "*.json")))
  jax.block_until_ready(prof(*call_args))
  jax.effects_barrier()
  traces = sorted(set(glob.glob(os.path.join(out_dir, "*.json"))) - before, key=os.path.getmtime)
  profiled = kernel_ms(prof, call_args)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {b} x {h} x {ctx}, {args.mode}, "
        f"{plan.num_parts} parts x {-(-h // 64)} head groups; kernel {plain * 1e3:.1f} us, "
        f"profiled {profiled * 1e3:.1f} us; trace {traces[-1]}")
  report(ranges(traces[-1]))


if __name__ == "__main__":
  main()
