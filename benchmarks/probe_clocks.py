"""Probe: the GPU's SM clock and power while dense MLA decode runs back to back.

Usage: python benchmarks/probe_clocks.py [--shape B:H:CTX] [--seconds S]

Runs the shape's default `mla_decode` call (random data laid out as in
bench_mla_decode.py) in a loop for about S seconds while `nvidia-smi`
samples the SM and memory clocks, power and temperature every 50 ms, and
prints their percentiles over the loop, beside the idle clock before it. The
in-kernel profiler counts SM clock cycles (`profile_mla_decode.py`): this
is what a cycle is worth in time under the kernel's own load, and what the
tensor cores' peak is at that clock (4,096 bf16 FLOP per cycle per SM dense).
"""

from __future__ import annotations

import argparse
import subprocess
import time

import jax
import numpy as np

import bench_mla_decode as B
from jaxkv.kernels.mla_decode import mla_decode

FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu"


def sample():
  """nvidia-smi sampling FIELDS every 50 ms until terminated."""
  proc = subprocess.Popen(
      ["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "50"],
      stdout=subprocess.PIPE, text=True)
  return proc


def rows(text: str):
  out = []
  for line in text.splitlines():
    try:
      out.append([float(x) for x in line.split(",")])
    except ValueError:
      continue
  return np.asarray(out)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="128:64:4096", help="batch:heads:mean ctx")
  ap.add_argument("--seconds", type=float, default=3.0)
  args = ap.parse_args()
  b, h, ctx = map(int, args.shape.split(":"))
  q, cache, table, lens, plan = B.shape_problem(args.shape)
  step = jax.jit(lambda q, c, t, s, p: mla_decode(q, c, t, s, sm_scale=B.D**-0.5, plan=p))
  jax.block_until_ready(step(q, cache, table, lens, plan))
  idle = sample()
  time.sleep(0.5)
  idle.terminate()
  idle_rows = rows(idle.communicate()[0])
  proc = sample()
  time.sleep(0.2)
  t0, calls = time.perf_counter(), 0
  while time.perf_counter() - t0 < args.seconds:
    for _ in range(50):
      out = step(q, cache, table, lens, plan)
    jax.block_until_ready(out)
    calls += 50
  wall = time.perf_counter() - t0
  proc.terminate()
  busy = rows(proc.communicate()[0])
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {b} x {h} x {ctx}, "
        f"{calls} calls in {wall:.2f} s ({wall / calls * 1e6:.1f} us per call, host included)")
  names = FIELDS.split(",")
  if len(idle_rows):
    print("idle: " + ", ".join(f"{n} {v:.0f}" for n, v in zip(names, idle_rows.mean(axis=0))))
  # Drop the first and last samples (the loop's ramp and tail).
  busy = busy[2:-2] if len(busy) > 6 else busy
  for i, n in enumerate(names):
    p = np.percentile(busy[:, i], [0, 10, 50, 90, 100])
    print(f"busy {n:16s} min/p10/median/p90/max " + " / ".join(f"{v:.0f}" for v in p))
  mhz = np.median(busy[:, 0])
  print(f"at the median SM clock ({mhz:.0f} MHz): 1k cycles = {1e6 / mhz:.0f} ns, "
        f"tensor peak {4096 * 132 * mhz * 1e6 / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
  main()
