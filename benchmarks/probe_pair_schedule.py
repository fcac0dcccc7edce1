"""Probe: the consumers' chain per tile, halves against FlashMLA's pair schedule.

Usage: python benchmarks/probe_pair_schedule.py [--tiles 16 80] [--q-regs 0 128]
       [--stream 0 1] [--swizzle 64|128] [--share 2|1] [--lower-only]

Both decode kernels split each 64-slot tile between the two consumer
warpgroups: warpgroup w scores slots [32 w, 32 w + 32) (QK wgmmas of N = 32,
each reading the whole query from SMEM), then the seesaw hands the maximum
and P over. FlashMLA's schedule gives warpgroup w a whole tile of a pair
instead (N = 64: half the query's SMEM reads per FLOP); the seesaw then runs
over the pair's two tiles, and each warpgroup's PV multiplies 64 slots of
its own tile and 64 of the other's.

This probe times the chain alone, on one CTA per SM: the query and two KV
tiles land in SMEM once, then each CTA runs `tiles` tiles over them (no KV
traffic in the loop, the same register budget as the kernels: three
warpgroups, the consumers at 240). Streamed (`--stream 1`), every tile comes
through the kernels' two-stage ring instead, two CTAs reading each tile (the
two head groups of 128 heads); under pairs a stage is then free only after
the pair, since both consumers' PVs read both tiles, and "pieces" frees and
refills each stage's latent halves and RoPE rows on their own barriers.
The per-tile figure is the slope between two tile counts (CUPTI, median of
20), so the launch and the start cancel.

Each variant's result is checked against softmax(QK^T) V over the two tiles
(repeating them changes no weight; the LSE grows by log(tiles / 2)): at two
tiles with the tiles held in SMEM, since under pairs each tile's P then
overwrites RoPE rows that are not reloaded (past one pair those scores are
garbage, the timing is not), and at 16 tiles streamed.

Outcome on an H100 (kernels/mla_decode/NOTES.md, "FlashMLA's pair schedule,
probed"): the chain alone is 18-20% faster in pairs, but streamed the pair
stalls the two-stage ring (3.7 µs a tile, 3.0 in pieces, against the halves'
2.0; under the 64-head layout, `--swizzle 128 --share 1`, 4.3 and 3.9 against
3.1 at the HBM rate), as the two builds of the schedule in dense decode did on 2026-11-30
(NOTES.md, "Two tiles in flight"), so both kernels keep the halves.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels._common import num_sms as device_sms
from jaxkv.kernels.mla_decode.cta import CONSUMER_REGS, PRODUCER_REGS
from jaxkv.kernels.mla_decode.layout import (
    HALF,
    HEAD_TILE,
    LATENT,
    LOG2E,
    ROPE,
    SLOT_HALF,
    TILE,
    bf16_tile,
    launch,
)
from jaxkv.kernels.mla_decode import seesaw as S

ITERS = 20
VARIANTS = ("halves", "pairs", "pieces")
# "pieces": the order in which the producer refills a pair's pieces, (stage,
# piece) with piece 0 / 1 the latent halves and 2 the RoPE rows: the earliest
# free first (each consumer's own value half of its own tile), then those the
# other consumer's late PV frees.
PIECE_ORDER = ((0, 0), (1, 1), (0, 1), (0, 2), (1, 0), (1, 2))
SCALE = 576 ** -0.5


def probe_kernel(variant: str, tiles: int, ctas: int, q_regs: int, stream: bool = False,
                 swizzle: int = 64, share: int = 2):
  """Each CTA: the query and two tiles into SMEM, then `tiles` tiles of the
  chain (`variant` "halves" as the kernels run, "pairs" or "pieces"); out
  `[ctas, 64, 512]` f32 and the LSE `[ctas, 64]`.

  With `stream`, the producer loads every tile into the two-stage ring as the
  kernels do (a stage is reloaded once both consumers release it: under pairs,
  after the pair), tile `(cta // share) * tiles + t` of k's tiles, modulo
  their number: with `share` 2, two CTAs read each tile, as the two head groups
  of 128 heads do; with 1, every CTA reads its own (one head group).
  `swizzle`: the query's and ring's swizzle in bytes, 64 (the kernels at 128
  heads) or 128 (at 16-64 heads, where the halves multiply the whole P at
  once, `seesaw_pv_whole`, as the kernels do).
  "pieces" is pairs (streamed only) with each stage's three pieces (latent
  halves, RoPE rows) loaded and released on their own barriers: a latent half
  is free after the PV of the consumer whose value half it is, the RoPE rows
  (which hold the tile's P) after the other consumer's PV of that tile; each
  QK reads its own value half first, the RoPE rows last.
  """
  pieces = variant == "pieces"
  pairs = variant in ("pairs", "pieces")
  assert not pieces or (stream and q_regs == 0)
  width = TILE if pairs else SLOT_HALF
  whole = swizzle == 128 and not pairs
  assert tiles % 2 == 0
  scale_log2 = SCALE * LOG2E

  def body(q_ref, k_ref, o_ref, lse_ref):
    # q_ref [64, 576], k_ref [n, 64, 576] bf16 (GMEM).
    cta = lax.axis_index("i")
    n_src = k_ref.shape[0]

    def scoped(q_lat, k_lat, k_rope, p_smem, xchg, q_bar, rope_free, kv_bar, free_bar,
               sync_bar, piece_bar, piece_free, *bars):
      wg = lax.axis_index("wg")

      def piece_copy(t, stage, piece):
        src = lax.rem((cta // share) * tiles + t, n_src)
        bar = piece_bar.at[3 * stage + piece]
        if piece < 2:
          plgpu.copy_gmem_to_smem(
              k_ref.at[src, :, pl.ds(piece * HALF, HALF)], k_lat.at[stage, piece], bar)
        else:
          plgpu.copy_gmem_to_smem(k_ref.at[src, :, pl.ds(LATENT, ROPE)], k_rope.at[stage], bar)

      def piece_producer():
        for stage in range(2):
          for piece in range(3):
            piece_copy(stage, stage, piece)

        @pl.loop(1, tiles // 2)
        def _(j):
          for stage, piece in PIECE_ORDER:
            plgpu.barrier_wait(piece_free.at[3 * stage + piece])
            piece_copy(2 * j + stage, stage, piece)

      @pl.when(wg == 2)
      def _():
        plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
        # The RoPE query passes through the first tile's RoPE rows (the
        # consumers move it to registers), then the tiles land.
        for h in range(2):
          plgpu.copy_gmem_to_smem(q_ref.at[:, pl.ds(h * HALF, HALF)], q_lat.at[h], q_bar)
        plgpu.copy_gmem_to_smem(q_ref.at[:, pl.ds(LATENT, ROPE)], k_rope.at[0], q_bar)
        plgpu.barrier_wait(rope_free)

        if pieces:
          piece_producer()
          return

        @pl.loop(0, tiles if stream else 2)
        def _(t):
          stage = lax.rem(t, 2)
          if stream:
            pl.when(t >= 2)(lambda: plgpu.barrier_wait(free_bar.at[stage]))
          src = lax.rem((cta // share) * tiles + t, n_src)
          for h in range(2):
            plgpu.copy_gmem_to_smem(
                k_ref.at[src, :, pl.ds(h * HALF, HALF)], k_lat.at[stage, h], kv_bar.at[stage])
          plgpu.copy_gmem_to_smem(
              k_ref.at[src, :, pl.ds(LATENT, ROPE)], k_rope.at[stage], kv_bar.at[stage])

      for w in range(2):
        pl.when(wg == w)(lambda w=w: consumer(w, q_lat, k_lat, k_rope, p_smem, xchg, q_bar,
                                                rope_free, kv_bar, free_bar, sync_bar,
                                                piece_bar, piece_free, bars))

    def consumer(wg, q_lat, k_lat, k_rope, p_smem, xchg, q_bar, rope_free, kv_bar, free_bar,
                 sync_bar, piece_bar, piece_free, bars):
      plgpu.set_max_registers(CONSUMER_REGS, action="increase")
      plgpu.barrier_wait(q_bar)
      q_rope = plgpu.load(k_rope.at[0], layout=plgpu.Layout.WGMMA)
      plgpu.barrier_arrive(rope_free)
      q_head = S.query_head(q_lat, q_regs, in_regs=True)

      def wait_stage(i, stage):
        if stream:
          plgpu.barrier_wait(kv_bar.at[stage])
        else:  # the two tiles land once
          pl.when(i == 0)(lambda: plgpu.barrier_wait(kv_bar.at[stage]))

      def piece_scores():
        # Our tile's QK, each piece as it lands: our value half first (the
        # first freed), the other half, the RoPE rows (freed last).
        def qk(s_ref):
          q = q_lat.at[pl.ds(lax.optimization_barrier(jnp.int32(0)), 2)]
          for piece in (wg, 1 - wg, 2):
            plgpu.barrier_wait(piece_bar.at[3 * wg + piece])
            if piece == 2:
              plgpu.wgmma(s_ref, q_rope, k_rope.at[wg].T)
            else:
              plgpu.wgmma(s_ref, q.at[piece], k_lat.at[wg, piece].T)
          return s_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((HEAD_TILE, TILE), jnp.float32))
        # The other tile's value half that our late PV reads.
        plgpu.barrier_wait(piece_bar.at[3 * (1 - wg) + wg])
        return s

      def step(i, carry):
        if pieces:
          stage = wg
          s = piece_scores()
        else:
          if pairs:
            stage, slots = wg, pl.ds(0, TILE)
            wait_stage(i, 0)
            wait_stage(i, 1)
          else:
            stage, slots = lax.rem(i, 2), pl.ds(wg * SLOT_HALF, SLOT_HALF)
            wait_stage(lax.div(i, 2), stage)
          s = S.tile_scores(q_lat, q_rope, k_lat, k_rope, stage, slots, q_head=q_head)

        def pv_whole(acc, *, p_own):
          return S.seesaw_pv_whole(acc, k_lat=k_lat, slot=stage, wg=wg, p_smem=p_smem,
                                   p_own=p_own, compiled=True)

        def pv(acc, cols, *, p=None, p_cols=None):
          # Under pairs a P column slice names its tile, whose RoPE rows
          # (dead once its QK is done) hold that tile's P.
          if pairs:
            t = cols.start // TILE

            def body(o_acc_ref):  # (refs sliced inside the wgmma body)
              plgpu.wgmma(o_acc_ref, p if p_cols is None else k_rope.at[t], k_lat.at[t, wg])

            acc = pl.run_state(body)(plgpu.ACC.init(acc))  # (awaited)
            if pieces:
              # Our value half of tile t is read; after the late PV, its P too.
              plgpu.barrier_arrive(piece_free.at[3 * t + wg])
              if p_cols is not None:
                plgpu.barrier_arrive(piece_free.at[3 * t + 2])
            return acc
          return S.seesaw_pv(acc, cols, k_lat=k_lat, slot=stage, wg=wg, p_smem=p_smem,
                           p_scratch=None, p=p, p_cols=p_cols)

        # (Under the whole P, the other's half is read with plain loads: the
        # kernels fence only a segment's last tile there.)
        out = S.seesaw_tile(wg, s * scale_log2, carry, pv=pv_whole if whole else pv, xchg=xchg,
                            p_smem=p_smem, bars=bars, whole_pv=whole, fence=not whole,
                            regions=False, width=width,
                            p_half=(lambda k: k_rope.at[k]) if pairs else None)
        if stream and not pieces:
          for st in ((0, 1) if pairs else (stage,)):
            plgpu.barrier_arrive(free_bar.at[st])
        return out

      S.seesaw_begin(wg, bars)
      acc, m, l_own = lax.fori_loop(0, tiles // 2 if pairs else tiles, step, S.softmax_start(HALF))
      S.seesaw_end(wg, bars)
      l = S.seesaw_row_sums(wg, l_own, xchg, sync_bar, reuse=False)
      o, lse = S.softmax_finish(acc, m, l)
      o_ref[cta, :, pl.ds(wg * HALF, HALF)] = o
      if wg == 0:
        lse_ref[cta] = lse

    kv = bf16_tile(swizzle)
    pl.run_scoped(
        scoped,
        plgpu.SMEM((2, HEAD_TILE, HALF), jnp.bfloat16, transforms=kv),
        plgpu.SMEM((2, 2, TILE, HALF), jnp.bfloat16, transforms=kv),
        plgpu.SMEM((2, TILE, ROPE), jnp.bfloat16, transforms=kv),
        # The kernels' P tile (under the 64-byte swizzle whatever the ring's;
        # under pairs P lives in the tiles' RoPE rows and this is left unused)
        # and exchange rows.
        *S.seesaw_scratch(),
        plgpu.Barrier(num_arrivals=3),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=3, num_barriers=2),
        plgpu.Barrier(num_arrivals=2, num_barriers=2),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=1, num_barriers=6),
        plgpu.Barrier(num_arrivals=1, num_barriers=6),
        *S.seesaw_barriers(),
        collective_axes="wg",
    )

  return launch(
      body, grid=(ctas,), grid_names=("i",),
      out_type=(jax.ShapeDtypeStruct((ctas, HEAD_TILE, LATENT), jnp.float32),
                jax.ShapeDtypeStruct((ctas, HEAD_TILE), jnp.float32)),
      kernel_name=f"probe_{variant}", interpret=None)


def runs(variant: str, q_regs: int, stream: int) -> bool:
  """Whether the probe runs this combination ("pieces" only streamed, at q_regs 0)."""
  return variant != "pieces" or (bool(stream) and q_regs == 0)


def reference(q, k):
  """softmax(Q K^T * scale) V over the two tiles (V = K's first 512 channels)."""
  qf, kf = q.astype(jnp.float32), k.reshape(-1, 576).astype(jnp.float32)
  s = qf @ kf.T * SCALE
  lse = jax.nn.logsumexp(s, axis=1)
  return jnp.exp(s - lse[:, None]) @ kf[:, :LATENT], lse


def _time_us(fn, *args) -> float:
  from jax.experimental.mosaic.gpu.profiler import measure

  _, times = measure(fn, aggregate=False, iterations=ITERS)(*args)
  per_iter = sorted(sum(ms for _, ms in it) for it in times)
  return per_iter[len(per_iter) // 2] * 1e3


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--tiles", type=int, nargs=2, default=(16, 80))
  ap.add_argument("--q-regs", type=int, nargs="+", default=(0, 128))
  ap.add_argument("--ctas", type=int, default=None, help="default: one per SM")
  ap.add_argument("--stream", type=int, nargs="+", default=(0, 1),
                  help="0: the two tiles stay in SMEM; 1: every tile streams through the ring")
  ap.add_argument("--src-tiles", type=int, default=4096,
                  help="distinct tiles the streamed timing reads from")
  ap.add_argument("--swizzle", type=int, default=64, choices=(64, 128),
                  help="the query's and ring's swizzle (bytes): 64 as the kernels at 128"
                       " heads, 128 as at 16-64")
  ap.add_argument("--share", type=int, default=2, choices=(1, 2),
                  help="streamed: CTAs reading each tile (2: two head groups; 1: one)")
  ap.add_argument("--lower-only", action="store_true",
                  help="lower every variant for CUDA on this machine and stop")
  args = ap.parse_args(argv)
  key = jax.random.key(0)
  kq, kk = jax.random.split(key)
  q = jax.random.normal(kq, (HEAD_TILE, 576), jnp.bfloat16)
  k = jax.random.normal(kk, (2, TILE, 576), jnp.bfloat16)
  ctas = args.ctas or (132 if args.lower_only else device_sms())
  kw = dict(swizzle=args.swizzle, share=args.share)
  if args.lower_only:
    for variant in VARIANTS:
      for q_regs in args.q_regs:
        for stream in args.stream:
          if not runs(variant, q_regs, stream):
            continue
          fn = jax.jit(probe_kernel(variant, args.tiles[0], ctas, q_regs, bool(stream), **kw))
          fn.trace(q, k).lower(lowering_platforms=("cuda",))
          print(f"{variant} q_regs={q_regs} stream={stream}: lowered")
    return 0
  o_ref, lse_ref = reference(q, k)
  # Distinct tiles for the streamed timing: each CTA pair reads its own.
  k_big = jax.random.normal(kk, (args.src_tiles, TILE, 576), jnp.bfloat16)
  flop_tile = 2 * HEAD_TILE * TILE * (576 + LATENT)
  rows = []
  for stream in args.stream:
    for q_regs in args.q_regs:
      for variant in VARIANTS:
        if not runs(variant, q_regs, stream):
          continue
        # Checked at 2 tiles (and streamed at 16: the ring's reloads), on
        # the two tiles.
        n_check = 16 if stream else 2
        fn = jax.jit(probe_kernel(variant, n_check, ctas, q_regs, bool(stream), **kw))
        o, lse = jax.block_until_ready(fn(q, k))
        err = float(jnp.max(jnp.abs(o - o_ref[None])) / jnp.max(jnp.abs(o_ref)))
        # n copies of the two tiles: the same weights, the LSE + log(n / 2).
        lse_err = float(jnp.max(jnp.abs(lse - lse_ref[None] - np.log(n_check / 2))))
        ok = np.isfinite(err) and err < 2e-2 and lse_err < 1e-2
        print(f"{variant} q_regs={q_regs} stream={stream}, {n_check} tiles: rel err {err:.2e},"
              f" lse err {lse_err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
        src = k_big if stream else k
        us = [_time_us(jax.jit(probe_kernel(variant, n, ctas, q_regs, bool(stream), **kw)), q, src)
              for n in args.tiles]
        slope = (us[1] - us[0]) / (args.tiles[1] - args.tiles[0])
        # Distinct tile bytes a tile step brings in over the whole device.
        tbs = ctas / args.share * TILE * 576 * 2 / slope * 1e-6 if stream else None
        rows.append((variant, q_regs, stream, us[0], us[1], slope,
                     flop_tile * ctas / slope * 1e-6, tbs))
  print(f"\n{ctas} CTAs, {HEAD_TILE} heads each, {args.swizzle}-byte swizzle; µs per call at"
        f" {args.tiles[0]} / {args.tiles[1]} tiles; per tile = the slope; streamed:"
        f" {args.share} CTA(s) read each tile (TB/s: distinct tile bytes)")
  print("| variant | q_regs | streamed | µs | µs | µs per tile | TFLOP/s | TB/s |")
  print("|---|---|---|---|---|---|---|---|")
  for variant, q_regs, stream, a, b, slope, tf, tbs in rows:
    print(f"| {variant} | {q_regs} | {'yes' if stream else 'no'} | {a:.1f} | {b:.1f} |"
          f" {slope:.3f} | {tf:.0f} | {'-' if tbs is None else f'{tbs:.2f}'} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
