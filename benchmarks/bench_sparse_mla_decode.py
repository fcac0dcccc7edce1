"""Sparse (top-k) MLA decode on the GPU: checks against the reference, then times it.

Prints, per shape and mask mode, the call's time and its decode kernel's alone
(the rest is XLA's: the combine of split partials), TB/s over the bytes it
must move (every selected row once, plus q and out), TFLOP/s, and the ratios
against two figures measured in the same run: an XLA gather of the same rows
fused with a sum (the gather ceiling) and the XLA reference (gather + einsum).

  python benchmarks/bench_sparse_mla_decode.py [--quick] [--splits N] [--q-regs Q ...]
      [--shapes B:H[:TOPK[:INVALID]] ...] [--modes select multiply] [--stage-out 0 1]
      [--pad-heads 0 1] [--cut-rows auto|off|N] [--pieces P] [--cluster-merge 0 1]
      [--combine kernel xla] [--parts auto|off|N ...] [--f16-partials 0 1]

With several `--q-regs` values each shape runs every one in the same run (the
query's latent channels the consumers hold in registers,
`SparseMLADecodeConfig.q_regs`), and the NaN check runs each. `--pad-heads 1`
also times each variant with the query padded to 64 heads per group in XLA and
the result sliced (the build before the unpadded query, for fewer heads than a
head group), and compares its result bitwise with the unpadded one's.
`--cut-rows` sets `SparseMLADecodeConfig.cut_rows` on every one-split
config, the NaN checks' included: "auto" (the default config's: rows cut
where one CTA per row overruns a wave, `plan.wave_plan`), "off" (0), or N
rows (at most the batch); `--pieces` sets `SparseMLADecodeConfig.pieces`
likewise (the pieces of a cut row). `--cluster-merge` times each variant with
`SparseMLADecodeConfig.cluster_merge` set to each value (splits, or the
halves of cut rows, merged by the kernel's clusters, or by the combine kernel
after it; the default: the config's), compares the two results (within a
bf16 rounding of each other, NaN in the same places), and runs the NaN check
with each, at 8 splits and with 10 of 16 rows cut in halves. (`--pad-heads`
variants cut no rows.) `--combine` times each variant whose partials no cluster
merges with `SparseMLADecodeConfig.combine` set to each value (the merge
kernel or XLA's combine), compares the two results likewise, and runs the NaN
check with each. `--parts` times each one-split variant with
`SparseMLADecodeConfig.parts` set to each value: "auto" (the plan's choice),
"off" (0: no stream schedule) or N parts per head group ("sms": the
device's SMs over the head groups); a stream's result is compared with the
first variant's (within a bf16 rounding, NaN in the same places), and the NaN
and outside-the-cache checks also run with the rows streamed in 6 parts.
`--f16-partials` times each variant whose partials a merge after the kernel
reads with `SparseMLADecodeConfig.f16_partials` set to each value, compares
the float16 partials' result with the float32 ones' (within a bf16
rounding, NaN in the same places), and runs the NaN and outside-the-cache
checks with each.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu.profiler import measure

from jaxkv.kernels.sparse_mla_decode import (
    SparseMLADecodeConfig,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)
from jaxkv.kernels.sparse_mla_decode.config import CLUSTER_SPLITS, default_config
from jaxkv.kernels.sparse_mla_decode.plan import (
    halves_pair_up,
    merged_after_kernel,
    merges_in_cluster,
    rows_to_cut,
)
from jaxkv.kernels._common import num_sms
from jaxkv.kernels.sparse_mla_decode.wrapper import _sparse_mla_decode

NUM_BLOCKS, BLOCK_SIZE, TOPK = 8192, 64, 2048  # a 604 MB cache, far past L2
SCALE = 576**-0.5
ITERS = 10


def _time(fn, *args) -> float:
  """Median over ITERS of the summed CUPTI kernel times of one call, in s."""
  return _time_parts(fn, *args)[0]


def _time_parts(fn, *args) -> tuple[float, float]:
  """`_time`'s figure and, in the same iteration, the decode kernel's own time (s).

  The rest of a call is the merge of split or piece partials (the merge
  kernel's or XLA's), and XLA's pads and slices.
  """
  _, times = measure(fn, aggregate=False, iterations=ITERS)(*args)
  per_iter = [(sum(ms for _, ms in it),
               sum(ms for name, ms in it if "jaxkv_sparse" in name and "merge" not in name))
              for it in times]
  total, kernel = sorted(per_iter)[len(per_iter) // 2]
  return total * 1e-3, kernel * 1e-3


def _inputs(batch, heads, invalid, seed=0, topk=TOPK):
  kq, kc, ki, km = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (batch, heads, 576), jnp.bfloat16)
  cache = jax.random.normal(kc, (NUM_BLOCKS, BLOCK_SIZE, 576), jnp.bfloat16)
  idx = jax.random.randint(ki, (batch, topk), 1, NUM_BLOCKS * BLOCK_SIZE, jnp.int32)
  if invalid:
    idx = jnp.where(jax.random.uniform(km, idx.shape) < invalid, -1, idx)
  return q, cache, idx


def _rel(a, b):
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _same_result(a, b) -> bool:
  """Two `(out, lse)` of one call by different merges: NaN in the same places,
  out within one bf16 rounding of each other (2^-7 relative, or 1e-3 of its
  largest value), lse within 1e-5."""
  (oa, la), (ob, lb) = a, b
  if not ((np.isnan(oa) == np.isnan(ob)).all() and (np.isnan(la) == np.isnan(lb)).all()):
    return False
  scale = float(np.nanmax(np.abs(ob), initial=0.0))
  return (np.allclose(oa, ob, rtol=2**-7, atol=1e-3 * scale, equal_nan=True)
          and np.allclose(la, lb, rtol=1e-5, atol=1e-5, equal_nan=True))


def _merged_after(config, batch, heads, topk) -> bool:
  """`config.merged_after_kernel` for a call with `config` at this shape
  (where `f16_partials` applies)."""
  cut = rows_to_cut(config, batch=batch, num_heads=heads, topk=topk)
  return merged_after_kernel(config, cut=cut, in_clusters=merges_in_cluster(
      config, batch=batch, num_heads=heads, cut=cut))


def _pallas_config(splits, batch, heads, topk=TOPK, cut_rows=None, pieces=None):
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


def _parts(value: str, heads: int) -> int | None:
  """`--parts`' value: None (the plan's), 0 (off) or a count of parts."""
  if value == "auto":
    return None
  if value == "off":
    return 0
  if value == "sms":
    return num_sms() // -(-heads // 64)
  return int(value)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--splits", type=int, default=0, help="0: default config")
  parser.add_argument("--q-regs", type=int, nargs="+", default=None,
                      help="time the kernel with each of these q_regs (default: the config's)")
  parser.add_argument("--shapes", nargs="+", default=None,
                      help="B:H[:TOPK[:INVALID]] instead of the default shapes (TOPK 2048, "
                      "INVALID the fraction of -1 indices, 0)")
  parser.add_argument("--modes", nargs="+", default=["select", "multiply"],
                      choices=["select", "multiply"])
  parser.add_argument("--stage-out", type=int, nargs="+", default=None, choices=[0, 1],
                      help="time the kernel with each of these `stage_out` settings (default: "
                      "the config's); each staged result is compared bitwise with the direct "
                      "stores' of the same run")
  parser.add_argument("--pad-heads", type=int, nargs="+", default=[0], choices=[0, 1],
                      help="time each variant with the query padded in XLA (1) and unpadded (0)")
  parser.add_argument("--cut-rows", default="auto",
                      help="auto (the config's), off, or N rows cut into pieces (one split)")
  parser.add_argument("--pieces", type=int, default=None,
                      help="pieces of each cut row (one split; default: the config's)")
  parser.add_argument("--cluster-merge", type=int, nargs="+", default=None, choices=[0, 1],
                      help="time each variant with the splits merged by the kernel's clusters"
                      " (1) and by the combine kernel (0) (default: the config's)")
  parser.add_argument("--parts", nargs="+", default=["auto"],
                      help="time each one-split variant with the stream schedule's parts per"
                      " head group set to each: auto (the plan's), off, sms, or N")
  parser.add_argument("--combine", nargs="+", default=None, choices=["kernel", "xla"],
                      help="time each variant with split or piece partials merged by the"
                      " merge kernel and by XLA (default: the config's)")
  parser.add_argument("--f16-partials", type=int, nargs="+", default=None, choices=[0, 1],
                      help="time each variant whose partials are merged after the kernel with"
                      " float32 (0) and float16 (1) partials (default: the config's)")
  args = parser.parse_args(argv)
  cut_rows = {"auto": None, "off": 0}.get(args.cut_rows)
  if cut_rows is None and args.cut_rows != "auto":
    cut_rows = int(args.cut_rows)
  shapes = [(128, 64, TOPK, 0.0), (128, 128, TOPK, 0.0), (64, 64, TOPK, 0.0),
            (128, 64, TOPK, 0.25)]
  if args.shapes:
    shapes = []
    for spec in args.shapes:
      fields = spec.split(":")
      if not 2 <= len(fields) <= 4:
        parser.error(f"--shapes {spec!r}: expected B:H[:TOPK[:INVALID]]")
      shapes.append((int(fields[0]), int(fields[1]),
                     int(fields[2]) if len(fields) > 2 else TOPK,
                     float(fields[3]) if len(fields) > 3 else 0.0))
  if args.quick:
    shapes = shapes[:1]
  rows = []
  ok = True
  for batch, heads, topk, invalid in shapes:
    q, cache, idx = _inputs(batch, heads, invalid, topk=topk)
    cfg = _pallas_config(args.splits, batch, heads, topk, cut_rows, args.pieces)
    n_valid = int((idx >= 0).sum())
    kv_bytes = n_valid * 576 * 2
    io_bytes = q.size * 2 + batch * heads * 512 * 2
    flops = 2 * heads * n_valid * (576 + 512)
    ref = jax.jit(lambda q, c, i: sparse_mla_decode_reference(q, c, i, sm_scale=SCALE))
    ref_out, ref_lse = ref(q, cache, idx)
    ceil = jax.jit(lambda c, i: jnp.sum(
        c.reshape(-1, 576)[jnp.maximum(i, 0)], axis=1, dtype=jnp.float32))
    t_ceil = _time(ceil, cache, idx)
    t_ref = _time(ref, q, cache, idx)
    q_regs = args.q_regs or [cfg.q_regs]
    stage_out = [bool(v) for v in args.stage_out] if args.stage_out else [cfg.stage_out]
    pads = sorted({bool(v) for v in args.pad_heads})
    merges = [None]
    cut = rows_to_cut(cfg, batch=batch, num_heads=heads, topk=topk)
    pairs = halves_pair_up(batch=batch, cut_rows=cut.rows, pieces=cut.pieces)
    if args.cluster_merge and (cfg.num_splits in CLUSTER_SPLITS or pairs):
      merges = [bool(v) for v in args.cluster_merge]
    combines = [cfg.combine]
    in_clusters = merges_in_cluster(cfg, batch=batch, num_heads=heads, cut=cut)
    if args.combine and (cfg.num_splits > 1 or cut.rows) and not in_clusters:
      combines = args.combine
    parts = [None]
    if cfg.num_splits == 1 and cfg.cut_rows is None and cfg.cluster_merge is None:
      parts = [_parts(v, heads) for v in args.parts]
    f16s = [cfg.f16_partials] if args.f16_partials is None else [
        bool(v) for v in args.f16_partials]
    variants = [(mode, qr, so, ph, cm, cb, pt, fp) for so in stage_out for qr in q_regs
                for mode in args.modes for ph in pads for cm in merges for cb in combines
                for pt in parts for fp in f16s]
    outs = {}
    for mode, qr, so, ph, cm, cb, pt, fp in variants:
      vcfg = dataclasses.replace(cfg, q_regs=qr, stage_out=so, cluster_merge=cm, combine=cb,
                                 parts=pt, f16_partials=fp)
      if pt and pt > batch:
        continue
      if fp != f16s[0] and (ph or not _merged_after(vcfg, batch, heads, topk)):
        continue  # no partials for a merge after the kernel: the same call
      if ph:
        fn = jax.jit(lambda q, c, i, mode=mode, vcfg=vcfg: _sparse_mla_decode(
            q, c, i, sm_scale=SCALE, select=mode == "select", num_splits=vcfg.num_splits,
            interpret=None, q_regs=vcfg.q_regs, stage_out=vcfg.stage_out, pad_heads=True,
            cluster_merge=merges_in_cluster(vcfg, batch=batch, num_heads=heads),
            xla_combine=cb == "xla"))
      else:
        fn = jax.jit(lambda q, c, i, mode=mode, vcfg=vcfg: sparse_mla_decode(
            q, c, i, sm_scale=SCALE, mask_mode=mode, config=vcfg))
      out, lse = fn(q, cache, idx)
      e_out, e_lse = _rel(out, ref_out), _rel(lse, ref_lse)
      good = e_out < 1e-2 and e_lse < 1e-4 and bool(jnp.isfinite(out).all())
      if fp != f16s[0]:
        close = _same_result((np.asarray(out, np.float32), np.asarray(lse)),
                             outs[mode, qr, so, ph, cm, cb, pt, f16s[0]])
        print(f"b{batch} h{heads} {mode} parts {pt}: float16 partials {fp} and {f16s[0]}:"
              f" results agree: {close}", flush=True)
        good &= close
      outs[mode, qr, so, ph, cm, cb, pt, fp] = (np.asarray(out, np.float32), np.asarray(lse))
      if fp != f16s[0]:
        pass  # (compared with its float32 partials' result above)
      elif pt != parts[0]:
        close = _same_result((np.asarray(out, np.float32), np.asarray(lse)),
                             outs[mode, qr, so, ph, cm, cb])
        print(f"b{batch} h{heads} {mode} parts {pt} and {parts[0]}: results agree: {close}",
              flush=True)
        good &= close
        cut_pt = rows_to_cut(vcfg, batch=batch, num_heads=heads, topk=topk)
        print(f"b{batch} h{heads} parts {pt}: {cut_pt}", flush=True)
      else:
        outs[mode, qr, so, ph, cm, cb] = (np.asarray(out, np.float32), np.asarray(lse))
      # (The comparisons below are of the first parts' and partials' results.)
      first = pt == parts[0] and fp == f16s[0]
      if first and cm is not None and (mode, qr, so, ph, not cm, cb) in outs:
        close = _same_result(outs[mode, qr, so, ph, cm, cb], outs[mode, qr, so, ph, not cm, cb])
        print(f"b{batch} h{heads} {mode} q_regs {qr}: cluster merge and combine kernel"
              f" agree: {close}", flush=True)
        good &= close
      if first and cb == "xla" and (mode, qr, so, ph, cm, "kernel") in outs:
        close = _same_result(outs[mode, qr, so, ph, cm, cb], outs[mode, qr, so, ph, cm, "kernel"])
        print(f"b{batch} h{heads} {mode} q_regs {qr}: merge kernel and XLA combine"
              f" agree: {close}", flush=True)
        good &= close
      if first and so and not ph and (mode, qr, False, False, cm, cb) in outs:
        same = all((a == b).all() for a, b in zip(outs[mode, qr, so, ph, cm, cb],
                                                   outs[mode, qr, False, ph, cm, cb]))
        print(f"b{batch} h{heads} {mode} q_regs {qr} cluster merge {cm}: staged result"
              f" bit-equal to direct stores: {same}", flush=True)
        good &= same
      if first and ph:
        same = all((a == b).all() for a, b in zip(outs[mode, qr, so, ph, cm, cb],
                                                   outs[mode, qr, so, False, cm, cb]))
        print(f"b{batch} h{heads} {mode} q_regs {qr} stage_out {so}: padded query's result"
              f" bit-equal to the unpadded one's: {same}", flush=True)
        good &= same
      ok &= good
      t, t_kernel = _time_parts(fn, q, cache, idx)
      rows.append((batch, heads, topk, invalid,
                   f"{mode}/qr{qr}{'/so' if so else ''}{'/pad' if ph else ''}"
                   f"{'' if cm is None else '/cm' if cm else '/xc'}"
                   f"{'/xla' if cb == 'xla' and len(combines) > 1 else ''}"
                   f"{'' if len(parts) == 1 else f'/p{pt}'}"
                   f"{'/f16p' if fp and len(f16s) > 1 else ''}", t * 1e6,
                   t_kernel * 1e6,
                   (kv_bytes + io_bytes) / t / 1e12,
                   flops / t / 1e12, kv_bytes / t_ceil / 1e12, t_ceil / t, t_ref / t,
                   e_out, good))
    print(f"b{batch} h{heads} topk{topk} inv{invalid}: {cfg.num_splits} splits,"
          f" {cut.rows} rows cut into {cut.pieces} pieces, {cut.parts} parts, merge in clusters"
          f" {merges_in_cluster(cfg, batch=batch, num_heads=heads, cut=cut)}, ceiling"
          f" {kv_bytes / t_ceil / 1e12:.2f} TB/s, XLA reference {t_ref * 1e6:.0f} us", flush=True)

  # NaN in slot 0 and in rows no index selects: "select" stays clean,
  # "multiply" turns exactly the rows holding a -1 into NaN.
  q, cache, idx = _inputs(16, 64, 0.0, seed=1)
  idx = idx.at[1:8, 7].set(-1)
  used = jnp.zeros(NUM_BLOCKS * BLOCK_SIZE, bool).at[jnp.maximum(idx, 0)].set(True)
  rows_flat = cache.reshape(-1, 576)
  poisoned = jnp.where(used.at[0].set(False)[:, None], rows_flat, jnp.nan).reshape(cache.shape)
  base = _pallas_config(args.splits, 16, 64, cut_rows=cut_rows, pieces=args.pieces)
  checks = [(qr, bool(so), None, False, cb, None) for qr in args.q_regs or [base.q_regs]
            for so in args.stage_out or [base.stage_out] for cb in args.combine or [base.combine]]
  checks += [(base.q_regs, so, bool(cm), halves, base.combine, None)
             for cm in args.cluster_merge or []
             for so, halves in ((False, False), (True, False), (True, True))]
  # With a stream asked for, the 16 rows also in 6 parts (rows 2 and 5, with
  # -1s, among those cut: at tiles 85 and 170 of 32-tile rows), by each merge.
  streams = [6] if any(v not in ("auto", "off") for v in args.parts) else []
  checks += [(base.q_regs, base.stage_out, None, False, cb, 6) for cb in
             (args.combine or [base.combine]) for _ in streams]
  f16_checks = [bool(v) for v in args.f16_partials or [base.f16_partials]]
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
      cfg = dataclasses.replace(cfg, num_splits=1, cut_rows=None, pieces=None, parts=pt)
    cfg = dataclasses.replace(cfg, f16_partials=fp)
    if fp != f16_checks[0] and not _merged_after(cfg, 16, 64, TOPK):
      continue  # the same call as with the first value
    f = lambda c, m, cfg=cfg: sparse_mla_decode(q, c, idx, sm_scale=SCALE, mask_mode=m, config=cfg)
    clean, _ = f(cache, "select")
    sel, _ = f(poisoned, "select")
    mul, _ = f(poisoned, "multiply")
    nan_rows = np.isnan(np.asarray(mul, np.float32)).any(axis=(1, 2))
    nan_ok = bool((np.asarray(sel) == np.asarray(clean)).all()) and nan_rows.tolist() == [
        False] + [True] * 7 + [False] * 8
    ok &= nan_ok
    print(f"NaN poisoning (q_regs {qr}, stage_out {so}, cut_rows {cfg.cut_rows},"
          f" pieces {cfg.pieces}, combine {cfg.combine},"
          f" {cfg.num_splits} splits, cluster_merge {cfg.cluster_merge}, parts {cfg.parts},"
          f" f16_partials {cfg.f16_partials}):"
          f" select"
          f" bit-equal to clean and"
          f" multiply NaN rows as expected: {nan_ok}")

  # Ids outside the cache are invalid exactly as -1 is: bit-equal results in
  # both modes, with the last slot, which a clamp would read, NaN.
  n = NUM_BLOCKS * BLOCK_SIZE
  q, cache, idx = _inputs(16, 64, 0.1, seed=2)
  idx = jnp.where(idx == n - 1, 1, idx)
  far = jnp.where(jnp.arange(TOPK) % 3 == 0, n, jnp.where(jnp.arange(TOPK) % 3 == 1, -7, 2**31 - 1))
  odd = jnp.where(idx < 0, far[None, :].astype(jnp.int32), idx)
  poisoned = cache.reshape(-1, 576).at[n - 1].set(jnp.nan).reshape(cache.shape)
  # (With `--cut-rows N`, one split, so that the rows are cut.)
  cfg = _pallas_config(args.splits or (1 if cut_rows else 0), 16, 64, cut_rows=cut_rows,
                       pieces=args.pieces)
  cfgs = [cfg] + [SparseMLADecodeConfig(parts=pt) for pt in streams]
  cfgs = [dataclasses.replace(c, f16_partials=fp) for c in cfgs for fp in f16_checks
          if fp == f16_checks[0] or _merged_after(c, 16, 64, TOPK)]
  for cfg in cfgs:
    for mode in args.modes:
      f = lambda i, mode=mode, cfg=cfg: sparse_mla_decode(q, poisoned, i, sm_scale=SCALE,
                                                          mask_mode=mode, config=cfg)
      same = all(bool((np.asarray(a) == np.asarray(b)).all()) for a, b in zip(f(odd), f(idx)))
      ok &= same
      print(f"ids outside the cache ({mode}, {cfg.num_splits} splits, cut_rows {cfg.cut_rows},"
            f" pieces {cfg.pieces}, parts {cfg.parts}, f16_partials {cfg.f16_partials}):"
            f" bit-equal to -1: {same}")

  # A -1's stage row is zero-filled, never what an earlier tile left there:
  # in 6 parts, row 0 selects a NaN slot at position 5 of its second-to-last
  # tile (no later tile of its own overwrites it, and its staged result goes
  # to the other stage) and rows 1-15 have a -1 there in every tile; they
  # must be the reference's. NaN in data a row reads as valid is data: row 0
  # (a whole row) comes out NaN at every head, out and LSE, and so does head 5
  # of row 2 (cut at tile 85 into two pieces, merged), whose query holds a NaN.
  q, cache, idx = _inputs(16, 64, 0.0, seed=3)
  q = q.at[2, 5, 100].set(jnp.nan)
  nan_slot = int(idx[0, TOPK - 128 + 5])
  rest = jnp.where(idx[1:] == nan_slot, 1 + nan_slot % 7, idx[1:]).at[:, 5::64].set(-1)
  idx = idx.at[1:].set(rest)
  cache = cache.reshape(-1, 576).at[nan_slot].set(jnp.nan).reshape(cache.shape)
  want_nan = np.zeros((16, 64), bool)
  want_nan[0], want_nan[2, 5] = True, True
  nan_heads = lambda x: np.isnan(np.asarray(x, np.float32)).reshape(16, 64, -1)
  for fp in f16_checks:
    for mode in args.modes:
      cfg = SparseMLADecodeConfig(parts=6, f16_partials=fp)
      out, lse = jax.block_until_ready(
          sparse_mla_decode(q, cache, idx, sm_scale=SCALE, mask_mode=mode, config=cfg))
      ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE,
                                                     mask_mode=mode)
      fin = ~want_nan
      clean = (bool(jnp.isfinite(out[fin]).all()) and _rel(out[fin], ref_out[fin]) < 1e-2
               and _rel(lse[fin], ref_lse[fin]) < 1e-4)
      nans = all((nan_heads(x).all(-1) == want_nan).all() and (nan_heads(x).any(-1) == want_nan).all()
                 for x in (out, lse, ref_out, ref_lse))
      ok &= clean and nans
      print(f"stale stage rows ({mode}, parts 6, f16_partials {fp}): the other heads the"
            f" reference's: {clean}; NaN data NaN at exactly row 0 and row 2's head 5: {nans}")

  print("\nbatch heads  topk invalid mode/q_regs           us  kernel    TB/s  TFLOP/s  ceilTB/s"
        "  %ceil  xRef  relerr ok")
  for r in rows:
    print(f"{r[0]:5d} {r[1]:5d} {r[2]:5d} {r[3]:7.2f} {r[4]:20s} {r[5]:7.1f} {r[6]:7.1f}"
          f" {r[7]:6.2f} {r[8]:7.1f} {r[9]:8.2f} {100 * r[10]:6.1f} {r[11]:5.1f} {r[12]:.1e} {r[13]}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
