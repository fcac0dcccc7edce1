"""One scheduler step of the block pool as a jitted transition vs a host linked-list pool.

The step (issue 3): 256 running sequences each grow by one token, 8 finish, 8
arrive with prompts of random length that often share one of 16 system
prompts (prefix caching on, fences on, new blocks zeroed): advance_step ->
free -> hash prompts + admit -> grow -> slot mapping -> mark_processed(step-1)
-> clear_pending, all in one jitted function. Decode grows with
`max_new_tokens=1`, so grow works on a `[batch, 1]` grid.

Printed: device time of the step on the accelerator (CUPTI kernel time per
step: single steps, and a 64-step scan), wall time per step of the jitted
step (dispatch included) and of `benchmarks/host_pool.py` (the peer, same
schedule, same run, interleaved step by step), the kernels the compiled
step launches (`hlo_kernels`), and ratios. History: benchmarks/POOL_NOTES.md. The device state is checked against every
pool invariant and the admissions against the host pool.

  python benchmarks/bench_pool.py [--steps 100] [--block 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from host_pool import HostPool  # noqa: E402

from jaxkv import _pool as pool  # noqa: E402

N, BS, S, M = 16384, 16, 512, 128
RUNNING, CHURN, MAX_PROMPT = 256, 8, 1024
T = M * BS


def make_spec():
  return pool.PoolSpec(num_blocks=N, block_size=BS, max_seqs=S, max_blocks_per_seq=M,
                       zero_new_blocks=True, enable_prefix_caching=True, defer_block_free=True,
                       max_zero_list=4096, max_tails=64)


def step_fn(spec, state, finish, arrive, lens, tokens):
  """The scheduler step; returns the state, the slot mapping, the zero list and ok flags."""
  state, _ = pool.advance_step(spec, state)
  state, _ = pool.free(spec, state, finish)
  digests = pool.hash_prompt_blocks(tokens, BS)
  state, (admitted, _) = pool.admit(spec, state, arrive, lens, digests, jnp.zeros_like(lens))
  running = jnp.where(state.active, jnp.arange(S, dtype=jnp.int32), -1)
  ones = state.active.astype(jnp.int32)
  state, grown = pool.grow(spec, state, running, ones, max_new_tokens=1)
  state, slots = pool.slot_mapping(spec, state, running, ones, S)
  zero_list, _ = state.pending_zero
  state, _ = pool.mark_processed(spec, state, state.step - 1)
  ok = jnp.all(admitted | (arrive < 0)) & jnp.all(grown | (running < 0))
  return pool.clear_pending(spec, state), slots, zero_list, ok


def hlo_kernels(hlo_text):
  """Kernels the compiled step launches: top-level instructions of its entry computation.

  Parameters, constants, tuples and bitcasts launch nothing; every fusion,
  copy, scatter or loop does (a few microseconds each on a GPU).
  """
  entry = hlo_text[hlo_text.index("ENTRY"):]
  entry = entry[: entry.index("\n}")]
  skip = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")
  count = 0
  for line in entry.splitlines()[1:]:
    m = re.search(r"=\s*\S+\s+([\w-]+)\(", line)
    if m and m.group(1) not in skip:
      count += 1
  return count


def schedule(rng, steps):
  """Initial sequences and per-step (finish, arrive, lens, tokens), the same for both pools."""
  systems = rng.integers(0, 32000, (16, 512))

  def prompt():
    plen = int(rng.integers(16, MAX_PROMPT + 1))
    tok = rng.integers(0, 32000, T)
    if rng.random() < 0.7:
      cut = int(rng.integers(64, 513))
      tok[:cut] = systems[rng.integers(16)][:cut]
    return tok.astype(np.int32), plen

  init = [prompt() for _ in range(RUNNING)]
  active, free_ids = list(range(RUNNING)), list(range(RUNNING, S))
  trace = []
  for _ in range(steps):
    fin = [active.pop(int(rng.integers(len(active)))) for _ in range(CHURN)]
    arr = [free_ids.pop(0) for _ in range(CHURN)]
    prompts = [prompt() for _ in range(CHURN)]
    active += arr
    free_ids += fin
    trace.append((np.array(fin, np.int32), np.array(arr, np.int32),
                  np.array([p[1] for p in prompts], np.int32), np.stack([p[0] for p in prompts])))
  return init, trace


def device_setup(spec, init):
  state = pool.init_pool(spec)
  adm = jax.jit(lambda s, a, l, t: pool.admit(spec, pool.clear_pending(spec, s), a, l, pool.hash_prompt_blocks(t, BS), jnp.zeros_like(l)))
  for i in range(0, RUNNING, 32):
    ids = np.arange(i, i + 32, dtype=np.int32)
    toks = np.stack([p[0] for p in init[i:i + 32]])
    lens = np.array([p[1] for p in init[i:i + 32]], np.int32)
    state, (ok, _) = adm(state, jnp.asarray(ids), jnp.asarray(lens), jnp.asarray(toks))
    assert bool(jnp.all(ok)), "initial admission failed"
  return state


def host_setup(init):
  host = HostPool(N, BS)
  for sid, (tok, plen) in enumerate(init):
    assert host.admit(sid, tok.tolist(), plen)
  host.zero = []
  return host


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=100)
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
  ap.add_argument("--block", type=int, default=1, help="steps per side before switching (1: every step)")
  args = ap.parse_args()
  dev = jax.devices()[0]
  spec = make_spec()
  rng = np.random.default_rng(0)
  warm = 10
  init, trace = schedule(rng, warm + args.steps + 64)
  dtrace = [tuple(jnp.asarray(x) for x in t) for t in trace]

  # --- host peer and jitted step, alternating --------------------------------
  # Both see the same machine load (the CPU may be shared), so their ratio is
  # meaningful even when the absolute figures drift. `--block 1` alternates
  # every step: each side then starts with caches the other one filled (the
  # host step walks thousands of Python objects), which costs the jitted step
  # far more than its work; `--block 20` alternates runs of 20 steps.
  host = host_setup(init)
  host_active = list(range(RUNNING))
  step = jax.jit(functools.partial(step_fn, spec), donate_argnums=0)
  state = device_setup(spec, init)
  t_compile = time.perf_counter()
  compiled = step.lower(state, *dtrace[0]).compile()
  t_compile = time.perf_counter() - t_compile
  kernels = hlo_kernels(compiled.as_text())
  jax.block_until_ready(step(jax.tree.map(jnp.copy, state), *dtrace[0]))
  host_ms, wall_ms, oks = [], [], []
  total = warm + args.steps
  for start in range(0, total, args.block):
    run = range(start, min(start + args.block, total))
    for i in run:
      fin, arr, lens, toks = trace[i]
      arrivals = [(int(s), toks[k].tolist(), int(lens[k])) for k, s in enumerate(arr)]
      for s in fin:
        host_active.remove(int(s))
      host_active += [int(s) for s in arr]
      t0 = time.perf_counter()
      host.step(fin.tolist(), arrivals, sorted(host_active))
      if i >= warm:
        host_ms.append((time.perf_counter() - t0) * 1e3)
    for i in run:
      t1 = time.perf_counter()
      state, slots, zl, ok = step(state, *dtrace[i])
      jax.block_until_ready(slots)
      if i >= warm:
        wall_ms.append((time.perf_counter() - t1) * 1e3)
      oks.append(ok)
  all_ok = bool(jnp.all(jnp.stack(oks)))
  pool.assert_pool_valid(spec, state)
  dev_free, host_free = int(state.num_free) + int(state.num_parked), host.free.size
  dev_active = int(jnp.sum(state.active))

  # --- device time (CUPTI) --------------------------------------------------
  cupti_step = cupti_scan = None
  if dev.platform == "gpu":
    from jax.experimental.mosaic.gpu.profiler import measure

    plain = jax.jit(functools.partial(step_fn, spec))
    t = dtrace[warm + args.steps]
    _, times = measure(plain, iterations=50)(state, *t)
    cupti_step = statistics.median(times) * 1e3

    def scan_body(s, t):
      s, slots, _, _ = step_fn(spec, s, *t)
      return s, slots[0]

    stacked = tuple(jnp.stack(x) for x in zip(*dtrace[warm + args.steps: warm + args.steps + 64]))
    scan = jax.jit(lambda s, xs: jax.lax.scan(scan_body, s, xs))
    jax.block_until_ready(scan(state, stacked))
    _, times = measure(scan, iterations=5)(state, stacked)
    cupti_scan = statistics.median(times) * 1e3 / 64

  med = statistics.median
  row = dict(
      device=dev.device_kind, jax=jax.__version__, date="2026-11-29",
      shape=f"N={N} bs={BS} seqs={RUNNING} running (+{CHURN} arrive/{CHURN} finish) max_seqs={S} M={M}",
      steps=args.steps, block=args.block, all_ok=all_ok, compile_s=round(t_compile, 2), hlo_kernels=kernels,
      jit_step_wall_us=round(med(wall_ms) * 1e3, 1), host_python_step_us=round(med(host_ms) * 1e3, 1),
      cupti_step_us=None if cupti_step is None else round(cupti_step, 1),
      cupti_scan_step_us=None if cupti_scan is None else round(cupti_scan, 1),
      free_blocks_device=dev_free, free_blocks_host=host_free, active_device=dev_active,
      active_host=len(host.seqs),
  )
  row["host_over_jit_wall"] = round(row["host_python_step_us"] / row["jit_step_wall_us"], 2)
  # Step by step (both saw the same load at that moment), less sensitive to drift.
  row["host_over_jit_paired"] = round(med([h / w for h, w in zip(host_ms, wall_ms)]), 2)
  if cupti_step:
    row["host_over_cupti"] = round(row["host_python_step_us"] / cupti_step, 1)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "bench_pool.json"), "w") as f:
    json.dump(row, f, indent=1)
  print("\nbench_pool (per scheduler step)")
  for k, v in row.items():
    print(f"  {k:24s} {v}")


if __name__ == "__main__":
  main()
