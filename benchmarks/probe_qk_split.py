"""Probe: the decode tile's QK, split by slots (the seesaw's) or by contraction.

Usage: python benchmarks/probe_qk_split.py [--iters N]

Each CTA (one per SM) loads a 64-head query and two KV stages into SMEM once and
then runs the tile's QK `N` times from SMEM (no HBM traffic in the loop), the
two consumer warpgroups side by side, with and without each tile's PV:

- `slots`: the production QK (`kernel.tile_scores`): warpgroup w scores slots
  [32w, 32w + 32) over all 576 channels (N = 32, the query read by both).
- `depth`: warpgroup w scores all 64 slots over its latent half (warpgroup 0
  also the RoPE part): N = 64, each query half read by one warpgroup.
- `depth+x`: `depth`, then each warpgroup hands the other the half of its
  partial scores the other softmaxes (f32, through SMEM and an mbarrier) and
  adds the half it receives: what the seesaw would need. `depth+x0`: without
  the async-proxy fence (`commit_smem`; the mbarrier orders plain stores and
  loads). `depth+x1`: also without the second rendezvous (racy; a price).

`+pv` adds each warpgroup's PV of the tile (O[:, its 256 channels] += P V,
P from registers). Prints µs per tile and per-SM TFLOP/s of the tensor work.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu.profiler import measure
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode import kernel as K

H, T, HALF, ROPE = 64, 64, 256, 64


def build(variant: str, pv: bool, iters: int, ctas: int, interpret=None):
  bf16 = K.bf16_tile()

  def body(q_ref, k_ref, out_ref, q_lat, k_lat, k_rope, xbuf0, xbuf1, ld_bar, x_bar):
    # q_ref [64, 576], k_ref [2, 64, 576] bf16 GMEM; out_ref [ctas, 2, 64, 64] f32.
    # q_lat [2, 64, 256], k_lat [2, 2, 64, 256], k_rope [2, 64, 64]
    # bf16 SMEM; xbuf0, xbuf1 [64, 32] f32 SMEM: each warpgroup's hand-off.
    wg = lax.axis_index("wg")
    c = lax.axis_index("c")
    xbuf = (xbuf0, xbuf1)

    @pl.when(wg == 0)
    def _():
      for h in range(2):
        plgpu.copy_gmem_to_smem(q_ref.at[:, pl.ds(h * HALF, HALF)], q_lat.at[h], ld_bar)
        for st in range(2):
          plgpu.copy_gmem_to_smem(k_ref.at[st, :, pl.ds(h * HALF, HALF)], k_lat.at[st, h], ld_bar)
      for st in range(2):
        plgpu.copy_gmem_to_smem(k_ref.at[st, :, pl.ds(512, ROPE)], k_rope.at[st], ld_bar)

    plgpu.barrier_wait(ld_bar)
    # The RoPE query's values do not matter here: stage 0's RoPE keys stand in
    # (SMEM has no room for a copy beside the hand-off buffers).
    q_rope = plgpu.load(k_rope.at[0], layout=plgpu.Layout.WGMMA)

    def consumer(w: int):
      def scores(stage):
        if variant == "slots":
          return K.tile_scores(q_lat, q_rope, k_lat, k_rope, stage, pl.ds(w * 32, 32))
        return K.depth_partial_scores(w, q_lat, q_rope, k_lat, k_rope, stage)

      def step(i, carry):
        tot, acc = carry
        stage = lax.rem(i, 2)
        s = scores(stage)
        if variant.startswith("depth+x"):
          give = s[:, (1 - w) * 32:(2 - w) * 32]
          keep = s[:, w * 32:(w + 1) * 32]
          xbuf[w][...] = give
          if variant == "depth+x":
            plgpu.commit_smem()
          plgpu.barrier_arrive(x_bar.at[w])
          plgpu.barrier_wait(x_bar.at[1 - w])
          got = plgpu.load(xbuf[1 - w], layout=plgpu.Layout.WGMMA)
          s = keep + got
          if variant != "depth+x1":
            # The other may overwrite its buffer only after we read it: a
            # second rendezvous. ("depth+x1" leaves it out: a race, kept
            # only to price the hand-off; the seesaw's later barriers would
            # order the reuse.)
            plgpu.barrier_arrive(x_bar.at[2 + w])
            plgpu.barrier_wait(x_bar.at[3 - w])
        if pv:
          # O[:, our 256 channels] += P V over all 64 slots, P from registers
          # (a [64, 32] score half stands for both halves of P).
          p = s.astype(jnp.bfloat16)
          cols = s.shape[1]

          def pv_body(o_ref):
            for k0 in range(0, T, cols):
              plgpu.wgmma(o_ref, p, k_lat.at[stage, w, pl.ds(k0, cols)])

          acc = pl.run_state(pv_body)(plgpu.ACC.init(acc))
        return tot + s[:, :32], acc

      init = (
          plgpu.layout_cast(jnp.zeros((H, 32), jnp.float32), plgpu.Layout.WGMMA),
          plgpu.layout_cast(jnp.zeros((H, HALF), jnp.float32), plgpu.Layout.WGMMA),
      )
      tot, acc = lax.fori_loop(0, iters, step, init)
      out_ref[c, w] = tot
      out_ref[c, 2 + w] = acc[:, :32]

    for w in range(2):
      pl.when(wg == w)(functools.partial(consumer, w))

  f = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((ctas, 4, H, 32), jnp.float32),
      grid=(ctas,), grid_names=("c",), num_threads=2, thread_name="wg",
      scratch_types=[
          plgpu.SMEM((2, H, HALF), jnp.bfloat16, transforms=bf16),
          plgpu.SMEM((2, 2, T, HALF), jnp.bfloat16, transforms=bf16),
          plgpu.SMEM((2, T, ROPE), jnp.bfloat16, transforms=bf16),
          K.partial_scores_smem(),
          K.partial_scores_smem(),
          plgpu.Barrier(num_arrivals=2 * 3 + 2),
          plgpu.Barrier(num_arrivals=1, num_barriers=4),
      ],
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
      kernel_name=f"probe_qk_{variant.replace('+', '_')}{'_pv' if pv else ''}",
      interpret=interpret,
  )
  return f


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--iters", type=int, default=2000)
  ap.add_argument("--lower-only", action="store_true")
  args = ap.parse_args()
  ctas = 132
  kq, kk = jax.random.split(jax.random.key(0))
  q = jax.random.normal(kq, (H, 576), jnp.bfloat16) * 0.1
  k = jax.random.normal(kk, (2, T, 576), jnp.bfloat16) * 0.1
  rows = []
  for variant in ("slots", "depth", "depth+x", "depth+x0", "depth+x1"):
    for pv in (False, True):
      f = jax.jit(build(variant, pv, args.iters, ctas))
      if args.lower_only:
        f.trace(q, k).lower(lowering_platforms=("cuda",))
        print("lowered", variant, pv)
        continue
      out = f(q, k)
      _, t = measure(f, aggregate=False, iterations=5)(q, k)
      ms = float(np.median([sum(ms for _, ms in it) for it in t]))
      us_tile = ms * 1e3 / args.iters
      flops = 2 * H * T * 576 + (2 * H * T * 512 if pv else 0)  # per tile, both warpgroups
      rows.append((variant + ("+pv" if pv else ""), us_tile, flops / us_tile / 1e6, bool(jnp.isfinite(out).all())))
  if rows:
    print(f"{'variant':>12} {'us/tile':>8} {'TFLOP/s/SM':>10} finite")
    for r in rows:
      print(f"{r[0]:>12} {r[1]:8.3f} {r[2]:10.2f} {r[3]}")


if __name__ == "__main__":
  main()
