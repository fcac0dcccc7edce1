"""The on-device checks of sparse MLA decode (`bench_sparse_mla_decode.py`).

Run on the GPU, where the compiled kernels can differ from what the
interpreter tests on the CPU, after the timed shapes (each of which is
compared with the reference there): NaN in slots no index selects ("select"
bit-equal to clean memory, "multiply" NaN in exactly the rows with a -1), ids
outside the cache (bit-equal to -1) and stale stage rows (a -1's stage row is
zero-filled; NaN in data a row reads as valid comes out NaN). Each takes the
bench's arguments, so that it checks every variant the bench times.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kernels.sparse_mla_decode import (
    SparseMLADecodeConfig,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)
from jaxkv.kernels.sparse_mla_decode.config import default_config
from jaxkv.kernels.sparse_mla_decode.plan import (
    merged_after_kernel,
    merges_in_cluster,
    rows_to_cut,
)

NUM_BLOCKS, BLOCK_SIZE, TOPK = 8192, 64, 2048  # a 604 MB cache, far past L2
SCALE = 576**-0.5


def inputs(batch, heads, invalid, seed=0, topk=TOPK):
  kq, kc, ki, km = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (batch, heads, 576), jnp.bfloat16)
  cache = jax.random.normal(kc, (NUM_BLOCKS, BLOCK_SIZE, 576), jnp.bfloat16)
  idx = jax.random.randint(ki, (batch, topk), 1, NUM_BLOCKS * BLOCK_SIZE, jnp.int32)
  if invalid:
    idx = jnp.where(jax.random.uniform(km, idx.shape) < invalid, -1, idx)
  return q, cache, idx


def rel(a, b):
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def same_result(a, b) -> bool:
  """Two `(out, lse)` of one call by different merges: NaN in the same places,
  out within one bf16 rounding of each other (2^-7 relative, or 1e-3 of its
  largest value), lse within 1e-5."""
  (oa, la), (ob, lb) = a, b
  nan_o, nan_l = (np.isnan(oa) != np.isnan(ob)).sum(), (np.isnan(la) != np.isnan(lb)).sum()
  scale = float(np.nanmax(np.abs(ob), initial=0.0))
  same = (not nan_o and not nan_l
          and np.allclose(oa, ob, rtol=2**-7, atol=1e-3 * scale, equal_nan=True)
          and np.allclose(la, lb, rtol=1e-5, atol=1e-5, equal_nan=True))
  if not same:  # where they differ most, for the log
    do, dl = np.nan_to_num(np.abs(oa - ob)), np.nan_to_num(np.abs(la - lb))
    io, il = np.unravel_index(do.argmax(), do.shape), np.unravel_index(dl.argmax(), dl.shape)
    print(f"  differ: NaN in different places {nan_o} (out) {nan_l} (lse); out most at"
          f" {tuple(map(int, io))}: {oa[io]} vs {ob[io]} (scale {scale:.3g}); lse most at"
          f" {tuple(map(int, il))}: {la[il]} vs {lb[il]}; rows past tolerance"
          f" {sorted(set(np.argwhere(~np.isclose(oa, ob, rtol=2**-7, atol=1e-3 * scale, equal_nan=True))[:, 0].tolist()))[:20]}")
  return same


def merged_after(config, batch, heads, topk) -> bool:
  """`config.merged_after_kernel` for a call with `config` at this shape
  (where `f16_partials` applies)."""
  cut = rows_to_cut(config, batch=batch, num_heads=heads, topk=topk)
  return merged_after_kernel(config, cut=cut, in_clusters=merges_in_cluster(
      config, batch=batch, num_heads=heads, cut=cut))


def pallas_config(splits, batch, heads, topk=TOPK, cut_rows=None, pieces=None):
  """The kernel (not the XLA path) with `splits`, or the default split count if
  0, and with one split `cut_rows` (None: the config's; else at most the batch)
  and `pieces` (None: the config's)."""
  if splits:
    config = SparseMLADecodeConfig(num_splits=splits, implementation="pallas")
  else:
    config = dataclasses.replace(default_config(batch=batch, num_heads=heads, topk=topk),
                                 implementation="pallas")
  if config.num_splits == 1:
    if cut_rows is not None:
      config = dataclasses.replace(config, cut_rows=min(cut_rows, batch))
    if pieces is not None:
      config = dataclasses.replace(config, pieces=pieces)
  return config


def _swizzled(config, kv_swizzle):
  """`config` under `kv_swizzle` (None: as it is)."""
  return config if kv_swizzle is None else dataclasses.replace(config, kv_swizzle=kv_swizzle)


def check_variants(args, cut_rows):
  """The checks' base config (16 rows, 64 heads, the bench's `--splits`,
  `--cut-rows` and `--pieces`), the streams they also run with (6 parts,
  whole rows first and not, where `--parts` asks for a count: `(parts,
  stream_whole)` pairs) and the `f16_partials` values they run."""
  base = pallas_config(args.splits, 16, 64, cut_rows=cut_rows, pieces=args.pieces)
  asked = {v.partition("/")[0] for v in args.parts}  # (without "/plain" or "/whole")
  streams = [(6, True), (6, False)] if asked - {"auto", "off"} else []
  f16_checks = [bool(v) for v in args.f16_partials or [base.f16_partials]]
  return base, streams, f16_checks


def check_nan_poisoning(args, cut_rows, kv_swizzle=None) -> bool:
  """NaN in slot 0 and in rows no index selects, with every variant the bench's
  arguments name (each under `kv_swizzle` where given)."""
  ok = True
  # NaN in slot 0 and in rows no index selects: "select" stays clean,
  # "multiply" turns exactly the rows holding a -1 into NaN.
  q, cache, idx = inputs(16, 64, 0.0, seed=1)
  idx = idx.at[1:8, 7].set(-1).at[13, 7].set(-1)
  used = jnp.zeros(NUM_BLOCKS * BLOCK_SIZE, bool).at[jnp.maximum(idx, 0)].set(True)
  rows_flat = cache.reshape(-1, 576)
  poisoned = jnp.where(used.at[0].set(False)[:, None], rows_flat, jnp.nan).reshape(cache.shape)
  base, streams, f16_checks = check_variants(args, cut_rows)
  checks = [(qr, bool(so), None, False, cb, None) for qr in args.q_regs or [base.q_regs]
            for so in args.stage_out or [base.stage_out] for cb in args.combine or [base.combine]]
  checks += [(base.q_regs, so, bool(cm), halves, base.combine, None)
             for cm in args.cluster_merge or []
             for so, halves in ((False, False), (True, False), (True, True))]
  # With a stream asked for, the 16 rows also in 6 parts, by each merge: laid
  # end to end, rows 2, 5 and 13, with -1s, among those cut (at tiles 85, 170
  # and 426 of 32-tile rows); whole rows first (rows 0-11 whole), row 13 cut
  # in two, its -1 in its first piece.
  checks += [(base.q_regs, base.stage_out, None, False, cb, st) for cb in
             (args.combine or [base.combine]) for st in streams]
  checks = [(*c, fp) for c in checks for fp in f16_checks]
  for qr, so, cm, halves, cb, pt, fp in checks:
    # (A staged result needs one split: the check then runs with one; a merge
    # by clusters or not, with 8 splits (staged or not), or with 10 of the 16
    # rows cut in halves, rows 6-7 (with -1s in their first halves) among them.)
    splits = 1 if halves else 8 if cm is not None else 1 if so else base.num_splits
    cfg = dataclasses.replace(base, q_regs=qr, stage_out=so, num_splits=splits,
                              cluster_merge=cm, combine=cb,
                              cut_rows=10 if halves else None if cm is not None else base.cut_rows,
                              pieces=2 if halves else base.pieces)
    if cut_rows and cfg.num_splits == 1 and not halves:  # rows 6-7 (with -1s) among those cut at 10
      cfg = dataclasses.replace(cfg, cut_rows=min(cut_rows, 16), pieces=args.pieces)
    if pt:
      cfg = dataclasses.replace(cfg, num_splits=1, cut_rows=None, pieces=None, parts=pt[0],
                                stream_whole=pt[1])
    cfg = _swizzled(dataclasses.replace(cfg, f16_partials=fp), kv_swizzle)
    if fp != f16_checks[0] and not merged_after(cfg, 16, 64, TOPK):
      continue  # the same call as with the first value
    f = lambda c, m, cfg=cfg: sparse_mla_decode(q, c, idx, sm_scale=SCALE, mask_mode=m, config=cfg)
    clean, _ = f(cache, "select")
    sel, _ = f(poisoned, "select")
    mul, _ = f(poisoned, "multiply")
    nan_rows = np.isnan(np.asarray(mul, np.float32)).any(axis=(1, 2))
    nan_ok = bool((np.asarray(sel) == np.asarray(clean)).all()) and nan_rows.tolist() == [
        False] + [True] * 7 + [False] * 5 + [True] + [False] * 2
    ok &= nan_ok
    print(f"NaN poisoning (q_regs {qr}, kv_swizzle {cfg.kv_swizzle}, stage_out {so},"
          f" cut_rows {cfg.cut_rows},"
          f" pieces {cfg.pieces}, combine {cfg.combine},"
          f" {cfg.num_splits} splits, cluster_merge {cfg.cluster_merge}, parts {cfg.parts},"
          f" stream_whole {cfg.stream_whole}, f16_partials {cfg.f16_partials}):"
          f" select"
          f" bit-equal to clean and"
          f" multiply NaN rows as expected: {nan_ok}")
  return ok


def check_ids_outside_the_cache(args, cut_rows, kv_swizzle=None) -> bool:
  """Ids past the cache or negative, in every mode the bench's arguments name
  (with the stream's 6 parts where `--parts` asks for a count; under
  `kv_swizzle` where given)."""
  ok = True
  _, streams, f16_checks = check_variants(args, cut_rows)
  # Ids outside the cache are invalid exactly as -1 is: bit-equal results in
  # both modes, with the last slot, which a clamp would read, NaN.
  n = NUM_BLOCKS * BLOCK_SIZE
  q, cache, idx = inputs(16, 64, 0.1, seed=2)
  idx = jnp.where(idx == n - 1, 1, idx)
  far = jnp.where(jnp.arange(TOPK) % 3 == 0, n, jnp.where(jnp.arange(TOPK) % 3 == 1, -7, 2**31 - 1))
  odd = jnp.where(idx < 0, far[None, :].astype(jnp.int32), idx)
  poisoned = cache.reshape(-1, 576).at[n - 1].set(jnp.nan).reshape(cache.shape)
  # (With `--cut-rows N`, one split, so that the rows are cut.)
  cfg = pallas_config(args.splits or (1 if cut_rows else 0), 16, 64, cut_rows=cut_rows,
                       pieces=args.pieces)
  cfgs = [cfg] + [SparseMLADecodeConfig(parts=pt, stream_whole=sw) for pt, sw in streams]
  cfgs = [_swizzled(dataclasses.replace(c, f16_partials=fp), kv_swizzle)
          for c in cfgs for fp in f16_checks
          if fp == f16_checks[0] or merged_after(c, 16, 64, TOPK)]
  for cfg in cfgs:
    for mode in args.modes:
      f = lambda i, mode=mode, cfg=cfg: sparse_mla_decode(q, poisoned, i, sm_scale=SCALE,
                                                          mask_mode=mode, config=cfg)
      same = all(bool((np.asarray(a) == np.asarray(b)).all()) for a, b in zip(f(odd), f(idx)))
      ok &= same
      print(f"ids outside the cache ({mode}, kv_swizzle {cfg.kv_swizzle},"
            f" {cfg.num_splits} splits, cut_rows {cfg.cut_rows},"
            f" pieces {cfg.pieces}, parts {cfg.parts}, stream_whole {cfg.stream_whole},"
            f" f16_partials {cfg.f16_partials}):"
            f" bit-equal to -1: {same}")
  return ok


def check_stale_stage_rows(args, cut_rows, kv_swizzle=None) -> bool:
  """Stale stage rows and NaN data in 6 parts (whole rows first and not), in
  every mode and `f16_partials` value the bench's arguments name (under
  `kv_swizzle` where given)."""
  ok = True
  _, _, f16_checks = check_variants(args, cut_rows)
  # A -1's stage row is zero-filled, never what an earlier tile left there:
  # in 6 parts, row 0 selects a NaN slot at position 5 of its second-to-last
  # tile (no later tile of its own overwrites it, and its staged result goes
  # to the other stage) and rows 1-15 have a -1 there in every tile; they
  # must be the reference's. NaN in data a row reads as valid is data: row 0
  # (a whole row) comes out NaN at every head, out and LSE, and so does head 5
  # of rows 2 and 13, whose query holds a NaN (cut in two and merged: laid
  # end to end, row 2 at tile 85 and row 13 at 426; whole rows first, row 13).
  q, cache, idx = inputs(16, 64, 0.0, seed=3)
  q = q.at[2, 5, 100].set(jnp.nan).at[13, 5, 100].set(jnp.nan)
  nan_slot = int(idx[0, TOPK - 128 + 5])
  rest = jnp.where(idx[1:] == nan_slot, 1 + nan_slot % 7, idx[1:]).at[:, 5::64].set(-1)
  idx = idx.at[1:].set(rest)
  cache = cache.reshape(-1, 576).at[nan_slot].set(jnp.nan).reshape(cache.shape)
  want_nan = np.zeros((16, 64), bool)
  want_nan[0], want_nan[2, 5], want_nan[13, 5] = True, True, True
  nan_heads = lambda x: np.isnan(np.asarray(x, np.float32)).reshape(16, 64, -1)
  for fp, whole in ((fp, whole) for fp in f16_checks for whole in (True, False)):
    for mode in args.modes:
      cfg = _swizzled(SparseMLADecodeConfig(parts=6, f16_partials=fp, stream_whole=whole),
                      kv_swizzle)
      out, lse = jax.block_until_ready(
          sparse_mla_decode(q, cache, idx, sm_scale=SCALE, mask_mode=mode, config=cfg))
      ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE,
                                                     mask_mode=mode)
      fin = ~want_nan
      clean = (bool(jnp.isfinite(out[fin]).all()) and rel(out[fin], ref_out[fin]) < 1e-2
               and rel(lse[fin], ref_lse[fin]) < 1e-4)
      nans = all((nan_heads(x).all(-1) == want_nan).all() and (nan_heads(x).any(-1) == want_nan).all()
                 for x in (out, lse, ref_out, ref_lse))
      ok &= clean and nans
      print(f"stale stage rows ({mode}, kv_swizzle {cfg.kv_swizzle}, parts 6, stream_whole"
            f" {whole}, f16_partials {fp}): the other heads the reference's: {clean}; NaN data"
            f" NaN at exactly row 0 and rows 2 and 13's head 5: {nans}")
  return ok
