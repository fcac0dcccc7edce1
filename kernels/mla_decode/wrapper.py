"""Public entry of dense paged MLA decode: validation, launch and split combine."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxkv._types import (
    BATCH,
    HEADS,
    MLA_HEAD_DIM,
    MLA_LATENT_DIM,
    Lse,
)
from jaxkv.kernels._common import (
    check_sm_scale,
    require_interpreter_threads,
    require_kernel_device,
    resolve_interpret,
)

from . import kernel as _kernel
from . import layout as _layout
from . import merge as _merge
from . import merge_tiling as _tiling
from . import packed_merge as _packed
from .config import MLADecodeConfig, default_config
from .plan import MLADecodePlan, mla_decode_plan
from .reference import MASK_MODES, mla_decode_reference

SUPPORTED_BLOCK_SIZES = _kernel.BLOCK_SIZES
MAX_HEADS = 128


def _validate(q, cache, block_table, seq_lens, sm_scale, dv, mask_mode, plan, config):
  if q.ndim != 3 or q.shape[-1] != MLA_HEAD_DIM:
    raise ValueError(f"{q.shape=} must be [batch, heads, {MLA_HEAD_DIM}]")
  batch, heads, _ = q.shape
  if not 1 <= heads <= MAX_HEADS:
    raise ValueError(f"{q.shape=}: heads must be in [1, {MAX_HEADS}]")
  if q.dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"{q.dtype=} must be bfloat16 or float32")
  if cache.ndim != 3 or cache.shape[-1] != MLA_HEAD_DIM:
    raise ValueError(f"{cache.shape=} must be [num_blocks, block_size, {MLA_HEAD_DIM}]")
  if cache.shape[1] not in SUPPORTED_BLOCK_SIZES:
    raise ValueError(f"{cache.shape=}: block_size must be one of {SUPPORTED_BLOCK_SIZES}")
  if cache.dtype != jnp.bfloat16:
    raise ValueError(f"{cache.dtype=} must be bfloat16")
  if block_table.ndim != 2 or block_table.shape[0] != batch:
    raise ValueError(f"{block_table.shape=} must be [batch={batch}, max_blocks]")
  if block_table.shape[1] < 1:
    raise ValueError(f"{block_table.shape=} must have at least one column")
  if block_table.dtype != jnp.int32:
    raise ValueError(f"{block_table.dtype=} must be int32")
  if seq_lens.shape != (batch,) or seq_lens.dtype != jnp.int32:
    raise ValueError(f"{seq_lens.shape=} {seq_lens.dtype=} must be [{batch}] int32")
  check_sm_scale(sm_scale)
  if dv != MLA_LATENT_DIM:
    raise ValueError(f"{dv=} must be {MLA_LATENT_DIM}")
  if mask_mode not in MASK_MODES:
    raise ValueError(f"{mask_mode=} must be one of {MASK_MODES}")
  if plan is not None:
    if not isinstance(plan, MLADecodePlan):
      raise ValueError(f"plan must be an MLADecodePlan, got {type(plan)}")
    b = plan.bounds
    if b.ndim != 2 or b.shape[0] != batch or b.shape[1] < 2 or b.dtype != jnp.int32:
      raise ValueError(f"{plan.bounds.shape=} {plan.bounds.dtype=} must be [{batch}, splits + 1] int32")
    if plan.row_start.shape != (batch + 1,) or plan.row_start.dtype != jnp.int32:
      raise ValueError(f"{plan.row_start.shape=} {plan.row_start.dtype=} must be [{batch + 1}] int32")
    pr = plan.part_rows
    if pr.ndim != 2 or pr.shape[0] < 1 or pr.shape[1] != 2 or pr.dtype != jnp.int32:
      raise ValueError(f"{plan.part_rows.shape=} {plan.part_rows.dtype=} must be [parts, 2] int32")
    ps = plan.part_start
    if ps.shape != (pr.shape[0] + 1,) or ps.dtype != jnp.int32:
      raise ValueError(f"{plan.part_start.shape=} {plan.part_start.dtype=} must be [parts + 1 = {pr.shape[0] + 1}] int32")
    if plan.row_part.shape != (batch,) or plan.row_part.dtype != jnp.int32:
      raise ValueError(f"{plan.row_part.shape=} {plan.row_part.dtype=} must be [{batch}] int32")
  if config is not None and not isinstance(config, MLADecodeConfig):
    raise ValueError(f"config must be an MLADecodeConfig, got {type(config)}")


def mla_decode(
    q: jax.Array,
    cache: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float,
    dv: int = 512,
    mask_mode: str = "select",
    plan: MLADecodePlan | None = None,
    config: MLADecodeConfig | None = None,
    interpret: Any = None,
) -> tuple[Float[Array, f"{BATCH} {HEADS} dv"], Lse]:
  """Dense paged MLA decode (absorbed form), NaN-safe in "select" mode.

  The inputs are validated here (a `ValueError` naming the argument) rather
  than by shape annotations, so that any mismatch reads the same.

  Args:
    q: `[batch, heads, 576]` bf16 or float32 queries, heads in [1, 128]
      (computed in groups of 64; a multiple of 8 goes in as it is, other
      counts are padded to the group around the kernels, an XLA op each
      way). The kernels take float32 queries cast to bf16 (an XLA op), and
      their bf16 result is cast back.
    cache: `[num_blocks, block_size, 576]` bf16 latent cache (512 latent +
      64 RoPE), block_size 32, 64 or 128.
    block_table: `[batch, max_blocks]` int32, padded with 0 (never read past
      a row's blocks). An entry of a row's blocks outside `[0, num_blocks)`
      reads as a block of zeros, never another block.
    seq_lens: `[batch]` int32; 0 gives `out = 0`, `lse = -inf` and reads
      nothing; values are clipped to `[0, max_blocks * block_size]`.
    sm_scale: scale of the logits.
    dv: value channels; must be 512.
    mask_mode: "select" (masked slots never reach the accumulator) or
      "multiply" (the unwritten slots the kernel reads, those of a row's
      last block up to a multiple of 64 slots, are accumulated with
      probability 0, like FlashMLA).
    plan: the split plan of this step from `mla_decode_plan`; computed here
      when None.
    config: tuning config: the plan's parameters when `plan` is None, and
      the kernel's `kv_swizzle` and `q_regs` either way (the device's tuned or heuristic
      config when None). A compiled call runs `config.implementation`: the
      Pallas kernels need a Hopper GPU (a `ValueError` names any other
      device); "xla" runs the reference anywhere, the default on other GPUs.
    interpret: see `jaxkv.kernels._common.resolve_interpret`.

  Returns:
    `out` `[batch, heads, 512]` in q's dtype and `lse` `[batch, heads]`
    float32 (natural log). A NaN in a head's query or in a slot the row
    holds (below its `seq_len`) gives that head NaN `out` and `lse`, as the
    reference does, whatever the split plan and merge. A batch of 0 rows
    gets empty results, with nothing launched.
  """
  _validate(q, cache, block_table, seq_lens, sm_scale, dv, mask_mode, plan, config)
  if q.shape[0] == 0:  # a step without decode rows: nothing to read or launch
    return jnp.zeros((0, q.shape[1], dv), q.dtype), jnp.zeros((0, q.shape[1]), jnp.float32)
  interpret = resolve_interpret(interpret)
  if interpret is not None:
    require_interpreter_threads(_layout.NUM_THREADS, "mla_decode")
  if config is None:
    config = default_config(batch=q.shape[0], num_heads=q.shape[1])
  with jax.named_scope("jaxkv.mla_decode"):
    if interpret is None:  # compiled
      if config.implementation == "xla":
        return _reference(q, cache, block_table, seq_lens, sm_scale=float(sm_scale), dv=dv,
                          mask_mode=mask_mode)
      require_kernel_device("mla_decode", "config=MLADecodeConfig(implementation='xla')")
    if plan is None:
      plan = mla_decode_plan(seq_lens, num_heads=q.shape[1], block_size=cache.shape[1], config=config)
    out, lse = _mla_decode(
        q.astype(jnp.bfloat16), cache, block_table, seq_lens, plan,
        sm_scale=float(sm_scale), select=mask_mode == "select",
        interpret=interpret, kv_swizzle=config.kv_swizzle, q_regs=config.q_regs,
    )
    return out.astype(q.dtype), lse


_reference = jax.jit(mla_decode_reference, static_argnames=("sm_scale", "dv", "mask_mode"))


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "select", "interpret", "kv_swizzle", "q_regs", "grouped",
                              "group_cols", "finish", "p_fence", "stage_merge_out", "pad_heads",
                              "pack", "f16_partials", "group_halves", "merge_lean"))
def _mla_decode(q, cache, block_table, seq_lens, plan, *, sm_scale, select, interpret, kv_swizzle,
                q_regs, grouped=None, group_cols=None, finish=None, p_fence=None,
                stage_merge_out=True, pad_heads=False, pack=True, f16_partials=None,
                group_halves=None, merge_lean=True):
  batch, heads, _ = q.shape
  block_size = cache.shape[1]
  max_blocks = block_table.shape[1]
  heads_padded = -(-heads // _layout.HEAD_TILE) * _layout.HEAD_TILE
  # Head counts that are a multiple of 8 (the query tile's row groups: every
  # tensor-parallel share of 128 or 64 heads) go in unpadded: the kernel
  # copies the real rows alone and zeroes the rest of its query tile once.
  # Others are padded here to the head group of 64 (an XLA op per call), as
  # every count is with `pad_heads` (the benchmark's A/B).
  q_rows = _layout.query_rows(heads, pad=pad_heads)
  if q_rows != heads:
    q = jnp.pad(q, ((0, 0), (0, heads_padded - heads), (0, 0)))
  # The kernels clip every plan value and length themselves (a stale or
  # foreign plan cannot walk past a row's blocks): no XLA op per call.
  # More rows than parts: parts outgrow rows and many rows are one segment,
  # which the kernel then finishes itself (out / lse_out; the splits of the
  # other rows come back in o / lse). Otherwise few rows are whole, and what
  # the merge saves the epilogue's branch costs (128 x 64 x 4K-8K on the H200:
  # even). `finish` forces it on or off (the benchmark's A/B).
  finish_rows = batch > plan.num_parts if finish is None else finish
  # Rows of the result: the merge's staged stores write the real heads alone
  # where it writes every row (the kernel's finished rows go out from
  # registers in whole head groups); otherwise the padded result is cut here.
  out_rows = heads if q_rows == heads and stage_merge_out and not finish_rows else heads_padded
  # Rows of many splits (batch 1-4 past 32 splits; 17-32 with one head
  # group): one grouped pass (`merge_tiling.use_grouped`; `grouped` True / False
  # forces it where it can run / keeps it off, `group_cols` sets its channels
  # per CTA), which reads the partials in its own layout. `group_halves=True`
  # runs it in halves, two CTAs per tile in a cluster, each over half of the
  # splits, where it can run. By default (None) it does so with float16
  # partials where a row has more splits than one grouped CTA takes
  # (`GROUP_MAX_SPLITS`: 1 x 64 at 133 splits on 132 SMs), instead of the
  # per-split ring's two passes: on an H100, 0.957-0.959 of them end to end
  # at 1 x 64 x 128K, 0.943 at 1 x 64 x 64K; at 27-101 splits, where one
  # grouped CTA per tile takes the rows, halves lost (1.008-1.036; NOTES.md).
  # The grouped pass runs as loops over the live splits and groups (on an
  # H100 its merge took 6.2-6.6 µs where straight-line code over every split
  # slot, since removed, took 7.0-9.2; NOTES.md). `merge_lean`: in every
  # merge but the stacked one, a row's live splits counted once its first
  # copies are issued, and the grouped pass's maximum over groups of
  # independent LSE loads (`merge.build_merge(lean=True)`; False: the merges
  # as first timed).
  head_groups = heads_padded // _layout.HEAD_TILE
  if group_halves is None:
    group_halves = plan.num_splits > _tiling.GROUP_MAX_SPLITS
  halves = bool(group_halves) and _tiling.can_group(plan.num_splits, True) and not finish_rows
  if grouped is None:
    group = halves or _tiling.use_grouped(
        batch=batch, head_groups=head_groups, num_splits=plan.num_splits)
  else:
    group = grouped and _tiling.can_group(plan.num_splits, halves)
  halves = halves and group
  rows_per_cta = _packed.pack_rows(heads=q_rows, head_groups=head_groups,
                                  num_splits=plan.num_splits)
  packed = pack and rows_per_cta > 1 and not group and stage_merge_out and q.dtype.itemsize == 2
  # The partials in scaled float16 (half their bytes on both sides of the
  # merge), staged through the segment's last KV stage and stored by TMA,
  # where the per-split ring merges them in one pass or two (1.5-4.7% faster
  # on the H200 at batch 1-200 and 64-128 heads, NOTES.md). The grouped
  # merge reads them too (stored from registers in its column slices), whole
  # or in halves: on an H100, 0.965-0.985 of float32 end to end at every
  # grouped shape timed, the decode kernel writing half the bytes; in halves
  # 0.966 of float32 at 1 x 64 x 128K (NOTES.md).
  # Rows of 8-32 heads keep float32 whichever merge takes
  # them (the stacked merge reads float32, and its A/B knobs then compare
  # like with like). `f16_partials` True / False forces them on where they
  # can run / off.
  few_heads = _packed.rows_stack(heads=heads, num_splits=plan.num_splits)
  if f16_partials is None:
    f16_partials = not few_heads
  elif f16_partials and packed:
    raise ValueError("f16_partials: not with the stacked merge of rows of 8-32 heads")
  # One tiling for both: the decode kernel stores its partials in the grouped
  # merge CTAs' layout, `partial_cols` channels each.
  tiling = {}
  if group:
    cols, stages = _tiling.grouped_tiling(
        batch=batch, head_groups=head_groups, num_splits=plan.num_splits, cols=group_cols,
        f16=f16_partials, halves=halves)
    tiling = dict(cols=cols, stages=stages)
  call = _kernel.build_kernel(
      batch=batch, heads_padded=heads_padded, num_parts=plan.num_parts,
      num_splits=plan.num_splits, block_size=block_size, sm_scale=sm_scale,
      select=select, interpret=interpret, finish_rows=finish_rows, kv_swizzle=kv_swizzle,
      q_regs=q_regs, partial_cols=tiling.get("cols"), p_fence=p_fence, q_heads=q_rows,
      f16_partials=f16_partials,
  )
  o, lse, *finished = call(q, cache, block_table, seq_lens, plan.row_start,
                       plan.part_rows, plan.part_start, plan.row_part)
  # With float16 partials their scales come first.
  scale, finished = (finished[:1], finished[1:]) if f16_partials else ((), finished)
  merge_args = dict(
      batch=batch, heads_padded=heads_padded, dv=_layout.LATENT,
      max_tokens=max_blocks * block_size, interpret=interpret, lean=merge_lean,
  )
  if not group and plan.num_splits > _tiling.MAX_SPLITS:
    # Rows of many splits: one CTA per row would walk them one after another;
    # merged in chunks first (a CTA per chunk as well), then the chunks'
    # results as the rows' splits.
    chunk = _tiling.CHUNK
    first = _merge.build_merge(
        num_splits=plan.num_splits, out_dtype=jnp.float32, chunk=chunk,
        partial_heads=q_rows, f16_partials=f16_partials, **merge_args)
    o, lse = first(seq_lens, plan.bounds, o, lse, *scale)
    # The second pass reads the chunks' bounds from the plan's own columns.
    second = _merge.build_merge(
        num_splits=o.shape[1], out_dtype=q.dtype, finish_rows=finish_rows,
        edge_chunk=chunk, stage_out=stage_merge_out, out_heads=out_rows, **merge_args
    )
    out, lse_out = second(seq_lens, plan.bounds, o, lse, *finished)
    return _layout.real_heads(out, lse_out, heads)
  # Rows of few heads (8-32, one head group): several rows' heads stacked in
  # one CTA's tile (`packed_merge.build_packed_merge`; `pack=False` keeps a CTA per
  # row, the benchmark's A/B).
  if packed:
    merge = _packed.build_packed_merge(
        batch=batch, num_splits=plan.num_splits, heads=q_rows, dv=_layout.LATENT,
        max_tokens=max_blocks * block_size, out_dtype=q.dtype, interpret=interpret,
        finish_rows=finish_rows,
    )
    out, lse_out = merge(seq_lens, plan.bounds, o, lse, *finished)
    return _layout.real_heads(out, lse_out, heads)
  # A row's live splits are its first ones; the merge reads those alone (of
  # the last head group's partials, the `q_rows` real rows the kernel wrote
  # alone), never the unwritten rest, and writes the rows the kernel did not:
  # by TMA from SMEM (`stage_merge_out`; from registers, its bf16 stores cost
  # the merge 2-3.4 µs more at batch 128 on the H200, NOTES.md).
  merge = _merge.build_merge(
      num_splits=plan.num_splits, out_dtype=q.dtype, finish_rows=finish_rows, group=group,
      stage_out=stage_merge_out, out_heads=out_rows, partial_heads=q_rows, **tiling,
      f16_partials=f16_partials, halves=halves, **merge_args
  )
  out, lse_out = merge(seq_lens, plan.bounds, o, lse, *scale, *finished)
  return _layout.real_heads(out, lse_out, heads)
