"""The on-device correctness check of dense MLA decode (`bench_mla_decode.py --check`).

Run before the timings on the GPU, where the compiled kernels can differ from
what the interpreter tests on the CPU: each part compares the kernels with the
jnp reference, or a variant with the default, on random data with NaN where
no row may read (`CHECKS` names the parts).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kernels.mla_decode import (
    MLADecodeConfig,
    mla_decode,
    mla_decode_plan,
    mla_decode_reference,
)
from jaxkv.kernels.mla_decode import merge_tiling
from jaxkv.kernels.mla_decode import packed_merge
from jaxkv.kernels.mla_decode.config import default_config
from jaxkv.kernels.mla_decode.wrapper import _mla_decode

BS = 64
D = 576


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


def errors(out, lse, ref_out, ref_lse):
  """(relative error of out, largest LSE error where the reference is finite,
  whether out is finite) against the reference's results."""
  o32, r32 = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
  err = np.linalg.norm(o32 - r32) / np.linalg.norm(r32)
  lerr = np.nanmax(np.abs(np.where(np.isinf(ref_lse), 0, np.asarray(lse) - np.asarray(ref_lse))))
  return err, lerr, bool(np.isfinite(o32).all())


def layout_for(heads, batch, kernel_kw=None):
  """The kernel layout (`kv_swizzle`, `q_regs`) that this device's default
  config takes for `batch` rows of `heads` heads, with `kernel_kw`'s fields
  on top: the check runs the layout the calls run (the config's own
  defaults are the 64-byte base layout, which the default configs no longer
  take), and a variant changes only what it names."""
  base = default_config(batch=batch, num_heads=heads)
  return {"kv_swizzle": base.kv_swizzle, "q_regs": base.q_regs, **(kernel_kw or {})}


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
CHECKS = ("basic", "block_sizes", "grouped", "halves", "rolled", "outside", "nan_data", "same")


def check_correctness(rng, variant="default", kernel_kw=None, parts=CHECKS):
  """The `parts` of the check (`CHECKS` but "same", `check_same_result`)
  for `variant`'s config: at each head count the device's default layout
  (`layout_for`) with `kernel_kw`'s fields."""
  kernel_kw = kernel_kw or {}
  print(f"variant {variant}: {kernel_kw} over the default layout (64 heads:"
        f" {layout_for(64, 8)}; 128 heads: {layout_for(128, 8)})")
  # (Block sizes, 9 rows, and blocks outside the cache, 4 rows: 64 heads,
  # under the layout picked for 8 rows; no shipped tuning file gives batches
  # of one head count different layouts.)
  cfg = MLADecodeConfig(num_splits=2, min_chunk_blocks=1, **layout_for(64, 8, kernel_kw))
  from check_grouped_merge import HALVES_CASES, ROLLED_CASES, check_grouped, check_halves

  checks = dict(
      basic=lambda: check_basic(rng, kernel_kw),
      block_sizes=lambda: check_block_sizes(rng, cfg),
      grouped=lambda: check_grouped(rng, kernel_kw),
      halves=lambda: check_halves(rng, kernel_kw, HALVES_CASES),
      rolled=lambda: check_halves(rng, kernel_kw, ROLLED_CASES),
      outside=lambda: check_blocks_outside_the_cache(rng, cfg),
      nan_data=lambda: check_nan_in_valid_data(rng, kernel_kw),
  )
  results = []
  for name in parts:
    if name in checks:
      start = time.perf_counter()
      results.append(checks[name]())
      # Each part's seconds, compiles included: one device command has 10
      # minutes, and the whole check takes most of them on a cold machine.
      print(f"  (check part {name!r}: {time.perf_counter() - start:.0f} s)", flush=True)
  return all(results)


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
    cfg = MLADecodeConfig(num_splits=splits, min_chunk_blocks=1,
                          **layout_for(heads, 8, kernel_kw))
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
  cfg = MLADecodeConfig(num_splits=2, min_chunk_blocks=1,
                        **layout_for(64, len(lens_np), kernel_kw))
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
    cfg = MLADecodeConfig(num_splits=splits, min_chunk_blocks=1,
                          **layout_for(heads, 3, kernel_kw))
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
# "padded" and "mdirect" (which never stack: the stacked merge stages its
# output) bit for bit against "nopack".
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


# `check_same_result`'s cases: (heads, kv_swizzle, q_regs, SMs of the plan,
# splits) over the same ten rows (up to 4,097 tokens).
# - 16 and 96 heads: the query unpadded and, on 24 SMs' plan (more parts
#   than rows: no rows finished in the kernel), the result stored by the
#   merge at its own heads ("padded" pads and slices in XLA instead); at 16
#   heads the stacked merge (`packed_merge`) of 4 and of 12 splits.
# - The last: 64 splits on 100 SMs' plan, the 4097-token row cut past 32
#   splits, so the per-split ring merges in two passes.
# - 64 and 128 heads run the default layouts (128-byte swizzle; 128 query
#   channels in registers at two head groups); 96 heads and the last case
#   the 64-byte one.
SAME_CASES = ((64, 128, 0, 6, 4), (128, 128, 128, 6, 4), (16, 128, 0, 24, 4),
              (16, 128, 0, 24, 12), (96, 64, 128, 24, 4), (64, 64, 0, 100, 64))


def check_same_result(rng, names, cases=SAME_CASES):
  """The `SAME_RESULT` variants in `names` (P fenced on every hand-off, the
  merge's output from registers, the query padded in XLA, rows of few heads
  merged one per CTA, the partials' dtype; see `ROUNDING_ONLY` and
  `PARTIAL_ROUNDING`): bit-identical to the default (or to "nopack", or
  within the rounding those name) on parts of several segments, clean and
  with NaN tails and null block in both modes, for each of `cases`; the
  default against the reference."""
  ok = True
  lens_np = [64, 65, 0, 127, 300, 257, 1000, 4097, 5, 2000]
  lens = jnp.asarray(lens_np, jnp.int32)
  for heads, sw, qr, sms, splits in cases:
    cache = jax.random.normal(jax.random.key(heads), (200, BS, D), jnp.bfloat16)
    q = jax.random.normal(jax.random.key(heads + 1), (len(lens_np), heads, D), jnp.bfloat16)
    table = table_for(rng, lens_np, 200, 70)
    poisoned = poison_tails(cache, table, lens_np)
    cfg = MLADecodeConfig(num_splits=splits, min_chunk_blocks=1, kv_swizzle=sw, q_regs=qr)
    plan = mla_decode_plan(lens, num_heads=heads, config=cfg, num_sms=sms)
    two = plan.num_splits > merge_tiling.MAX_SPLITS
    stacks = packed_merge.rows_stack(heads=heads, num_splits=plan.num_splits)
    print(f"{heads} heads, sw{sw}, q_regs {qr}, {sms} SMs' plan: {plan.num_splits} splits"
          f"{' (two passes of the per-split ring)' if two else ''}")
    run = lambda c, select, **kw: _mla_decode(q, c, table, lens, plan, sm_scale=D**-0.5, select=select,
                                              interpret=None, kv_swizzle=sw, q_regs=qr, **kw)
    for c, name in ((cache, "clean"), (poisoned, "poisoned")):
      for select in (True, False):
        default = [np.asarray(x) for x in run(c, select)]
        # "nopack"'s result, which "padded" and "mdirect" are compared with
        # too: run once, and only where rows stack (elsewhere `pack` changes
        # nothing, and it is the default's own).
        unpacked = default
        if stacks and {"nopack", "padded", "mdirect"} & set(names):
          unpacked = [np.asarray(x) for x in run(c, select, **SAME_RESULT["nopack"])]
        for v in names:
          if v == "nopack":
            got = unpacked
          else:
            got = [np.asarray(x) for x in run(c, select, **SAME_RESULT[v])]
          if v in PARTIAL_ROUNDING:
            same, how = _close_partials(got, default), "within float16 partials' rounding"
          elif v in ROUNDING_ONLY:
            same, how = _close(got, default), ("within rounding" if stacks else
                                               "the default's own (no rows stack)")
          else:
            to_unpacked = v in ("padded", "mdirect")
            want = unpacked if to_unpacked else default
            same = all(np.array_equal(g, w, equal_nan=True) for g, w in zip(got, want))
            how = "identical to nopack" if to_unpacked else "identical"
          print(f"{v}: {heads} heads sw{sw} {name} {'select' if select else 'multiply'}: {how} {same}")
          ok = ok and same
    ro, rl = mla_decode_reference(q, cache, table, lens, sm_scale=D**-0.5)
    err, _, _ = errors(*run(poisoned, True), ro, rl)
    print(f"default, poisoned select vs reference: rel_err {err:.2e}")
    ok = ok and err < 1e-2
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
