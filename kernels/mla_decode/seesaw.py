"""The consumers' tile of both MLA decode kernels: the scores, FlashMLA's
"seesaw" softmax and PV over a tile's two slot halves, and the row sums."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .layout import HALF, HEAD_TILE, LOG2E, SLOT_HALF, TILE, bf16_tile


def tile_scores(q_lat, q_rope, k_lat, k_rope, stage, slots, q_head=None):
  """S = Q K^T over a KV stage's `slots` (32 of them in the kernels): `[64, slots]`
  float32, 576 deep.

  The QK of both decode kernels. `q_lat` `[2, 64, 256]` bf16 SMEM, `q_rope`
  `[64, 64]` bf16 (registers, or SMEM in the interpreter), `k_lat` `[stages,
  2, 64, 256]` and `k_rope` `[stages, 64, 64]` bf16 SMEM. `q_head`, when
  given, is `q_lat[0, :, :d]` (`[64, d]` bf16, registers or SMEM), which the
  first wgmma then takes instead of the SMEM copy.

  The query's address is the same for every tile, so LLVM would hoist the
  21 wgmma descriptors of its 32-column tiles out of the tile loop, where
  they held 42 registers beside the accumulator for the whole loop and ptxas
  spilled (232 B of spill stores at 64 heads). Read through an index that
  passes an empty asm statement with side effects (a 0 LLVM can neither fold
  nor hoist), the descriptors are worked out per tile in uniform registers
  from one base, as the KV stage's are: no spills at 64 or 128 heads, and
  dense and sparse decode 1.5-7% faster on the H200 with bit-identical
  outputs (kernels/mla_decode/NOTES.md, "The query's wgmma descriptors").
  """
  def qk(s_ref):
    q = q_lat.at[pl.ds(lax.optimization_barrier(jnp.int32(0)), 2)]
    if q_head is None:
      plgpu.wgmma(s_ref, q.at[0], k_lat.at[stage, 0, slots].T)
    else:
      d = q_head.shape[1]
      plgpu.wgmma(s_ref, q_head, k_lat.at[stage, 0, slots, pl.ds(0, d)].T)
      rest = pl.ds(d, HALF - d)
      plgpu.wgmma(s_ref, q.at[0, :, rest], k_lat.at[stage, 0, slots, rest].T)
    plgpu.wgmma(s_ref, q.at[1], k_lat.at[stage, 1, slots].T)
    plgpu.wgmma(s_ref, q_rope, k_rope.at[stage, slots].T)
    return s_ref[...]

  return pl.run_scoped(qk, plgpu.ACC((HEAD_TILE, slots.size), jnp.float32))


def query_head(q_lat, q_regs: int, *, in_regs: bool):
  """`tile_scores`' `q_head`: the query's first `q_regs` latent channels
  (`q_regs / 4` registers per thread), loaded once per query; None for 0.
  With `in_regs` False (the interpreter) the same SMEM slice."""
  if not q_regs:
    return None
  head = q_lat.at[0, :, pl.ds(0, q_regs)]
  return plgpu.load(head, layout=plgpu.Layout.WGMMA) if in_regs else head


def seesaw_scratch():
  """The seesaw's P tile (`[64, 64]` bf16) and exchange rows (`[2, 64]` f32)
  as scoped SMEM, in that order."""
  return [
      plgpu.SMEM((HEAD_TILE, TILE), jnp.bfloat16, transforms=bf16_tile()),
      plgpu.SMEM((2, HEAD_TILE), jnp.float32),
  ]


def softmax_start(cols):
  """The online softmax's start for 64 rows, in wgmma layouts.

  Returns `(acc, m, l)`: the `[64, cols]` float32 accumulator (0), the row
  maxima (-inf) and the row sums (0).
  """
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  m = plgpu.layout_cast(jnp.full((HEAD_TILE,), -jnp.inf, jnp.float32), row_layout)
  l = plgpu.layout_cast(jnp.full((HEAD_TILE,), 0.0, jnp.float32), row_layout)
  acc = plgpu.layout_cast(
      jnp.full((HEAD_TILE, cols), 0.0, jnp.float32), plgpu.Layout.WGMMA
  )
  return acc, m, l


def softmax_finish(acc, m, l):
  """The online softmax's end: `(acc / l, natural-log LSE)` for `m` in log2 units.

  Rows with no weight (`l == 0`) get O = 0 times acc (so NaN accumulated in
  "multiply" mode stays NaN) and LSE = -inf. A NaN `l` (a NaN score: NaN in
  the query or in a slot read as valid) is data, not "no weight": O and LSE
  come out NaN (`!=` is true for NaN, on the GPU as in XLA).
  """
  has = l != 0.0
  inv = jnp.where(has, 1.0 / jnp.where(has, l, 1.0), 0.0)
  o = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
  lse = jnp.where(has, (m + jnp.log2(jnp.where(has, l, 1.0))) / LOG2E, -jnp.inf)
  return o, lse


def seesaw_barriers():
  """The seesaw's five one-arrival barriers: `(m0_bar, p0_bar, p1_bar, p0_free,
  p1_free)` (warpgroup 0's maximum is out; warpgroup 0's / 1's P half is out;
  that half has been read and may be overwritten)."""
  return [plgpu.Barrier(num_arrivals=1) for _ in range(5)]


def seesaw_p_scratch():
  """The interpreter's SMEM for each consumer's own P half (`[2, 64, 32]` bf16):
  it cannot take a register operand for a wgmma into an accumulator."""
  return plgpu.SMEM((2, HEAD_TILE, SLOT_HALF), jnp.bfloat16, transforms=bf16_tile())


def seesaw_begin(wg: int, bars) -> None:
  """Before a consumer's first tile: our half of P starts free for the other
  (one arrival ahead, consumed by its first wait)."""
  plgpu.barrier_arrive(bars[4] if wg == 0 else bars[3])


def seesaw_end(wg: int, bars) -> None:
  """After a consumer's last tile: consumes the other's last "read" arrival."""
  plgpu.barrier_wait(bars[3] if wg == 0 else bars[4])


def seesaw_pv(acc, slots, *, k_lat, slot, wg, p_smem, p_scratch, p=None, p_cols=None):
  """O[:, warpgroup wg's 256 channels] += P V over 32 of a tile's slots.

  P is `[64, 32]` bf16: `p` in registers, or `p_smem[:, p_cols]`. V is
  `k_lat[slot, wg, slots]`. Compiled (`p_scratch` None), the accumulator is
  seeded with `acc`; the interpreter can neither seed one (the sum is
  explicit) nor take a register operand (`p` goes through `p_scratch[wg]`).
  Refs are sliced inside the wgmma bodies: a slice closed over from outside
  does not lower.
  """
  if p_scratch is None:
    def body(o_acc_ref):
      a = p if p_cols is None else p_smem.at[:, p_cols]
      plgpu.wgmma(o_acc_ref, a, k_lat.at[slot, wg, slots])

    return pl.run_state(body)(plgpu.ACC.init(acc))

  if p_cols is None:
    p_scratch[wg] = p
    plgpu.commit_smem()

  def pv_fresh(o_acc_ref):
    a = p_scratch.at[wg] if p_cols is None else p_smem.at[:, p_cols]
    plgpu.wgmma(o_acc_ref, a, k_lat.at[slot, wg, slots])
    return o_acc_ref[...]

  return acc + pl.run_scoped(pv_fresh, plgpu.ACC((HEAD_TILE, HALF), jnp.float32))


def seesaw_pv_whole(acc, *, k_lat, slot, wg, p_smem, p_own, compiled: bool):
  """O[:, warpgroup wg's 256 channels] += P V over all 64 slots of a tile.

  For a KV ring under the 128-byte swizzle, where wgmma takes K in steps of
  64 slots. P is `[64, 64]` bf16: our half `p_own` (`[64, 32]`, registers)
  and the other's from `p_smem`, joined in registers. The interpreter takes
  no register operand and no seeded accumulator: there it reads the whole P
  from `p_smem`, where each warpgroup also stored its own half.
  """
  if compiled:
    other = plgpu.load(
        p_smem.at[:, pl.ds((1 - wg) * SLOT_HALF, SLOT_HALF)], layout=plgpu.Layout.WGMMA
    )
    p = jnp.concatenate([p_own, other] if wg == 0 else [other, p_own], axis=1)

    def body(o_acc_ref):
      plgpu.wgmma(o_acc_ref, p, k_lat.at[slot, wg])

    return pl.run_state(body)(plgpu.ACC.init(acc))

  def pv_fresh(o_acc_ref):
    plgpu.wgmma(o_acc_ref, p_smem, k_lat.at[slot, wg])
    return o_acc_ref[...]

  return acc + pl.run_scoped(pv_fresh, plgpu.ACC((HEAD_TILE, HALF), jnp.float32))


def tile_pv(*, whole: bool, k_lat, slot, wg, p_smem, p_scratch, compiled: bool):
  """`seesaw_tile`'s `pv` for a tile in KV stage `slot`: `seesaw_pv_whole`
  under the 128-byte swizzle (`whole`), else `seesaw_pv`, bound to the
  tile's stage and this warpgroup (both decode kernels)."""
  if whole:
    return functools.partial(seesaw_pv_whole, k_lat=k_lat, slot=slot, wg=wg, p_smem=p_smem,
                             compiled=compiled)
  return functools.partial(seesaw_pv, k_lat=k_lat, slot=slot, wg=wg, p_smem=p_smem,
                           p_scratch=p_scratch)


def fences_every_p(*, whole: bool, compiled: bool) -> bool:
  """Whether each tile's P hand-off must be fenced toward the async proxy
  (`seesaw_tile(fence=)`): where the other warpgroup's wgmma reads it from
  SMEM (the 64-byte swizzle) and in the interpreter. Compiled under the
  128-byte swizzle the other loads it with plain loads, which the seesaw's
  barriers order; there only what a TMA writes into P's tile next (a
  segment's RoPE query) needs a fence, which the kernels place themselves."""
  return not whole or not compiled


def region_scope(on: bool):
  """`jax.named_scope` (a profile region), or a scope that names nothing."""
  return jax.named_scope if on else (lambda name: contextlib.nullcontext())


def seesaw_tile(wg: int, s, carry, *, pv, xchg, p_smem, bars, clean=None, whole_pv=False,
                fence=True, regions=True, width=SLOT_HALF, p_half=None):
  """One 64-slot tile's softmax and PV, FlashMLA's "seesaw" over its two halves.

  Warpgroup `wg` (static) scored slots `[width wg, width (wg + 1))` (`width`
  below: 32 in both kernels): `s` is `[64, width]` float32, scaled to log2
  units and masked (-inf). The running maximum
  passes from one warpgroup to the other instead of being agreed on:
  warpgroup 0 folds its half in first (m0 = max(m, its rows)), warpgroup 1
  then (m1 = max(m0, its rows)); each multiplies its own half's P (from
  registers) into its 256 channels of O at once, and the other half's P when
  it arrives through `p_smem` (warpgroup 0's rescaled by exp2(m0 - m1)), so
  one warpgroup's softmax runs beside the other's wgmma. Returns after both
  PVs, with the other's half of `p_smem` read (the caller then releases the
  stage).

  Args:
    s: this warpgroup's scores.
    carry: `(acc, m, l)`: the `[64, 256]` accumulator; m, the running
      maximum before the tile (the same in both warpgroups); l, the sum of
      our slots' weights, at the common scale.
    pv: `seesaw_pv` bound to the tile's stage.
    xchg: `[2, 64]` float32 SMEM: the maxima handed on.
    p_smem: `[64, 64]` bf16 SMEM: each warpgroup's P half, for the other.
    bars: `seesaw_barriers()`.
    clean: None, or a callable that rewrites this warpgroup's value rows
      (its 256 channels of the tile): run once both warpgroups' QKs, which
      read those rows, are done and before this warpgroup's PVs, which are
      the only other readers (warpgroup 1 cleans as soon as warpgroup 0
      has handed on m0, and warpgroup 0 hands its P on before its own PV,
      so neither waits for the other's clean).
    whole_pv: `pv` is `seesaw_pv_whole` (a KV ring under the 128-byte
      swizzle): each warpgroup multiplies the whole P in once both halves
      are out, at the tile's maximum m1 (so warpgroup 0 rescales its
      accumulator once, and hands on the copy of its half it multiplies in
      itself), instead of its own half first. The hand-offs are the same;
      each warpgroup's own half is in `p_smem` either way (the
      interpreter's whole-P PV reads it there).
    fence: each P half (and maximum) is fenced toward the async proxy before
      it is handed on (`plgpu.commit_smem`): needed where the other's wgmma
      reads it from SMEM, or where TMA writes its tile next. Without it the
      hand-off's barrier alone orders it, for plain loads (every thread
      arrives with release semantics).
    regions: name the profile regions "handoff_wait" and "pv".
    width: the slots each warpgroup scored: `SLOT_HALF` (a tile's half, as
      both kernels run), or `TILE` where warpgroup w scored a whole tile of
      a pair (`benchmarks/probe_pair_schedule.py`, FlashMLA's schedule):
      `pv` then maps a P column slice to its tile.
    p_half: None (warpgroup k's P is `p_smem[:, k * width:(k + 1) * width]`),
      or a callable from k to the ref that holds it.

  Returns:
    `(acc, m1, l)`.
  """
  m0_bar, p0_bar, p1_bar, p0_free, p1_free = bars
  acc, m_i, l_i = carry
  scope = region_scope(regions)
  own = pl.ds(wg * width, width)
  other = pl.ds((1 - wg) * width, width)
  if p_half is None:
    p_half = lambda k: p_smem.at[:, pl.ds(k * width, width)]
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  rows = lambda k: plgpu.load(xchg.at[k], layout=row_layout, optimized=False)
  bcast = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])
  if wg == 0:
    m0 = jnp.maximum(m_i, s.max(axis=1))
    scale0 = jnp.exp2(m_i - m0)
    p = jnp.exp2(s - bcast(m0, s.shape))
    l_i = l_i * scale0 + p.sum(axis=1)
    xchg[0] = m0
    plgpu.barrier_arrive(m0_bar)  # our QK is done, m0 is out
    if not whole_pv:
      acc = acc * bcast(scale0, acc.shape)
      p16 = p.astype(jnp.bfloat16)
      if clean is None:
        with scope("pv"):
          acc = pv(acc, own, p=p16)  # beside warpgroup 1's softmax
    with scope("handoff_wait"):
      plgpu.barrier_wait(p1_bar)  # P1 and m1 are out; both QKs are done
    m1 = rows(1)
    scale1 = jnp.exp2(m0 - m1)
    if clean is not None:
      clean()
    # Our P at warpgroup 1's scale, for its channels.
    p_scaled = (p * bcast(scale1, s.shape)).astype(jnp.bfloat16)
    with scope("handoff_wait"):
      plgpu.barrier_wait(p0_free)  # warpgroup 1 is done with our last P
    p_half(wg)[...] = p_scaled
    if fence:
      plgpu.commit_smem()
    plgpu.barrier_arrive(p0_bar)
    l_i = l_i * scale1
    if whole_pv:
      # Both halves at m1: our accumulator is rescaled once, from m.
      acc = acc * bcast(jnp.exp2(m_i - m1), acc.shape)
      with scope("pv"):
        acc = pv(acc, p_own=p_scaled)
    else:
      if clean is not None:
        # After the hand-off: warpgroup 1 does not wait for this PV.
        with scope("pv"):
          acc = pv(acc, own, p=p16)
      acc = acc * bcast(scale1, acc.shape)
      with scope("pv"):
        acc = pv(acc, other, p_cols=other)
    plgpu.barrier_arrive(p1_free)  # we are done with warpgroup 1's P
  else:
    with scope("handoff_wait"):
      plgpu.barrier_wait(m0_bar)
    m0 = rows(0)
    m1 = jnp.maximum(m0, s.max(axis=1))
    scale = jnp.exp2(m_i - m0) * jnp.exp2(m0 - m1)
    p = jnp.exp2(s - bcast(m1, s.shape))
    l_i = l_i * scale + p.sum(axis=1)
    p16 = p.astype(jnp.bfloat16)
    with scope("handoff_wait"):
      plgpu.barrier_wait(p1_free)  # warpgroup 0 is done with our last P
    p_half(wg)[...] = p16
    xchg[1] = m1
    if fence:
      plgpu.commit_smem()
    plgpu.barrier_arrive(p1_bar)
    acc = acc * bcast(scale, acc.shape)
    if clean is not None:
      # Warpgroup 0's QK, the other reader of our value rows, was done when
      # it handed on m0: our rows can be cleaned without waiting for its P.
      clean()
    if whole_pv:
      with scope("handoff_wait"):
        plgpu.barrier_wait(p0_bar)  # warpgroup 0's P at our scale
      with scope("pv"):
        acc = pv(acc, p_own=p16)
    else:
      with scope("pv"):
        acc = pv(acc, own, p=p16)  # beside warpgroup 0's rescale (and clean)
      with scope("handoff_wait"):
        plgpu.barrier_wait(p0_bar)  # warpgroup 0's P at our scale
      with scope("pv"):
        acc = pv(acc, other, p_cols=other)
    plgpu.barrier_arrive(p0_free)  # we are done with warpgroup 0's P
  return acc, m1, l_i


def seesaw_row_sums(wg: int, l_own, xchg, sync_bar, *, reuse: bool):
  """After a consumer's last tile: the row sums over both halves' slots.

  Each warpgroup's sum covers its own slots; they meet through the exchange
  rows (free then: each warpgroup read the maximum the other handed on
  before the last P half passed) at a rendezvous on `sync_bar` (two
  arrivals; neither passes phase k + 1 before the other has waited on phase
  k). With `reuse` (the rows carry a next segment's maxima), a second
  rendezvous keeps those from overwriting a sum not yet read.
  """
  def rendezvous():
    plgpu.barrier_arrive(sync_bar)
    plgpu.barrier_wait(sync_bar)

  xchg[wg] = l_own
  rendezvous()
  l = l_own + plgpu.load(xchg.at[1 - wg], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
  if reuse:
    rendezvous()
  return l
