"""Sparse (top-k) MLA decode on the GPU: checks against the reference, then times it.

Prints, per shape and mask mode, the call's time and its decode kernel's alone
(the rest is XLA's: the combine of split partials), TB/s over the bytes it
must move (every selected row once, plus q and out), TFLOP/s, and the ratios
against two figures measured in the same run: an XLA gather of the same rows
fused with a sum (the gather ceiling) and the XLA reference (gather + einsum).

  python benchmarks/bench_sparse_mla_decode.py [--quick] [--splits N] [--q-regs Q ...]
      [--kv-swizzle 64 128] [--shapes B:H[:TOPK[:INVALID]] ...] [--modes select multiply] [--stage-out 0 1]
      [--pad-heads 0 1] [--cut-rows auto|off|N] [--pieces P] [--cluster-merge 0 1]
      [--combine kernel xla] [--parts auto|off|N[/plain|/whole][/sN] ...] [--f16-partials 0 1]
      [--kernels] [--merge-swizzle 0 1]

With several `--q-regs` values each shape runs every one in the same run (the
query's latent channels the consumers hold in registers,
`SparseMLADecodeConfig.q_regs`), and the NaN check runs each. `--kv-swizzle`
likewise times each variant with each `SparseMLADecodeConfig.kv_swizzle`, and
the on-device checks run under each. `--pad-heads 1`
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
device's SMs over the head groups), each with the suffix "/plain" for
`SparseMLADecodeConfig.stream_whole=False` (every row's tiles laid end to
end; with "auto", the plan's choice under it) or "/whole" for True (whole
rows first; without a suffix, the plan's rule), and "/sN" for
`SparseMLADecodeConfig.stream_segment=N` (the leftover runs cut by cost, a
segment at N tiles; 0: equal tiles); a stream's result is
compared with the first variant's (within a bf16 rounding, NaN in the same places), and the NaN
and outside-the-cache checks also run with the rows streamed in 6 parts.
`--f16-partials` times each variant whose partials a merge after the kernel
reads with `SparseMLADecodeConfig.f16_partials` set to each value, compares
the float16 partials' result with the float32 ones' (within a bf16
rounding, NaN in the same places), and runs the NaN and outside-the-cache
checks with each. `--kernels` prints every kernel of each timing's median call
with its time (the ceiling's, the reference's, and each variant's just above its
"timed:" line): where the time outside the decode kernel goes.
`--merge-swizzle` builds the piece merge of every variant with its 16-bit SMEM
tiles swizzled (1) or plain (0) (`piece_merge.SWIZZLE`; one value a run).
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
    piece_merge,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)
from jaxkv.kernels.sparse_mla_decode.config import CLUSTER_SPLITS
from jaxkv.kernels.sparse_mla_decode.plan import halves_pair_up, merges_in_cluster, rows_to_cut
from jaxkv.kernels._common import num_sms
from jaxkv.kernels.sparse_mla_decode.wrapper import _sparse_mla_decode

from check_sparse_mla_decode import (
    SCALE,
    TOPK,
    check_ids_outside_the_cache,
    check_nan_poisoning,
    check_stale_stage_rows,
    inputs,
    merged_after,
    pallas_config,
    rel,
    same_result,
)

ITERS = 10
SHOW_KERNELS = False  # `--kernels`


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
  median = sorted(range(len(per_iter)), key=per_iter.__getitem__)[len(per_iter) // 2]
  if SHOW_KERNELS:
    print("  kernels:", ", ".join(f"{name} {ms * 1e3:.1f} us" for name, ms in times[median]),
          flush=True)
  total, kernel = per_iter[median]
  return total * 1e-3, kernel * 1e-3



LAYOUT_SUFFIX = {None: "", False: "plain", True: "whole"}  # `stream_whole` by `--parts` suffix


def _parts(value: str, heads: int) -> tuple[int | None, bool | None, int | None]:
  """`--parts`' value: (None (the plan's), 0 (off) or a count of parts;
  `SparseMLADecodeConfig.stream_whole`: None (the plan's rule), False with
  the suffix "/plain", True with "/whole"; `stream_segment`: None (the
  plan's), N with the suffix "/sN")."""
  value, *suffixes = value.split("/")
  layout = {v: k for k, v in LAYOUT_SUFFIX.items()}
  whole = segment = None
  for suffix in suffixes:
    if suffix in layout:
      whole = layout[suffix]
    elif suffix[:1] == "s" and suffix[1:].isdigit():
      segment = int(suffix[1:])
    else:
      raise ValueError(f"--parts {value}: unknown suffix {suffix!r} (plain, whole or sN)")
  if value == "auto":
    return None, whole, segment
  if value == "off":
    return 0, whole, segment
  if value == "sms":
    return num_sms() // -(-heads // 64), whole, segment
  return int(value), whole, segment


def _row(r) -> str:
  """A line of the table (each is also printed as it is timed, should the run be cut short)."""
  return (f"{r[0]:5d} {r[1]:5d} {r[2]:5d} {r[3]:7.2f} {r[4]:20s} {r[5]:7.1f} {r[6]:7.1f}"
          f" {r[7]:6.2f} {r[8]:7.1f} {r[9]:8.2f} {100 * r[10]:6.1f} {r[11]:5.1f} {r[12]:.1e}"
          f" {r[13]}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--splits", type=int, default=0, help="0: default config")
  parser.add_argument("--q-regs", type=int, nargs="+", default=None,
                      help="time the kernel with each of these q_regs (default: the config's)")
  parser.add_argument("--kv-swizzle", type=int, nargs="+", default=None, choices=[64, 128],
                      help="time the kernel with each of these kv_swizzle values (default: the"
                      " config's); the checks run under each")
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
                      " head group set to each: auto (the plan's), off, sms, or N, each with"
                      " /plain or /whole (stream_whole) and /sN (stream_segment)")
  parser.add_argument("--combine", nargs="+", default=None, choices=["kernel", "xla"],
                      help="time each variant with split or piece partials merged by the"
                      " merge kernel and by XLA (default: the config's)")
  parser.add_argument("--f16-partials", type=int, nargs="+", default=None, choices=[0, 1],
                      help="time each variant whose partials are merged after the kernel with"
                      " float32 (0) and float16 (1) partials (default: the config's)")
  parser.add_argument("--kernels", action="store_true",
                      help="print every kernel of each timing's median call (the ceiling's,"
                      " the reference's, each variant's) and its time")
  parser.add_argument("--merge-swizzle", type=int, default=None, choices=[0, 1],
                      help="the piece merge's 16-bit SMEM tiles swizzled (1) or plain rows"
                      " (0), for every variant of the run (default: `piece_merge.SWIZZLE`)")
  args = parser.parse_args(argv)
  if args.merge_swizzle is not None:
    piece_merge.SWIZZLE = bool(args.merge_swizzle)
  print(f"piece merge: swizzled 16-bit tiles {piece_merge.SWIZZLE}", flush=True)
  global SHOW_KERNELS
  SHOW_KERNELS = args.kernels
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
    q, cache, idx = inputs(batch, heads, invalid, topk=topk)
    cfg = pallas_config(args.splits, batch, heads, topk, cut_rows, args.pieces)
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
    swizzles = args.kv_swizzle or [cfg.kv_swizzle]
    # (q_regs, kv_swizzle) pairs: `qr` below.
    q_regs = [(r, sw) for r in args.q_regs or [cfg.q_regs] for sw in swizzles]
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
    parts = [(None, cfg.stream_whole, cfg.stream_segment)]
    if cfg.num_splits == 1 and cfg.cut_rows is None and cfg.cluster_merge is None:
      parts = [_parts(v, heads) for v in args.parts]
    f16s = [cfg.f16_partials] if args.f16_partials is None else [
        bool(v) for v in args.f16_partials]
    variants = [(mode, qr, so, ph, cm, cb, pt, fp) for so in stage_out for qr in q_regs
                for mode in args.modes for ph in pads for cm in merges for cb in combines
                for pt in parts for fp in f16s]
    outs = {}
    for mode, qr, so, ph, cm, cb, pt, fp in variants:
      vcfg = dataclasses.replace(cfg, q_regs=qr[0], kv_swizzle=qr[1], stage_out=so,
                                 cluster_merge=cm, combine=cb, parts=pt[0], stream_whole=pt[1],
                                 stream_segment=pt[2],
                                 f16_partials=fp)
      if pt[0] and pt[0] > batch:
        continue
      if fp != f16s[0] and (ph or not merged_after(vcfg, batch, heads, topk)):
        continue  # no partials for a merge after the kernel: the same call
      if ph:
        fn = jax.jit(lambda q, c, i, mode=mode, vcfg=vcfg: _sparse_mla_decode(
            q, c, i, sm_scale=SCALE, select=mode == "select", num_splits=vcfg.num_splits,
            interpret=None, q_regs=vcfg.q_regs, kv_swizzle=vcfg.kv_swizzle,
            stage_out=vcfg.stage_out, pad_heads=True,
            cluster_merge=merges_in_cluster(vcfg, batch=batch, num_heads=heads),
            xla_combine=cb == "xla"))
      else:
        fn = jax.jit(lambda q, c, i, mode=mode, vcfg=vcfg: sparse_mla_decode(
            q, c, i, sm_scale=SCALE, mask_mode=mode, config=vcfg))
      out, lse = fn(q, cache, idx)
      e_out, e_lse = rel(out, ref_out), rel(lse, ref_lse)
      good = e_out < 1e-2 and e_lse < 1e-4 and bool(jnp.isfinite(out).all())
      if fp != f16s[0]:
        close = same_result((np.asarray(out, np.float32), np.asarray(lse)),
                             outs[mode, qr, so, ph, cm, cb, pt, f16s[0]])
        print(f"b{batch} h{heads} {mode} parts {pt}: float16 partials {fp} and {f16s[0]}:"
              f" results agree: {close}", flush=True)
        good &= close
      outs[mode, qr, so, ph, cm, cb, pt, fp] = (np.asarray(out, np.float32), np.asarray(lse))
      if fp != f16s[0]:
        pass  # (compared with its float32 partials' result above)
      elif pt != parts[0]:
        close = same_result((np.asarray(out, np.float32), np.asarray(lse)),
                             outs[mode, qr, so, ph, cm, cb])
        print(f"b{batch} h{heads} {mode} parts {pt} and {parts[0]}: results agree: {close}",
              flush=True)
        if not close:  # each against the reference, where it differs most
          want = (np.asarray(ref_out, np.float32), np.asarray(ref_lse))
          for name, got in (("this", outs[mode, qr, so, ph, cm, cb, pt, fp]),
                            ("first", outs[mode, qr, so, ph, cm, cb])):
            print(f"  {name} against the reference:", flush=True)
            same_result(got, want)
        good &= close
        cut_pt = rows_to_cut(vcfg, batch=batch, num_heads=heads, topk=topk)
        print(f"b{batch} h{heads} parts {pt}: {cut_pt}", flush=True)
      else:
        outs[mode, qr, so, ph, cm, cb] = (np.asarray(out, np.float32), np.asarray(lse))
      # (The comparisons below are of the first parts' and partials' results.)
      first = pt == parts[0] and fp == f16s[0]
      if first and cm is not None and (mode, qr, so, ph, not cm, cb) in outs:
        close = same_result(outs[mode, qr, so, ph, cm, cb], outs[mode, qr, so, ph, not cm, cb])
        print(f"b{batch} h{heads} {mode} q_regs, kv_swizzle {qr}: cluster merge and combine kernel"
              f" agree: {close}", flush=True)
        good &= close
      if first and cb == "xla" and (mode, qr, so, ph, cm, "kernel") in outs:
        close = same_result(outs[mode, qr, so, ph, cm, cb], outs[mode, qr, so, ph, cm, "kernel"])
        print(f"b{batch} h{heads} {mode} q_regs, kv_swizzle {qr}: merge kernel and XLA combine"
              f" agree: {close}", flush=True)
        good &= close
      if first and so and not ph and (mode, qr, False, False, cm, cb) in outs:
        same = all((a == b).all() for a, b in zip(outs[mode, qr, so, ph, cm, cb],
                                                   outs[mode, qr, False, ph, cm, cb]))
        print(f"b{batch} h{heads} {mode} q_regs, kv_swizzle {qr} cluster merge {cm}: staged result"
              f" bit-equal to direct stores: {same}", flush=True)
        good &= same
      if first and ph:
        same = all((a == b).all() for a, b in zip(outs[mode, qr, so, ph, cm, cb],
                                                   outs[mode, qr, so, False, cm, cb]))
        print(f"b{batch} h{heads} {mode} q_regs, kv_swizzle {qr} stage_out {so}: padded query's result"
              f" bit-equal to the unpadded one's: {same}", flush=True)
        good &= same
      ok &= good
      t, t_kernel = _time_parts(fn, q, cache, idx)
      rows.append((batch, heads, topk, invalid,
                   f"{mode}/qr{qr[0]}{f'/sw{qr[1]}' if len(swizzles) > 1 else ''}"
                   f"{'/so' if so else ''}{'/pad' if ph else ''}"
                   f"{'' if cm is None else '/cm' if cm else '/xc'}"
                   f"{'/xla' if cb == 'xla' and len(combines) > 1 else ''}"
                   f"{'' if len(parts) == 1 else f'/p{pt[0]}' + LAYOUT_SUFFIX[pt[1]]}"
                   f"{'' if len(parts) == 1 or pt[2] is None else f's{pt[2]}'}"
                   f"{'/f16p' if fp and len(f16s) > 1 else ''}", t * 1e6,
                   t_kernel * 1e6,
                   (kv_bytes + io_bytes) / t / 1e12,
                   flops / t / 1e12, kv_bytes / t_ceil / 1e12, t_ceil / t, t_ref / t,
                   e_out, good))
      print("timed:", _row(rows[-1]), flush=True)
    print(f"b{batch} h{heads} topk{topk} inv{invalid}: {cfg.num_splits} splits,"
          f" {cut.rows} rows cut into {cut.pieces} pieces, {cut.parts} parts, merge in clusters"
          f" {merges_in_cluster(cfg, batch=batch, num_heads=heads, cut=cut)}, ceiling"
          f" {kv_bytes / t_ceil / 1e12:.2f} TB/s, XLA reference {t_ref * 1e6:.0f} us", flush=True)

  for sw in args.kv_swizzle or [None]:
    ok &= check_nan_poisoning(args, cut_rows, sw)
    ok &= check_ids_outside_the_cache(args, cut_rows, sw)
    ok &= check_stale_stage_rows(args, cut_rows, sw)

  print("\nbatch heads  topk invalid mode/q_regs           us  kernel    TB/s  TFLOP/s  ceilTB/s"
        "  %ceil  xRef  relerr ok")
  for r in rows:
    print(_row(r))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
