"""The on-device check of dense MLA decode's grouped merge (`check_mla_decode.py`'s
"grouped", "halves" and "rolled" parts): the rows of many splits that take it by
default or forced, in halves and its loops' variants, against the reference and
the default merge, clean and poisoned.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kernels.mla_decode import MLADecodeConfig, mla_decode_plan, mla_decode_reference
from jaxkv.kernels.mla_decode import merge_tiling
from jaxkv.kernels.mla_decode.wrapper import _mla_decode

from check_mla_decode import BS, D, _close_partials, errors, layout_for, poison_tails, table_for


def _split_problem(rng, seed, heads, lens_np, splits, kernel_kw, *, max_blocks):
  """A random query and 400-block cache (from `seed`), the rows' lengths and
  block table, and a config of `splits` splits (the default layout with
  `kernel_kw`'s fields, `layout_for`) with its plan."""
  key = jax.random.key(seed)
  cache = jax.random.normal(key, (400, BS, D), jnp.bfloat16)
  q = jax.random.normal(jax.random.fold_in(key, 1), (len(lens_np), heads, D), jnp.bfloat16)
  lens = jnp.asarray(lens_np, jnp.int32)
  table = table_for(rng, lens_np, 400, max_blocks)
  cfg = MLADecodeConfig(num_splits=splits, min_chunk_blocks=1,
                        **layout_for(heads, len(lens_np), kernel_kw))
  return q, cache, lens, table, cfg, mla_decode_plan(lens, num_heads=heads, config=cfg)


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
    q, cache, lens, table, cfg, plan = _split_problem(
        rng, heads + len(lens_np), heads, lens_np, splits, kernel_kw, max_blocks=150)
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



# (heads, lengths, splits, the variant's `_mla_decode` arguments) of the
# "halves" and "rolled" checks.
HALVES = dict(grouped=True, group_halves=True)
HALVES_CASES = ((64, [20000], 133, dict(grouped=False)), (40, [9000], 40, HALVES),
                (64, [12000, 9001], 101, HALVES))
ROLLED_CASES = ((64, [20000], 133, dict(HALVES, f16_partials=False)),
                (64, [12000, 9001], 101, dict(f16_partials=False)),
                (64, [20000], 133, dict(merge_lean=False)),
                (64, [12000, 9001], 101, dict(merge_lean=False)),
                (128, [9000], 40, dict(merge_lean=False)))


def check_halves(rng, kernel_kw, cases):
  """The grouped merge in halves (two CTAs per tile in a cluster, the second's
  sums handed on through GMEM at `barrier.cluster`; the default past one
  CTA's 128 splits, forced elsewhere) and its loops' variants, at `cases`:
  `HALVES_CASES` the default at 1 x 64, 133 splits (halves, past one CTA's
  grouped merge) against the per-split ring's two passes (the variant
  here), and halves forced at 1 x 40 heads, 40 splits (the last head group's
  real rows) and 2 x 64, 101 splits (two CTAs an SM); `ROLLED_CASES` float32
  partials at 1 x 64 in halves and 2 x 64 (the default is float16), and the
  loops as first timed (`merge_lean=False`) at 1 x 64, 2 x 64 and 1 x 128.
  Each against the reference, and against the default merge on the same
  plan: clean in
  "select" (poisoned "select" the same bits as clean) and poisoned in
  "multiply" (the same NaNs)."""
  ok = True
  for heads, lens_np, splits, variant in cases:
    q, cache, lens, table, cfg, plan = _split_problem(
        rng, heads + splits, heads, lens_np, splits, kernel_kw, max_blocks=320)
    run = lambda c, select, with_variant: _mla_decode(
        q, c, table, lens, plan, sm_scale=D**-0.5, select=select, interpret=None,
        kv_swizzle=cfg.kv_swizzle, q_regs=cfg.q_regs, **(variant if with_variant else {}))
    # The variant's merge can run: the per-split ring always; the grouped
    # pass up to its splits (in halves forced, or by default past one CTA's).
    halves = variant.get("group_halves") or plan.num_splits > merge_tiling.GROUP_MAX_SPLITS
    taken = variant.get("grouped") is False or merge_tiling.can_group(plan.num_splits,
                                                                      bool(halves))
    out, lse = run(cache, True, True)
    ro, rl = mla_decode_reference(q, cache, table, lens, sm_scale=D**-0.5)
    err, lerr, finite = errors(out, lse, ro, rl)
    poisoned = poison_tails(cache, table, lens_np)
    same_clean = _close_partials((out, lse), run(cache, True, False))
    bad = run(poisoned, True, True)
    same_bits = all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   equal_nan=True) for a, b in zip(bad, (out, lse)))
    mul, mul_without = run(poisoned, False, True), run(poisoned, False, False)
    nans = bool(np.isnan(np.asarray(mul[0], np.float32)).any())
    same_mul = _close_partials(mul, mul_without)
    print(f"grouped merge {variant}: {len(lens_np)} x {heads}, {plan.num_splits} splits,"
          f" taken {taken}: rel_err {err:.2e} lse_err {lerr:.2e};"
          f" against the default: clean select {same_clean}, poisoned multiply {same_mul}"
          f" (NaN there: {nans}); poisoned select the clean bits {same_bits}")
    ok = ok and taken and err < 1e-2 and lerr < 1e-2 and finite and same_clean and same_bits
    ok = ok and same_mul and nans
  return ok
