"""Dense paged MLA decode on the GPU: correctness check, then timings against ceilings.

Usage: python benchmarks/bench_mla_decode.py [--skip-check | --check PART ...] [--shapes B:H:CTX[:mul][:xla][:VARIANT] ...]
(":mul" also times mask_mode="multiply", ":xla" the XLA reference,
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
query; checked bitwise);
":f32p" stores the split partials in float32 (the default where the
per-split ring merges stores them in scaled float16; checked within the
float16 rounding), ":f16p" in float16 even at 8-32 heads (no stacked merge)
and where the grouped pass merges (float32 there by default), ":g8f16p"
in float16 with the grouped pass at 8 channels (":g8"'s A/B);
":mc2" ... ":mc16" the default kernel on a plan whose parts carry at least
that many tiles, `MLADecodeConfig(min_chunk_blocks=...)`).

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
    MLADecodeConfig,
    mla_decode,
    mla_decode_plan,
    mla_decode_reference,
)
from jaxkv.kernels.mla_decode import merge_tiling
from jaxkv.kernels.mla_decode.config import default_config, heuristic_config
from jaxkv.kernels.mla_decode.wrapper import _mla_decode

BS = 64
D = 576
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


def table_for(rng, lens, num_blocks, max_blocks, bs=BS):
  """Distinct random non-null blocks for each row's tokens, padded with 0."""
  nblk = -(-np.asarray(lens) // bs)
  ids = rng.permutation(np.arange(1, num_blocks))[: nblk.sum()]
  t = np.zeros((len(lens), max_blocks), np.int32)
  off = 0
  for b, k in enumerate(nblk):
    t[b, :k] = ids[off:off + k]
    off += k
  return jnp.asarray(t)


# The kernel variants beside the default that a shape may time (":name").
# Each replaces these fields of the shape's default config (tuned or heuristic).
VARIANTS = {"sw64": dict(kv_swizzle=64), "sw128": dict(kv_swizzle=128),
            "qr0": dict(q_regs=0), "qr64": dict(q_regs=64), "qr128": dict(q_regs=128),
            "qr192": dict(q_regs=192)}
# Variants of the plan (each gets its own plan from these config fields).
PLAN_VARIANTS = {f"mc{n}": dict(min_chunk_blocks=n) for n in (2, 4, 8, 16)}
# Variants of the merge rather than of the kernel's config (`_mla_decode`'s
# private arguments): "ungrouped" merges rows of many splits with the
# per-split ring (two passes past 32 splits) instead of the grouped pass,
# "grouped" takes the grouped pass wherever a row has more than 8 splits,
# "mdirect" stores the merge's bf16 output from registers, not by TMA,
# "nopack" merges rows of 8-32 heads one row per CTA, not stacked,
# "f16p" stores the partials in scaled float16 (by TMA through the segment's
# last stage where the per-split ring merges, the default there but for
# rows of 8-32 heads; from registers in column slices where the grouped
# pass merges; never with the stacked merge), "f32p" in float32, "g8f16p"
# in float16 with the grouped pass at 8 channels.
MERGE_VARIANTS = {"ungrouped": dict(grouped=False), "grouped": dict(grouped=True),
                  "g8": dict(grouped=True, group_cols=8), "g16": dict(grouped=True, group_cols=16),
                  "finish": dict(finish=True), "fence": dict(p_fence=True),
                  "mdirect": dict(stage_merge_out=False), "padded": dict(pad_heads=True),
                  "nopack": dict(pack=False), "f16p": dict(f16_partials=True, pack=False),
                  "f32p": dict(f16_partials=False),
                  "g8f16p": dict(grouped=True, group_cols=8, f16_partials=True)}


def errors(out, lse, ref_out, ref_lse):
  """(relative error of out, largest LSE error where the reference is finite,
  whether out is finite) against the reference's results."""
  o32, r32 = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
  err = np.linalg.norm(o32 - r32) / np.linalg.norm(r32)
  lerr = np.nanmax(np.abs(np.where(np.isinf(ref_lse), 0, np.asarray(lse) - np.asarray(ref_lse))))
  return err, lerr, bool(np.isfinite(o32).all())


def poison_tails(cache, table, lens_np):
  """The cache with the null block (0) and the unwritten tail of every row's
  last block NaN."""
  poisoned = cache.at[0].set(jnp.nan)
  for b, s in enumerate(lens_np):
    if s % BS:
      poisoned = poisoned.at[table[b, s // BS], s % BS:].set(jnp.nan)
  return poisoned


# The on-device check's parts (`--check`): each compiles its own kernels, and
# all of them take most of a device call (580 s on 2026-12-05).
CHECKS = ("basic", "block_sizes", "grouped", "outside", "nan_data", "same")


def check_correctness(rng, variant="default", parts=CHECKS):
  """The `parts` of the check (`CHECKS` but "same", `check_same_result`)
  for `variant`'s config."""
  kernel_kw = VARIANTS.get(variant, {})
  print(f"variant {variant}: {kernel_kw}")
  cfg = MLADecodeConfig(num_splits=2, min_chunk_blocks=1, **kernel_kw)
  checks = dict(
      basic=lambda: check_basic(rng, kernel_kw),
      block_sizes=lambda: check_block_sizes(rng, cfg),
      grouped=lambda: check_grouped(rng, kernel_kw),
      outside=lambda: check_blocks_outside_the_cache(rng, cfg),
      nan_data=lambda: check_nan_in_valid_data(rng, kernel_kw),
  )
  return all([checks[name]() for name in parts if name in checks])


def check_basic(rng, kernel_kw):
  """The reference at 8-128 heads and 1-40 splits; NaN tails and null block:
  "select" as clean, "multiply" NaN in the rows with a tail."""
  rows = []
  lens_np = [1, 63, 64, 65, 0, 1000, 4097, 300]
  # The last three cut rows into more splits than a merge group (8): the
  # grouped merge. 8, 48 and 32 heads: an unpadded query, the result stored
  # at its own heads.
  for heads, splits, mode in ((16, 1, "select"), (64, 3, "multiply"), (128, 7, "select"),
                              (48, 3, "select"), (8, 3, "multiply"), (128, 20, "select"),
                              (64, 40, "multiply"), (32, 40, "multiply")):
    key = jax.random.key(heads)
    cache = jax.random.normal(key, (200, BS, D), jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 1), (8, heads, D), jnp.bfloat16)
    lens = jnp.asarray(lens_np, jnp.int32)
    table = table_for(rng, lens_np, 200, 70)
    cfg = MLADecodeConfig(num_splits=splits, min_chunk_blocks=1, **kernel_kw)
    out, lse = mla_decode(q, cache, table, lens, sm_scale=D**-0.5, mask_mode=mode, config=cfg)
    ro, rl = mla_decode_reference(q, cache, table, lens, sm_scale=D**-0.5, mask_mode=mode)
    rows.append((heads, splits, mode, *errors(out, lse, ro, rl)))
  # NaN poisoning: tails and the null block NaN. The last two rows have
  # splits of 2-3 blocks (steady-state loop, then the peeled last step).
  lens_np = [64, 65, 0, 127, 300, 257]
  lens = jnp.asarray(lens_np, jnp.int32)
  cache = jax.random.normal(jax.random.key(7), (40, BS, D), jnp.bfloat16)
  q = jax.random.normal(jax.random.key(8), (len(lens_np), 64, D), jnp.bfloat16)
  table = table_for(rng, lens_np, 40, 6)
  poisoned = poison_tails(cache, table, lens_np)
  cfg = MLADecodeConfig(num_splits=2, min_chunk_blocks=1, **kernel_kw)
  clean, _ = mla_decode(q, cache, table, lens, sm_scale=0.05, config=cfg)
  sel, _ = mla_decode(q, poisoned, table, lens, sm_scale=0.05, config=cfg)
  mul, _ = mla_decode(q, poisoned, table, lens, sm_scale=0.05, mask_mode="multiply", config=cfg)
  nan_rows = np.isnan(np.asarray(mul, np.float32)).any(axis=(1, 2)).tolist()
  same = bool((np.asarray(sel) == np.asarray(clean)).all())
  print("correctness: heads splits mode rel_err lse_err finite")
  for r in rows:
    print("  ", r)
  want_nan = [s % BS != 0 for s in lens_np]
  print(f"poison: select==clean {same}; multiply NaN rows {nan_rows} (want {want_nan})")
  return all(r[3] < 1e-2 and r[4] < 1e-2 and r[5] for r in rows) and same and nan_rows == want_nan


def check_nan_in_valid_data(rng, kernel_kw):
  """NaN in data a row reads as valid is data: a NaN latent channel in row
  0's token 5 makes every head of row 0 NaN, out and LSE, and a NaN in row
  1's query at head 5 that head, as the reference says, whichever merge
  takes the rows (one split: none; 3: the per-split ring, or the stacked
  merge at 16 heads; 20 at 128 heads: grouped; 40: two passes); the other
  heads the reference's."""
  lens_np = [1000, 4097, 300]
  lens = jnp.asarray(lens_np, jnp.int32)
  table = table_for(rng, lens_np, 200, 70)
  cache = jax.random.normal(jax.random.key(21), (200, BS, D), jnp.bfloat16)
  cache = cache.at[table[0, 0], 5, 7].set(jnp.nan)
  good = True
  for heads, splits in ((64, 1), (64, 3), (16, 3), (128, 20), (64, 40)):
    q = jax.random.normal(jax.random.key(22), (3, heads, D), jnp.bfloat16).at[1, 5, 100].set(jnp.nan)
    cfg = MLADecodeConfig(num_splits=splits, min_chunk_blocks=1, **kernel_kw)
    got = mla_decode(q, cache, table, lens, sm_scale=D**-0.5, config=cfg)
    want = mla_decode_reference(q, cache, table, lens, sm_scale=D**-0.5)
    o, l, wo, wl, same_nans = _as_f32(got, want)
    nan_at = np.zeros((3, heads), bool)
    nan_at[0], nan_at[1, 5] = True, True
    exact = all((np.isnan(x).reshape(3, heads, -1).all(-1) == nan_at).all()
                and (np.isnan(x).reshape(3, heads, -1).any(-1) == nan_at).all() for x in (o, l, wo, wl))
    fin = ~nan_at
    err = float(np.linalg.norm(o[fin] - wo[fin]) / np.linalg.norm(wo[fin]))
    lerr = float(np.abs(l[fin] - wl[fin]).max())
    print(f"NaN in valid data ({heads} heads, {splits} splits): NaN at exactly row 0 and row 1's"
          f" head 5 {same_nans and exact}; the others rel_err {err:.2e} lse_err {lerr:.2e}")
    good &= same_nans and exact and err < 1e-2 and lerr < 1e-2
  return good


def check_blocks_outside_the_cache(rng, cfg):
  """Block-table entries outside `[0, num_blocks)` for a row's tokens read
  as zeros (the copies' out-of-bounds fill), never another block: in both
  modes the kernel matches the reference over the cache with a zero block
  appended and those entries pointed at it, on a cache whose last block is
  NaN (which a clamp would read)."""
  lens_np = [300, 129, 64, 1000]
  lens = jnp.asarray(lens_np, jnp.int32)
  nb = 40
  cache = jax.random.normal(jax.random.key(11), (nb, BS, D), jnp.bfloat16).at[nb - 1].set(jnp.nan)
  q = jax.random.normal(jax.random.key(12), (len(lens_np), 64, D), jnp.bfloat16)
  table = np.array(table_for(rng, lens_np, nb - 1, 20))
  outside = np.array([[0, 2], [1, 0], [3, 5], [3, 15]])  # (row, block) inside each row
  table[outside[:, 0], outside[:, 1]] = [nb, -3, 2**31 - 1, nb + 7]
  zero_block = table.copy()
  zero_block[outside[:, 0], outside[:, 1]] = nb
  cache_z = jnp.concatenate([cache, jnp.zeros((1, BS, D), cache.dtype)])
  good = True
  for mode in ("select", "multiply"):
    out, lse = mla_decode(q, cache, jnp.asarray(table), lens, sm_scale=D**-0.5, mask_mode=mode,
                          config=cfg)
    ro, rl = mla_decode_reference(q, cache_z, jnp.asarray(zero_block), lens, sm_scale=D**-0.5,
                                  mask_mode=mode)
    err, lerr, finite = errors(out, lse, ro, rl)
    print(f"blocks outside the cache ({mode}): rel_err {err:.2e} lse_err {lerr:.2e} finite {finite}")
    good &= err < 1e-2 and lerr < 1e-2 and finite
  return good


# `_mla_decode` knobs that change the kernel's timing, never its arithmetic.
SAME_RESULT = {"fence": dict(p_fence=True), "mdirect": dict(stage_merge_out=False),
               "padded": dict(pad_heads=True), "nopack": dict(pack=False),
               "f16p": dict(f16_partials=True, pack=False), "f32p": dict(f16_partials=False)}
# Of those, the ones whose arithmetic is the default's but not its rounding:
# the stacked merge's masked steps compile to other fused multiply-adds than
# the per-row ring's (not bit-identical on the H200 at 16 heads, 2026-12-03),
# so "nopack" is compared within one bf16 ulp, with the same NaNs, and
# "padded" (which never stacks) bit for bit against "nopack".
# "f16p" and "f32p" store each split's partial in another dtype than the
# default may (float16 rounds it to 2^-11 of its row half's largest value):
# compared with `_close_partials`.
ROUNDING_ONLY = {"nopack"}
PARTIAL_ROUNDING = {"f16p", "f32p"}


def _as_f32(got, want):
  """Both results' (out, lse) as float32 arrays, and whether they have NaN in
  the same elements."""
  (o, l), (wo, wl) = [[np.asarray(x, np.float32) for x in r] for r in (got, want)]
  return o, l, wo, wl, np.array_equal(np.isnan(o), np.isnan(wo)) and np.array_equal(
      np.isnan(l), np.isnan(wl))


def _close(got, want):
  """The same NaNs, out within one bf16 ulp, LSE within 1e-5."""
  o, l, wo, wl, same_nans = _as_f32(got, want)
  if not same_nans:
    return False
  fin = ~np.isnan(wo)
  return bool(np.all(np.abs(o[fin] - wo[fin]) <= 2**-7 * np.abs(wo[fin]) + 1e-6)
              and np.allclose(l, wl, rtol=0, atol=1e-5, equal_nan=True))


def _close_partials(got, want):
  """The same NaNs, out within 2e-3 of the default in norm and each element
  within 2^-9 of its row's largest |value| plus a bf16 ulp, LSE within 1e-5."""
  o, l, wo, wl, same_nans = _as_f32(got, want)
  if not same_nans:
    return False
  o, wo = np.nan_to_num(o), np.nan_to_num(wo)
  row_max = np.abs(wo).max(axis=-1, keepdims=True)
  err = np.linalg.norm(o - wo) / max(np.linalg.norm(wo), 1e-6)
  return bool(err < 2e-3 and np.all(np.abs(o - wo) <= 2**-9 * row_max + 2**-7 * np.abs(wo))
              and np.allclose(l, wl, rtol=0, atol=1e-5, equal_nan=True))


def check_same_result(rng, names):
  """The `SAME_RESULT` variants in `names` (P fenced on every hand-off, the
  merge's output from registers, the query padded in XLA, rows of few heads
  merged one per CTA; see `ROUNDING_ONLY` for the last two): bit-identical to the default on parts of several segments, clean and with NaN tails and
  null block in both modes, under both ring layouts; the default against the
  reference."""
  ok = True
  lens_np = [64, 65, 0, 127, 300, 257, 1000, 4097, 5, 2000]
  lens = jnp.asarray(lens_np, jnp.int32)
  # 16 and 96 heads: the query unpadded and, on 24 SMs' plan (more parts
  # than rows: no rows finished in the kernel), the result stored by the
  # merge at its own heads ("padded" pads and slices in XLA instead).
  # The last: 64 splits on 100 SMs' plan, the 4097-token row cut past 32
  # splits, so the per-split ring merges in two passes.
  for heads, sw, qr, sms, splits in ((64, 128, 0, 6, 4), (128, 64, 128, 6, 4), (16, 128, 0, 24, 4),
                                     (96, 64, 128, 24, 4), (64, 64, 0, 100, 64)):
    cache = jax.random.normal(jax.random.key(heads), (200, BS, D), jnp.bfloat16)
    q = jax.random.normal(jax.random.key(heads + 1), (len(lens_np), heads, D), jnp.bfloat16)
    table = table_for(rng, lens_np, 200, 70)
    poisoned = poison_tails(cache, table, lens_np)
    cfg = MLADecodeConfig(num_splits=splits, min_chunk_blocks=1, kv_swizzle=sw, q_regs=qr)
    plan = mla_decode_plan(lens, num_heads=heads, config=cfg, num_sms=sms)
    if splits > 4:
      print(f"{heads} heads: {plan.num_splits} splits (two passes past "
            f"{merge_tiling.MAX_SPLITS}), {np.asarray(plan.bounds)[7].tolist()[:3]}...")
    run = lambda c, select, **kw: _mla_decode(q, c, table, lens, plan, sm_scale=D**-0.5, select=select,
                                              interpret=None, kv_swizzle=sw, q_regs=qr, **kw)
    for c, name in ((cache, "clean"), (poisoned, "poisoned")):
      for select in (True, False):
        default = [np.asarray(x) for x in run(c, select)]
        # "nopack"'s result, which "padded" is compared with too: run once.
        unpacked = None
        if {"nopack", "padded"} & set(names):
          unpacked = [np.asarray(x) for x in run(c, select, **SAME_RESULT["nopack"])]
        for v in names:
          if v == "nopack":
            got = unpacked
          else:
            got = [np.asarray(x) for x in run(c, select, **SAME_RESULT[v])]
          if v in PARTIAL_ROUNDING:
            same, how = _close_partials(got, default), "within float16 partials' rounding"
          elif v in ROUNDING_ONLY:
            same, how = _close(got, default), "within rounding"
          else:
            want = unpacked if v == "padded" else default
            same = all(np.array_equal(g, w, equal_nan=True) for g, w in zip(got, want))
            how = "identical"
          print(f"{v}: {heads} heads sw{sw} {name} {'select' if select else 'multiply'}: {how} {same}")
          ok = ok and same
    ro, rl = mla_decode_reference(q, cache, table, lens, sm_scale=D**-0.5)
    err, _, _ = errors(*run(poisoned, True), ro, rl)
    print(f"default, poisoned select vs reference: rel_err {err:.2e}")
    ok = ok and err < 1e-2
  return ok


def check_grouped(rng, kernel_kw):
  """The grouped merge (`merge_tiling.use_grouped`, partials in `merge_tiling.wide_partials`'
  layout) on the plans that take it by default (1 x 128 heads, 8 channels per
  merge CTA; 4 x 64, 16 channels; 8 x 64 at 27 splits, 8 channels), and
  forced on rows of 20-40 splits that would take the per-split ring (128
  heads, and 96: the last head group's real rows alone): the reference
  either way, with float16 partials (stored from registers in column
  slices) and with float32 ones; then the two against each other on the
  same plan: clean in "select", and in "multiply" with NaN tails and null
  block (the same NaNs)."""
  ok = True
  rows8 = [4097, 1000, 9000, 5, 0, 3000, 64, 8000]
  for heads, lens_np, forced, splits in ((128, [9000], False, 40),
                                         (64, [9000, 3000, 0, 9001], False, 40),
                                         (64, rows8, False, 27), (128, rows8, True, 40),
                                         (96, rows8, True, 40)):
    key = jax.random.key(heads + len(lens_np))
    cache = jax.random.normal(key, (400, BS, D), jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 1), (len(lens_np), heads, D), jnp.bfloat16)
    lens = jnp.asarray(lens_np, jnp.int32)
    table = table_for(rng, lens_np, 400, 150)
    cfg = MLADecodeConfig(num_splits=splits, min_chunk_blocks=1, **kernel_kw)
    plan = mla_decode_plan(lens, num_heads=heads, config=cfg)
    run = lambda c, select, **kw: _mla_decode(
        q, c, table, lens, plan, sm_scale=D**-0.5, select=select, interpret=None,
        kv_swizzle=cfg.kv_swizzle, q_regs=cfg.q_regs, grouped=True if forced else None, **kw)
    # Float16 and float32 partials (one of them the default): each against
    # the reference, then against each other.
    clean = {f: run(cache, True, f16_partials=f) for f in (True, False)}
    ro, rl = mla_decode_reference(q, cache, table, lens, sm_scale=D**-0.5)
    if forced:  # where `_mla_decode(grouped=True)` can take it
      taken = merge_tiling.can_group(plan.num_splits)
    else:
      taken = merge_tiling.use_grouped(batch=len(lens_np), head_groups=-(-heads // 64),
                                num_splits=plan.num_splits)
    for f16, (out, lse) in clean.items():
      err, lerr, finite = errors(out, lse, ro, rl)
      print(f"grouped merge: {len(lens_np)} x {heads}, {plan.num_splits} splits, grouped {taken}"
            f"{' (forced)' if forced else ''}, float{16 if f16 else 32} partials: "
            f"rel_err {err:.2e} lse_err {lerr:.2e}")
      ok = ok and taken and err < 1e-2 and lerr < 1e-2 and finite
    same = _close_partials(clean[True], clean[False])
    poisoned = poison_tails(cache, table, lens_np)
    bad16, bad32 = (run(poisoned, False, f16_partials=f) for f in (True, False))
    nans = bool(np.isnan(np.asarray(bad32[0], np.float32)).any())
    same_bad = _close_partials(bad16, bad32)
    print(f"  float16 partials vs float32: clean select {same}, poisoned multiply {same_bad}"
          f" (NaN there: {nans})")
    ok = ok and same and same_bad
  return ok


def check_block_sizes(rng, cfg):
  """Block sizes 32 and 128: the reference, and NaN in every slot no row holds."""
  ok = True
  lens_np = [1, 31, 32, 33, 64, 65, 0, 157, 300]
  lens = jnp.asarray(lens_np, jnp.int32)
  for bs in (32, 128):
    nb = 60 if bs == 32 else 20
    cache = jax.random.normal(jax.random.key(bs), (nb, bs, D), jnp.bfloat16)
    q = jax.random.normal(jax.random.key(bs + 1), (len(lens_np), 64, D), jnp.bfloat16)
    table = table_for(rng, lens_np, nb, -(-300 // bs), bs=bs)
    t_np = np.asarray(table)
    held = np.zeros((nb, bs), bool)
    for b, n in enumerate(lens_np):
      for t in range(n):
        held[t_np[b, t // bs], t % bs] = True
    poisoned = jnp.where(jnp.asarray(held)[..., None], cache, jnp.nan)
    clean, _ = mla_decode(q, cache, table, lens, sm_scale=0.05, config=cfg)
    ro, _ = mla_decode_reference(q, cache, table, lens, sm_scale=0.05)
    err = float(np.linalg.norm(np.asarray(clean, np.float32) - np.asarray(ro, np.float32))
                / np.linalg.norm(np.asarray(ro, np.float32)))
    sel, _ = mla_decode(q, poisoned, table, lens, sm_scale=0.05, config=cfg)
    mul, _ = mla_decode(q, poisoned, table, lens, sm_scale=0.05, mask_mode="multiply", config=cfg)
    nan_rows = np.isnan(np.asarray(mul, np.float32)).any(axis=(1, 2)).tolist()
    want_nan = [n % min(bs, 64) != 0 for n in lens_np]
    same = bool((np.asarray(sel) == np.asarray(clean)).all())
    print(f"block {bs}: rel_err {err:.2e}; select==clean {same}; multiply NaN rows {nan_rows} (want {want_nan})")
    ok = ok and err < 1e-2 and same and nan_rows == want_nan
  return ok


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
    ok = [check_correctness(rng, v, args.check) for v in names]
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
