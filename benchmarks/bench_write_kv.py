"""write_kv on the device: XLA scatter vs the Pallas kernel, against a same-run copy ceiling.

Checks both backends bit-exactly against the reference first, then times a
jitted loop of donated writes (the cache is the loop carry, slot sets rotate)
with the wall clock around one synchronised call (100 writes) and prints bytes moved (kv read + cache rows written) per second
against an XLA copy of a 2 GB buffer measured in the same run.

  python benchmarks/bench_write_kv.py [--small] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.kernels.write_kv import WriteKVConfig, write_kv, write_kv_reference
from jaxkv.kernels.write_kv.reference import kv_shape, num_slots

ITERS = 100
ROTATE = 8


def _measure(f, *args):
  """Wall-clock milliseconds of one call, synchronised.

  Every timed function donates its first argument and returns its successor;
  callers put many writes into one jitted loop so that one dispatch (~34 us
  here) is spread over them. (CUPTI's `measure` runs `f` twice per call,
  which a donated argument does not survive.)
  """
  jax.block_until_ready(args)
  t = time.perf_counter()
  out = jax.block_until_ready(f(*args))
  return out, (time.perf_counter() - t) * 1e3


def _random(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _slot_sets(rng, total, tokens, sets, pad_frac=0.03):
  out = np.empty((sets, tokens), np.int32)
  for i in range(sets):
    out[i] = rng.choice(total, tokens, replace=False)
    out[i][rng.random(tokens) < pad_frac] = -1
  return out


def check(layouts_shapes, dtypes, variants, rng):
  """Bit-exact comparison with the reference on fresh random data."""
  rows = []
  for layout, shape in layouts_shapes:
    for dtype in dtypes:
      tokens = 96
      cache = _random(jax.random.key(rng.integers(1 << 30)), shape, dtype)
      kv = _random(jax.random.key(rng.integers(1 << 30)), (tokens, *kv_shape(shape, layout)), dtype)
      slots = jnp.asarray(_slot_sets(rng, num_slots(shape, layout), tokens, 1, 0.2)[0])
      ref = np.asarray(write_kv_reference(cache, kv, slots, layout=layout))
      for name, kw in variants:
        try:
          out = np.asarray(write_kv(jnp.copy(cache), kv, slots, layout=layout, **kw))
          ok = bool((out.view(np.uint8) == ref.view(np.uint8)).all())
        except Exception as e:  # noqa: BLE001 - report and go on
          ok = f"ERROR {type(e).__name__}: {str(e)[:300]}"
        rows.append((layout, jnp.dtype(dtype).name, name, ok))
        print("check", rows[-1], flush=True)
  return rows


def copy_ceiling(nbytes):
  x = _random(jax.random.key(7), (nbytes // 2,), jnp.bfloat16)
  one = jnp.ones((), jnp.bfloat16)

  def copy(x, one):
    return lax.fori_loop(0, ITERS, lambda i, x: x * one, x)

  f = jax.jit(copy, donate_argnums=0)
  x, _ = _measure(f, x, one)
  times = []
  for _ in range(3):
    x, t = _measure(f, x, one)
    times.append(t / ITERS)
  return 2 * x.size * 2 / (np.median(times) * 1e-3)


def time_case(label, layout, shape, tokens, variants, rng, log):
  dtype = jnp.bfloat16
  cache = _random(jax.random.key(1), shape, dtype)
  kv = _random(jax.random.key(2), (tokens, *kv_shape(shape, layout)), dtype)
  slots = jnp.asarray(_slot_sets(rng, num_slots(shape, layout), tokens, ROTATE))
  valid = int((np.asarray(slots) >= 0).sum()) / ROTATE
  row_bytes = int(np.prod(kv.shape[1:])) * 2
  moved = 2 * valid * row_bytes
  results = []
  for name, kw in variants:

    def loop(cache, kv, slots, kw=kw):
      def body(i, c):
        return write_kv(c, kv, slots[i % ROTATE], layout=layout, **kw)

      return lax.fori_loop(0, ITERS, body, cache)

    def once(cache, kv, slots, kw=kw):
      return write_kv(cache, kv, slots[0], layout=layout, **kw)

    try:
      f = jax.jit(loop, donate_argnums=0)
      g = jax.jit(once, donate_argnums=0)
      cache, single_ms = _measure(g, cache, kv, slots)
      cache, _ = _measure(f, cache, kv, slots)
      ms = []
      for _ in range(3):
        cache, t = _measure(f, cache, kv, slots)
        ms.append(t / ITERS)
      us = float(np.median(ms)) * 1e3
      results.append((label, name, us, moved / (us * 1e-6)))
      log.write(json.dumps({"case": label, "variant": name, "us": us, "loops_ms": ms,
                            "single_call_ms": single_ms}) + "\n")
    except Exception as e:  # noqa: BLE001 - report and go on
      results.append((label, name, float("nan"), float("nan")))
      log.write(json.dumps({"case": label, "variant": name, "error": repr(e)[:2000]}) + "\n")
      cache = _random(jax.random.key(1), shape, dtype)
    print("time", results[-1], flush=True)
  return results


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--small", action="store_true", help="tiny shapes (CPU dry run)")
  parser.add_argument("--no-check", action="store_true", help="timing only")
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  args = parser.parse_args()
  global ITERS
  ITERS = 1 if args.small else ITERS
  rng = np.random.default_rng(0)
  variants = [
      ("xla", dict(backend="xla")),
      ("pallas_t1", dict(backend="pallas", config=WriteKVConfig("pallas", 1))),
      ("pallas_t4", dict(backend="pallas", config=WriteKVConfig("pallas", 4))),
      ("pallas_t16", dict(backend="pallas", config=WriteKVConfig("pallas", 16))),
  ]
  if args.small:
    mla, full, toks = (64, 16, 576), (3, 8, 16, 2, 64), (8, 32)
    checks = [("BNC", (16, 16, 576)), ("LBNHC", (3, 8, 16, 2, 64))]
  else:
    mla, full, toks = (32768, 64, 576), (61, 1024, 16, 8, 128), (256, 4096)
    checks = [
        ("BNC", (512, 64, 576)),
        ("LBNHC", (61, 64, 16, 8, 128)),
        ("LBHNC", (4, 64, 16, 8, 128)),
        ("BHLNC", (64, 8, 4, 16, 128)),
        ("BNHC", (256, 16, 8, 128)),
    ]
  log = open(os.path.join(args.out, "bench_write_kv.jsonl"), "w")
  print("device", jax.devices()[0].device_kind, jax.__version__, flush=True)
  ok = []
  if not args.no_check:
    ok = check(checks[:1], [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32], variants[:3], rng)
    ok += check(checks[1:], [jnp.bfloat16], variants[:3], rng)
  ceiling = copy_ceiling(64 << 20 if args.small else 2 << 30)
  rows = []
  for t in toks:
    rows += time_case(f"MLA {mla} bf16, {t} tok", "BNC", mla, t, variants, rng, log)
  for t in toks:
    rows += time_case(f"LBNHC {full} bf16, {t} tok", "LBNHC", full, t, variants, rng, log)
  log.close()
  print("\ncorrectness (bit-exact vs reference):")
  for r in ok:
    print(f"  {r[0]:6s} {r[1]:14s} {r[2]:11s} {r[3]}")
  print(f"\ncopy ceiling (XLA x*1, read+write): {ceiling / 1e12:.3f} TB/s")
  print(f"{'case':44s} {'variant':11s} {'us/write':>9s} {'TB/s':>7s} {'ratio':>6s}")
  for label, name, us, bw in rows:
    print(f"{label:44s} {name:11s} {us:9.2f} {bw / 1e12:7.3f} {bw / ceiling:6.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
