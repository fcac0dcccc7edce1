"""The GPU timeline of back-to-back dense MLA decode calls, from a jax.profiler trace.

Usage: python benchmarks/trace_mla_decode.py [--shape B:H:CTX] [--calls N] [--keep DIR]

Runs N decode calls (a distinct query each, so XLA cannot fold them) in one jitted
function, three times under `jax.profiler.trace(create_perfetto_trace=True)`, and
prints every GPU kernel of the trace with its start, duration and the gap after the
previous kernel, then the device span per call against the sum of its kernels'
times. This is the timeline a model's step sees; bench_mla_decode.py reports the
kernel sums. (Wall-clock timing of such a function on the host also counts XLA's
command-buffer work between calls, which this trace shows on the host rows.)
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import tempfile

import jax

import bench_mla_decode as B
from jaxkv.kernels.mla_decode import mla_decode


def gpu_kernels(trace_path):
  """[(name, start µs, duration µs)] of the trace's GPU rows, in start order."""
  events = json.load(gzip.open(trace_path))["traceEvents"]
  gpu_pids = {
      e["pid"] for e in events
      if e.get("ph") == "M" and e.get("name") == "process_name"
      and "/device:GPU" in e["args"]["name"]
  }
  ks = [(e["name"], e["ts"], e["dur"]) for e in events if e.get("ph") == "X" and e["pid"] in gpu_pids]
  return sorted(ks, key=lambda k: k[1])


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="128:64:4096")
  ap.add_argument("--calls", type=int, default=4)
  ap.add_argument("--keep", default=None, help="directory for the trace (default: a temporary one)")
  args = ap.parse_args()
  q, cache, table, lens, plan = B.shape_problem(args.shape)
  qs = tuple(q * (1 + i / 64) for i in range(args.calls))
  g = jax.jit(lambda qs, c, t, s, p: [mla_decode(x, c, t, s, sm_scale=B.D**-0.5, plan=p)[0] for x in qs])
  jax.block_until_ready(g(qs, cache, table, lens, plan))
  out_dir = args.keep or tempfile.mkdtemp(prefix="jaxkv-trace-")
  with jax.profiler.trace(out_dir, create_perfetto_trace=True):
    for _ in range(3):
      jax.block_until_ready(g(qs, cache, table, lens, plan))
  (path,) = glob.glob(f"{out_dir}/**/perfetto_trace.json.gz", recursive=True)
  ks = gpu_kernels(path)
  print(f"{jax.devices()[0].device_kind} jax {jax.__version__}; {args.shape}, {args.calls} calls per function, 3 functions")
  print(f"{'kernel':42s} {'start us':>10s} {'dur us':>8s} {'gap us':>8s}")
  prev_end = None
  for name, ts, dur in ks:
    gap = "" if prev_end is None else f"{ts - prev_end:8.1f}"
    print(f"{name[:42]:42s} {ts:10.1f} {dur:8.1f} {gap}")
    prev_end = ts + dur
  # Span per call inside a function: first kernel's start to last kernel's end.
  per = len(ks) // 3
  spans = [(ks[i + per - 1][1] + ks[i + per - 1][2] - ks[i][1]) / args.calls for i in range(0, 3 * per, per)]
  sums = [sum(k[2] for k in ks[i:i + per]) / args.calls for i in range(0, 3 * per, per)]
  print(f"per call: span {min(spans):.1f} us, kernel sum {min(sums):.1f} us (best of 3 functions)")
  print("trace:", path)


if __name__ == "__main__":
  main()
