"""Dense paged MLA decode on the GPU: the correctness check (`check_mla_decode.py`), then timings.

Usage: python benchmarks/bench_mla_decode.py [--skip-check | --check PART ...] [--shapes B:H:CTX[:mul][:xla][:bs32|:bs128][:VARIANT] ...]
(":mul" also times mask_mode="multiply", ":xla" the XLA reference, ":bs32" /
":bs128" a cache of that block size instead of 64,
":sw64" / ":sw128" the kernel with the query and KV ring under the 64- or
128-byte swizzle, `MLADecodeConfig(kv_swizzle=...)`, ":qr0" ... ":qr192"
with that many latent query channels in registers, `MLADecodeConfig(q_regs=...)`:
each the shape's default config with that field replaced, on the default's
plan; the check runs every variant the shapes name; ":ungrouped" merges rows
of many splits with the per-split ring instead of the grouped pass,
":grouped" takes the grouped pass wherever a row has more than 8 splits
(":g8" / ":g16" at that many channels per merge CTA), ":finish" has the
decode kernel finish whole rows, ":fence" fences every P hand-off (the
on-device check then also compares it bitwise with the default), ":mdirect" stores the
merge's bf16 output from registers instead of by TMA from SMEM (checked
bitwise), ":padded" pads a query of fewer heads than its head groups to
64 per group in XLA and slices the result (the build before the unpadded
query; checked bitwise); ":nopack" merges rows of 8-32 heads one row per
CTA instead of stacked (checked within one bf16 ulp);
":f32p" stores the split partials in float32 (the default stores them in
scaled float16 but for rows of 8-32 heads; checked within the float16
rounding), ":f16p" in float16 even at 8-32 heads (no stacked merge), ":g8f16p"
in float16 with the grouped pass at 8 channels (":g8"'s A/B);
":halves" the grouped pass in halves, two CTAs per tile in a cluster,
wherever it can run (the default past one grouped CTA's 128 splits);
":unlean" the grouped pass's loops as first timed (the live count before the
first copies, the maximum split by split);
":mc2" ... ":mc16" the default kernel on a plan whose parts carry at least
that many tiles, `MLADecodeConfig(min_chunk_blocks=...)`, ":ns2" ... ":ns6" on a
plan of that many split slots per row, `MLADecodeConfig(num_splits=...)`, ":so0"
... ":so8" on a plan that charges each row segment that many tiles,
`MLADecodeConfig(split_overhead_tiles=...)`).

Prints, per shape: kernel time (CUPTI, median), TB/s and TFLOP/s counted as
bytes = q + seq_len*576*2 + out and FLOPs = 2*heads*seq_len*(576+512), the
same-run Pallas paged-gather ceiling over the same blocks (the faster of the
gather cut as the kernel's plan cuts the rows and cut as finely as any plan
would: every SM busy), and the XLA
reference (gather + einsum). Every timed call reads its own block table over
disjoint blocks so that L2 never serves a repeat.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu.profiler import measure
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode import (
    mla_decode,
    mla_decode_plan,
    mla_decode_reference,
)
from jaxkv.kernels.mla_decode.config import default_config, heuristic_config
from jaxkv.kernels.mla_decode.wrapper import _mla_decode

from check_mla_decode import BS, CHECKS, D, SAME_RESULT, check_correctness, check_same_result
L2_BYTES = 60 << 20


def gather_ceiling(cache, tables, bounds):
  """Pallas TMA paged gather: the same blocks, same copies, no compute."""
  batch, splits = bounds.shape[0], bounds.shape[1] - 1
  stages = 3

  def gather_kernel(cache_ref, table_ref, bounds_ref, o_ref, lat, rope, bar):
    # cache_ref [num_blocks, 64, 576] bf16; table_ref [batch, max_blocks] i32;
    # bounds_ref [batch, splits + 1] i32; o_ref [batch, splits, 64] bf16;
    # lat [stages, 2, 64, 256] and rope [stages, 64, 64] bf16 SMEM; bar [stages].
    s, b = lax.axis_index("s"), lax.axis_index("b")
    start = bounds_ref[b, s]
    n = bounds_ref[b, s + 1] - start

    def issue(step, slot):
      blk = table_ref[b, start + step]
      for h in range(2):
        plgpu.copy_gmem_to_smem(cache_ref.at[blk, :, pl.ds(256 * h, 256)], lat.at[slot, h], bar.at[slot])
      plgpu.copy_gmem_to_smem(cache_ref.at[blk, :, pl.ds(512, 64)], rope.at[slot], bar.at[slot])

    for i in range(stages):
      pl.when(i < n)(lambda i=i: issue(i, i))

    @pl.loop(0, n)
    def _(step):
      slot = lax.rem(step, stages)
      plgpu.barrier_wait(bar.at[slot])
      pl.when(step + stages < n)(lambda: issue(step + stages, slot))

    # One tiny store per CTA keeps the loads observable.
    plgpu.copy_smem_to_gmem(rope.at[0, 0], o_ref.at[b, s])
    plgpu.wait_smem_to_gmem(0)

  f = plgpu.kernel(
      gather_kernel,
      out_type=jax.ShapeDtypeStruct((batch, splits, 64), jnp.bfloat16),
      grid=(splits, batch), grid_names=("s", "b"),
      scratch_types=[plgpu.SMEM((stages, 2, BS, 256), jnp.bfloat16), plgpu.SMEM((stages, BS, 64), jnp.bfloat16),
                     plgpu.Barrier(num_arrivals=3, num_barriers=stages)],
      kernel_name="gather_ceiling",
  )
  return [f(cache, t, bounds) for t in tables]


def make_lens(rng, batch, mean_ctx):
  lo, hi = max(1, mean_ctx // 2), mean_ctx * 3 // 2
  return rng.integers(lo, hi + 1, size=batch).astype(np.int32) if batch > 1 else np.array([mean_ctx], np.int32)


def shape_problem(shape: str, seed: int = 0):
  """`"B:H:CTX"` as one call's random problem, laid out as `bench_shape`
  lays it out: (q, cache, block table, seq_lens, the default plan). For the
  probe and profile scripts."""
  b, h, ctx = map(int, shape.split(":"))
  rng = np.random.default_rng(seed)
  q, cache, tables, lens = make_problem(rng, make_lens(rng, b, ctx), h, 1)
  return q, cache, tables[0], lens, mla_decode_plan(lens, num_heads=h)


def make_problem(rng, lens, heads, copies, bs=BS):
  batch = len(lens)
  nblk = -(-lens // bs)
  max_blocks = int(nblk.max())
  per_copy = int(nblk.sum())
  num_blocks = 1 + per_copy * copies
  perm = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
  tables = []
  for c in range(copies):
    t = np.zeros((batch, max_blocks), np.int32)
    ids = perm[c * per_copy:(c + 1) * per_copy]
    off = 0
    for b in range(batch):
      t[b, :nblk[b]] = ids[off:off + nblk[b]]
      off += nblk[b]
    tables.append(jnp.asarray(t))
  key = jax.random.key(int(rng.integers(1 << 30)))
  cache = jax.random.normal(key, (num_blocks, bs, D), jnp.bfloat16)
  q = jax.random.normal(jax.random.fold_in(key, 1), (batch, heads, D), jnp.bfloat16)
  return q, cache, tables, jnp.asarray(lens)


def timed(fn, *args, iters=5):
  """Median per-call kernel time (ms) of fn(*args), which runs `copies` calls."""
  _, t = measure(fn, aggregate=False, iterations=iters)(*args)
  per_iter = [sum(ms for _, ms in it) for it in t]
  return float(np.median(per_iter)), t[len(t) // 2]


# The kernel variants beside the default that a shape may time (":name").
# Each replaces these fields of the shape's default config (tuned or heuristic).
VARIANTS = {"sw64": dict(kv_swizzle=64), "sw128": dict(kv_swizzle=128),
            "qr0": dict(q_regs=0), "qr64": dict(q_regs=64), "qr128": dict(q_regs=128),
            "qr192": dict(q_regs=192)}
# Variants of the plan (each gets its own plan from these config fields).
PLAN_VARIANTS = {**{f"mc{n}": dict(min_chunk_blocks=n) for n in (2, 4, 8, 16)},
                 **{f"ns{n}": dict(num_splits=n) for n in (2, 3, 4, 5, 6)},
                 **{f"so{n}": dict(split_overhead_tiles=n) for n in range(9)}}
# Variants of the merge rather than of the kernel's config (`_mla_decode`'s
# private arguments): "ungrouped" merges rows of many splits with the
# per-split ring (two passes past 32 splits) instead of the grouped pass,
# "grouped" takes the grouped pass wherever a row has more than 8 splits,
# "mdirect" stores the merge's bf16 output from registers, not by TMA,
# "nopack" merges rows of 8-32 heads one row per CTA, not stacked,
# "f16p" stores the partials in scaled float16 (by TMA through the segment's
# last stage where the per-split ring merges; from registers in column slices
# where the grouped pass merges; the default but for rows of 8-32 heads;
# never with the stacked merge), "f32p" in float32, "g8f16p"
# in float16 with the grouped pass at 8 channels; "halves" the grouped pass
# in halves (two CTAs per tile in a cluster) wherever it can run (the default
# past `GROUP_MAX_SPLITS` splits); "unlean" the grouped pass's loops as first
# timed (the live count before the first copies, the maximum split by split).
# (The variants "rolled", "rhalves", "rf16p", "hf16p" and "rhf16p", which
# NOTES.md's tables name, now run "halves"' call or the default's; "unrolled",
# the grouped pass as straight-line code, was removed with that code.)
MERGE_VARIANTS = {"ungrouped": dict(grouped=False), "grouped": dict(grouped=True),
                  "g8": dict(grouped=True, group_cols=8), "g16": dict(grouped=True, group_cols=16),
                  "finish": dict(finish=True), "fence": dict(p_fence=True),
                  "mdirect": dict(stage_merge_out=False), "padded": dict(pad_heads=True),
                  "nopack": dict(pack=False), "f16p": dict(f16_partials=True, pack=False),
                  "f32p": dict(f16_partials=False),
                  "g8f16p": dict(grouped=True, group_cols=8, f16_partials=True),
                  "halves": dict(grouped=True, group_halves=True),
                  "unlean": dict(merge_lean=False)}


def kernel_and_merge(names, copies):
  """The decode kernel's and the merge kernels' ms per call, from `timed`'s
  (kernel name, ms) pairs over `copies` calls."""
  merge = sum(t for nm, t in names if "merge" in nm)
  kern = sum(t for nm, t in names if "mla_decode" in nm and "merge" not in nm)
  return kern / copies, merge / copies


def bench_shape(rng, batch, heads, mean_ctx, modes, with_xla, config=None, bs=BS, variants=()):
  one = batch * mean_ctx * D * 2
  copies = max(1, math.ceil(3 * L2_BYTES / one))
  lens_np = make_lens(rng, batch, mean_ctx)
  q, cache, tables, lens = make_problem(rng, lens_np, heads, copies, bs=bs)
  plan = mla_decode_plan(lens, num_heads=heads, block_size=bs, config=config)
  res = {}
  n_tok = int(lens.sum())
  bytes_ = q.size * 2 + n_tok * D * 2 + batch * heads * 512 * 2
  flops = 2 * heads * n_tok * (D + 512)
  for mode in modes:
    fn = jax.jit(lambda q, c, ts, s, p, mode=mode: [
        mla_decode(q, c, t, s, sm_scale=D**-0.5, mask_mode=mode, plan=p) for t in ts])
    ms, names = timed(fn, q, cache, tables, lens, plan)
    res[mode] = ms / copies
    res[mode + "_kernel"], res[mode + "_merge"] = kernel_and_merge(names, copies)
    if not res.get("names"):
      res["names"] = sorted({nm[:40] for nm, _ in names})
  for name in variants:  # the same plan, another kernel or merge variant; or another plan
    vplan = plan
    if name in PLAN_VARIANTS:  # the default kernel on its own plan
      cfg = dataclasses.replace(default_config(batch=batch, num_heads=heads), **PLAN_VARIANTS[name])
      vplan = mla_decode_plan(lens, num_heads=heads, block_size=bs, config=cfg)
      fn = jax.jit(lambda q, c, ts, s, p: [
          mla_decode(q, c, t, s, sm_scale=D**-0.5, plan=p) for t in ts])
    elif name in MERGE_VARIANTS:
      cfg = default_config(batch=batch, num_heads=heads)
      fn = jax.jit(lambda q, c, ts, s, p, cfg=cfg, kw=MERGE_VARIANTS[name]: [
          _mla_decode(q, c, t, s, p, sm_scale=D**-0.5, select=True, interpret=None,
                      kv_swizzle=cfg.kv_swizzle, q_regs=cfg.q_regs, **kw) for t in ts])
    else:
      cfg = dataclasses.replace(default_config(batch=batch, num_heads=heads), **VARIANTS[name])
      fn = jax.jit(lambda q, c, ts, s, p, cfg=cfg: [
          mla_decode(q, c, t, s, sm_scale=D**-0.5, plan=p, config=cfg) for t in ts])
    ms, names = timed(fn, q, cache, tables, lens, vplan)
    res[name] = ms / copies
    res[name + "_kernel"], res[name + "_merge"] = kernel_and_merge(names, copies)
  g = jax.jit(lambda c, ts, bnd: gather_ceiling(c, ts, bnd))
  # The ceiling is the faster of the gather over the kernel's plan and over
  # a plan cut as finely as any (every SM busy even where the kernel's plan
  # leaves SMs idle, as its parts' least length can at batch 1).
  # (The heuristic's splits admit the cuts of its one part per SM.)
  heur = heuristic_config(batch=batch, num_heads=heads)
  fine = mla_decode_plan(lens, num_heads=heads, block_size=bs, config=dataclasses.replace(
      heur, num_splits=max(plan.num_splits, heur.num_splits), min_chunk_blocks=2))
  if bs != BS:  # the ceiling streams 64-slot blocks: the same bytes
    _, cache64, tables64, _ = make_problem(rng, lens_np, heads, copies)
  else:
    cache64, tables64 = cache, tables
  ms, _ = timed(g, cache64, tables64, plan.bounds)
  ms_fine, _ = timed(g, cache64, tables64, fine.bounds)
  del cache64
  res["gather_plan"], res["gather_fine"] = ms / copies, ms_fine / copies
  res["gather"] = min(ms, ms_fine) / copies
  if with_xla:
    fx = jax.jit(lambda q, c, t, s: mla_decode_reference(q, c, t, s, sm_scale=D**-0.5))
    ms, _ = timed(fx, q, cache, tables[0], lens, iters=3)
    res["xla"] = ms
  return dict(batch=batch, heads=heads, ctx=mean_ctx, bs=bs, splits=plan.num_splits,
              bytes=bytes_, flops=flops, **res)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", nargs="*", default=None,
                  help="batch:heads:ctx[:mul][:xla][:bs32|:bs128][:VARIANT ...], VARIANT in "
                       + " ".join([*VARIANTS, *MERGE_VARIANTS, *PLAN_VARIANTS]))
  ap.add_argument("--skip-check", action="store_true")
  ap.add_argument("--check", nargs="*", choices=CHECKS, default=list(CHECKS),
                  help="the parts of the on-device check to run (default: all)")
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  print(jax.devices()[0].device_kind, jax.__version__)
  shapes = args.shapes or ["128:64:4096:xla", "128:128:4096:xla", "128:16:4096", "128:64:16384",
                           "128:128:16384", "1:128:131072", "8:64:32768"]
  if not args.skip_check:  # the dataclass default and every variant the shapes name
    names = ("default", *[v for v in VARIANTS if any(v in s.split(":") for s in shapes)])
    ok = [check_correctness(rng, v, VARIANTS.get(v), args.check) for v in names]
    same = [v for v in SAME_RESULT if any(v in s.split(":") for s in shapes)]
    if same and "same" in args.check:
      names, ok = (*names, "same result"), [*ok, check_same_result(rng, same)]
    print("CORRECT" if all(ok) else f"WRONG ({dict(zip(names, ok))})")
  out = []
  for spec in shapes:
    parts = spec.split(":")
    b, h, c = map(int, parts[:3])
    modes = ("select", "multiply") if "mul" in parts else ("select",)
    bs = next((int(x[2:]) for x in parts[3:] if x.startswith("bs")), BS)
    try:
      r = bench_shape(rng, b, h, c, modes, "xla" in parts, bs=bs,
                      variants=[v for v in (*VARIANTS, *MERGE_VARIANTS, *PLAN_VARIANTS) if v in parts])
    except Exception as e:  # keep measuring the other shapes
      print("FAILED", spec, repr(e)[:300], flush=True)
      continue
    out.append(r)
    print(r, flush=True)
  print("\nbatch heads ctx bs splits | select ms TB/s TFLOP/s | kernel-only ms (merge µs) | multiply ms (kernel) sel/mul | gather ms TB/s (plan / fine ms) | gather/sel | xla ms  x | variant ms (variant/default)")
  for r in out:
    ms = r["select"]
    tbs = r["bytes"] / ms / 1e9
    tf = r["flops"] / ms / 1e9
    gtbs = r["bytes"] / r["gather"] / 1e9
    mul = (f"{r['multiply']:.3f} ({r['multiply_kernel']:.3f}) {ms / r['multiply']:.3f}"
           if "multiply" in r else "-")
    xla = f"{r['xla']:.3f} {r['xla'] / ms:.1f}x" if "xla" in r else "-"
    dep = " ".join(f"{v} {r[v]:.4f} ({r[v] / ms:.3f}; merge {1e3 * r[v + '_merge']:.1f})"
                   for v in (*VARIANTS, *MERGE_VARIANTS, *PLAN_VARIANTS) if v in r) or "-"
    print(f"{r['batch']:5d} {r['heads']:5d} {r['ctx']:6d} {r['bs']:3d} {r['splits']:4d} | {ms:.3f} {tbs:.2f} {tf:.0f} | "
          f"{r['select_kernel']:.3f} ({1e3 * r['select_merge']:.1f}) | {mul} | {r['gather']:.3f} {gtbs:.2f} ({r['gather_plan']:.4f} / {r['gather_fine']:.4f}) | {r['gather'] / ms:.2f} | {xla} | {dep}")


if __name__ == "__main__":
  main()
