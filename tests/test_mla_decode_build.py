"""Dense paged MLA decode, what a CPU checks of the build beside the values:
input validation, the compiled kernels' CUDA lowering, the launch's limits,
and the XLA ops around the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.mla_decode import (
    MLADecodeConfig,
    MLADecodePlan,
    mla_decode,
    mla_decode_plan,
)

from mla_problem import BS, FAST, SCALE, jitted_ops, problem


def _bad_plan(**change):
  """A plan of the right shapes for batch 2 and one part, with `change` applied."""
  fields = dict(
      bounds=jnp.zeros((2, 2), jnp.int32), row_start=jnp.zeros((3,), jnp.int32),
      part_rows=jnp.zeros((1, 2), jnp.int32), part_start=jnp.zeros((2,), jnp.int32),
      row_part=jnp.zeros((2,), jnp.int32),
  )
  fields.update(change)
  return MLADecodePlan(**fields)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=jnp.zeros((2, 4, 512), jnp.bfloat16)), "q.shape"),
        (dict(q=jnp.zeros((2, 4, 576), jnp.float16)), "q.dtype"),
        (dict(cache=jnp.zeros((4, 16, 576), jnp.bfloat16)), "block_size"),
        (dict(cache=jnp.zeros((4, 96, 576), jnp.bfloat16)), "block_size"),
        (dict(cache=jnp.zeros((4, 64, 576), jnp.float16)), "cache.dtype"),
        (dict(block_table=jnp.zeros((3, 2), jnp.int32)), "block_table.shape"),
        (dict(block_table=jnp.zeros((2, 2), jnp.int64 if jax.config.x64_enabled else jnp.int16)), "block_table.dtype"),
        (dict(seq_lens=jnp.zeros((3,), jnp.int32)), "seq_lens"),
        (dict(sm_scale=-1.0), "sm_scale"),
        (dict(sm_scale=0.0), "sm_scale"),
        (dict(sm_scale=float("nan")), "sm_scale"),
        (dict(sm_scale=float("inf")), "sm_scale"),
        (dict(dv=256), "dv"),
        (dict(mask_mode="zero"), "mask_mode"),
        (dict(plan=_bad_plan(bounds=jnp.zeros((3, 2), jnp.int32))), "plan.bounds"),
        (dict(plan=_bad_plan(row_start=jnp.zeros((2,), jnp.int32))), "plan.row_start"),
        (dict(plan=_bad_plan(part_rows=jnp.zeros((1, 3), jnp.int32))), "plan.part_rows"),
        (dict(plan=_bad_plan(part_start=jnp.zeros((3,), jnp.int32))), "plan.part_start"),
        (dict(plan=_bad_plan(part_start=jnp.zeros((2,), jnp.float32))), "plan.part_start"),
        (dict(plan=_bad_plan(row_part=jnp.zeros((3,), jnp.int32))), "plan.row_part"),
    ],
)
def test_bad_inputs(change, match):
  args = dict(
      q=jnp.zeros((2, 4, 576), jnp.bfloat16), cache=jnp.zeros((4, 64, 576), jnp.bfloat16),
      block_table=jnp.zeros((2, 2), jnp.int32), seq_lens=jnp.zeros((2,), jnp.int32),
      sm_scale=0.1, dv=512, mask_mode="select", plan=None,
  )
  args.update(change)
  q, cache, table, lens = (args.pop(k) for k in ("q", "cache", "block_table", "seq_lens"))
  with pytest.raises(ValueError, match=match.replace(".", r"\.")):
    mla_decode(q, cache, table, lens, **args)


def test_a_step_without_rows_returns_empty_results():
  """Batch 0 (a step of prefills alone): empty results of the right shapes and
  dtypes, nothing launched; its inputs are still validated; a plan for it is
  refused by name (there is nothing to plan)."""
  cache = jnp.zeros((4, 64, 576), jnp.bfloat16)
  q = jnp.zeros((0, 16, 576), jnp.bfloat16)
  table, lens = jnp.zeros((0, 3), jnp.int32), jnp.zeros((0,), jnp.int32)
  out, lse = mla_decode(q, cache, table, lens, sm_scale=SCALE)
  assert out.shape == (0, 16, 512) and out.dtype == jnp.bfloat16
  assert lse.shape == (0, 16) and lse.dtype == jnp.float32
  out, lse = jax.jit(lambda *a: mla_decode(*a, sm_scale=SCALE))(q, cache, table, lens)
  assert out.shape == (0, 16, 512) and lse.shape == (0, 16)
  with pytest.raises(ValueError, match=r"block_table\.dtype"):
    mla_decode(q, cache, table.astype(jnp.float32), lens, sm_scale=SCALE)
  with pytest.raises(ValueError, match=r"seq_lens\.shape=\(0,\) must be \[batch\] with batch >= 1"):
    mla_decode_plan(lens, num_heads=16)


def test_profiler_needs_a_compiled_kernel():
  from jaxkv.kernels.mla_decode import kernel

  with pytest.raises(ValueError, match="profile_dir"):
    kernel.build_kernel(
        batch=1, heads_padded=64, num_parts=1, num_splits=1, block_size=64,
        sm_scale=0.1, select=True, interpret=object(), profile_dir="/tmp/trace",
    )
  with pytest.raises(ValueError, match="kv_swizzle"):
    kernel.build_kernel(
        batch=1, heads_padded=64, num_parts=1, num_splits=1, block_size=64,
        sm_scale=0.1, select=True, interpret=None, kv_swizzle=32,
    )
  with pytest.raises(ValueError, match="q_regs"):
    kernel.build_kernel(
        batch=1, heads_padded=64, num_parts=1, num_splits=1, block_size=64,
        sm_scale=0.1, select=True, interpret=None, q_regs=256,
    )


@pytest.mark.parametrize(
    "block_size, select, finish_rows, kv_swizzle, q_regs",
    [(64, True, True, 64, 0), (32, False, False, 64, 128), (128, True, False, 64, 64),
     (64, False, True, 128, 0), (32, True, False, 128, 64), (128, False, False, 128, 128),
     (64, True, True, 64, 192)],
)
def test_compiled_kernels_lower_for_hopper(block_size, select, finish_rows, kv_swizzle, q_regs):
  """The compiled kernels' own paths (the RoPE query in registers, the seeded
  accumulator) exist only for the GPU, where the interpreter cannot run them:
  lowering the decode and merge kernels for CUDA here catches a broken body on a
  CPU machine. (Their results are checked on the H200 by the benchmark script.)"""
  from jaxkv.kernels.mla_decode import kernel, merge

  batch, hp, parts, splits, max_blocks = 2, 128, 4, 3, 8
  decode = kernel.build_kernel(
      batch=batch, heads_padded=hp, num_parts=parts, num_splits=splits,
      block_size=block_size, sm_scale=SCALE, select=select, interpret=None,
      finish_rows=finish_rows, kv_swizzle=kv_swizzle, q_regs=q_regs,
  )
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  args = (
      jax.ShapeDtypeStruct((batch, hp, 576), jnp.bfloat16),
      jax.ShapeDtypeStruct((16, block_size, 576), jnp.bfloat16),
      i32(batch, max_blocks), i32(batch), i32(batch + 1), i32(parts, 2), i32(parts + 1),
      i32(batch),
  )
  text = jax.jit(decode).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "wgmma.mma_async" in text and "setmaxnreg" in text
  # The QK reads the query through `seesaw.tile_scores`' opaque index: without
  # it LLVM hoists the query's wgmma descriptors into 42 registers and the tile
  # loop spills (kernels/mla_decode/NOTES.md).
  assert "optimization_barrier" in text
  combine = merge.build_merge(
      batch=batch, num_splits=splits, heads_padded=hp, dv=512,
      max_tokens=max_blocks * block_size, out_dtype=jnp.bfloat16, interpret=None,
      finish_rows=finish_rows,
  )
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  merge_args = (i32(batch), i32(batch, splits + 1), f32(batch, splits, hp, 512), f32(batch, splits, hp))
  if finish_rows:
    merge_args += (jax.ShapeDtypeStruct((batch, hp, 512), jnp.bfloat16), f32(batch, hp))
  merge_text = jax.jit(combine).trace(*merge_args).lower(lowering_platforms=("cuda",)).as_text()
  # With finish_rows the merge writes into the decode kernel's output in place.
  assert ("output_operand_aliases" in merge_text) == finish_rows
  # The second of two passes, reading its chunks' bounds from the plan's columns.
  second = merge.build_merge(
      batch=batch, num_splits=2, heads_padded=hp, dv=512, max_tokens=max_blocks * block_size,
      out_dtype=jnp.bfloat16, interpret=None, edge_chunk=2,
  )
  second_args = (i32(batch), i32(batch, splits + 1), f32(batch, 2, hp, 512), f32(batch, 2, hp))
  assert "mosaic_gpu" in jax.jit(second).trace(*second_args).lower(lowering_platforms=("cuda",)).as_text()


def test_p_hand_offs_fence_only_where_the_async_proxy_reads(monkeypatch, capsys):
  """The consumers fence P toward the async proxy (`commit_smem`) before handing
  it on only where the other's wgmma reads it from SMEM (the 64-byte ring) or
  TMA writes its tile next (a segment's last tile): under the 128-byte ring the
  steady-state tile's two hand-offs go unfenced, since the other warpgroup
  loads P with plain loads. Counted in the Mosaic GPU module the compiled
  kernel lowers to (what the GPU runs; the interpreter fences every tile, and
  the H200 check compares `p_fence=True` bitwise with the default)."""
  import functools

  from jaxkv.kernels.mla_decode import kernel, layout

  # `layout.launch` builds the call through `plgpu.kernel`.
  monkeypatch.setattr(layout.plgpu, "kernel", functools.partial(plgpu.kernel, debug=True))
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  batch, hp, parts, max_blocks = 2, 64, 4, 8
  args = (
      jax.ShapeDtypeStruct((batch, hp, 576), jnp.bfloat16),
      jax.ShapeDtypeStruct((16, 64, 576), jnp.bfloat16),
      i32(batch, max_blocks), i32(batch), i32(batch + 1), i32(parts, 2), i32(parts + 1),
      i32(batch),
  )

  def fences(kv_swizzle, p_fence):
    decode = kernel.build_kernel(
        batch=batch, heads_padded=hp, num_parts=parts, num_splits=3, block_size=64,
        sm_scale=SCALE, select=True, interpret=None, kv_swizzle=kv_swizzle, p_fence=p_fence,
    )
    capsys.readouterr()
    jax.jit(decode).trace(*args).lower(lowering_platforms=("cuda",))
    return capsys.readouterr().out.count("nvvm.fence.proxy")

  # One hand-off per consumer and tile body (the loop's and the peeled last
  # tile's): two fewer fences under the 128-byte ring, none fewer under 64.
  every = fences(128, True)
  assert every >= 4 and fences(128, None) == every - 2
  assert fences(64, None) == fences(64, True)


@pytest.mark.parametrize("op", ["mla_decode", "sparse_mla_decode"])
def test_register_split_fits_the_launch(op):
  """`setmaxnreg` can only move registers inside the launch's allocation (168
  per thread for three warpgroups); a split past it hangs the consumers on the
  GPU, where the interpreter cannot notice. Both kernels' splits must fit."""
  import importlib

  from jaxkv.kernels.mla_decode.layout import NUM_THREADS  # both kernels' launch

  k = importlib.import_module(f"jaxkv.kernels.{op}.cta")
  regs = (k.PRODUCER_REGS, k.CONSUMER_REGS)
  assert all(r % 8 == 0 and 24 <= r <= 256 for r in regs), regs
  per_thread = 65536 // (NUM_THREADS * 128) // 8 * 8
  assert per_thread == 168
  assert k.PRODUCER_REGS + 2 * k.CONSUMER_REGS <= NUM_THREADS * per_thread, regs


def test_interpreter_without_enough_cpu_threads_fails_fast(monkeypatch):
  """Where the CPU backend cannot run the three warpgroups at once, the interpreted
  kernel would wait forever: the call raises, naming the fix, before launching."""
  import importlib

  common = importlib.import_module("jaxkv.kernels._common")
  assert common.cpu_parallelism() >= 24  # the suite's 24 CPU devices
  monkeypatch.setattr(common, "cpu_parallelism", lambda: 2)
  q, cache, table, lens = (jnp.asarray(x) for x in problem(0, [BS + 3], 16))
  with pytest.raises(ValueError, match="jax_num_cpu_devices"):
    mla_decode(q, cache.astype(jnp.bfloat16), table, lens, sm_scale=0.1, interpret=True)


def _call_ops(heads, seq_lens, config, num_sms=132):
  """The primitives of one `mla_decode` call's jitted body (one level in: the
  kernels are one op each; what else runs is XLA ops of its own)."""
  q, cache, table, lens = problem(5, seq_lens, heads)
  plan = mla_decode_plan(jnp.asarray(lens), num_heads=heads, config=config, num_sms=num_sms)
  return jitted_ops(
      lambda q, c: mla_decode(q, c, jnp.asarray(table), jnp.asarray(lens), sm_scale=SCALE,
                              plan=plan, config=config, interpret=FAST),
      q, jnp.asarray(cache, jnp.bfloat16))


@pytest.mark.parametrize(
    "heads,seq_lens,sms,pad,cut",
    [
        (16, [3 * BS, 2 * BS], 132, False, False),  # 8 x 16 heads, unpadded
        (96, [3 * BS, 2 * BS], 132, False, False),
        (20, [3 * BS, 2 * BS], 132, True, True),  # not a multiple of 8: padded
        # More rows than parts: the kernel finishes rows in whole head groups.
        (16, [3 * BS, 2 * BS, BS, 5], 2, False, True),
    ],
)
def test_heads_below_a_head_group_need_no_pad_or_slice(heads, seq_lens, sms, pad, cut):
  """A call at a multiple of 8 heads is the kernels alone: no XLA pad of q to
  64 heads, no slice of the result (each its own launch per call: 3.5-5.4% of
  a 16-head call on the H200, kernels/mla_decode/NOTES.md), except where
  the kernel writes whole rows itself."""
  config = MLADecodeConfig(num_splits=3, min_chunk_blocks=1)
  ops = _call_ops(heads, seq_lens, config, num_sms=sms)
  assert ("pad" in ops) == pad
  assert ("slice" in ops) == cut


@pytest.mark.parametrize("heads,kv_swizzle,group", [(16, 128, False), (96, 64, True)])
def test_unpadded_heads_lower_for_hopper(heads, kv_swizzle, group):
  """The compiled decode kernel with an unpadded query (its zeroed rows and
  the last head group's shorter copies) and the merge storing the real heads
  alone (ring or grouped) lower for CUDA here."""
  from jaxkv.kernels.mla_decode import kernel, merge, merge_tiling

  batch, parts, mb = 2, 4, 8
  hp = -(-heads // 64) * 64
  splits = 40 if group else 3
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  tiling = {}
  if group:
    cols, stages = merge_tiling.grouped_tiling(batch=batch, head_groups=hp // 64, num_splits=splits)
    tiling = dict(cols=cols, stages=stages)
  decode = kernel.build_kernel(
      batch=batch, heads_padded=hp, num_parts=parts, num_splits=splits, block_size=64,
      sm_scale=SCALE, select=True, interpret=None, kv_swizzle=kv_swizzle, q_heads=heads,
      partial_cols=tiling.get("cols"),
  )
  args = (jax.ShapeDtypeStruct((batch, heads, 576), jnp.bfloat16),
          jax.ShapeDtypeStruct((16, 64, 576), jnp.bfloat16),
          i32(batch, mb), i32(batch), i32(batch + 1), i32(parts, 2), i32(parts + 1), i32(batch))
  assert "wgmma.mma_async" in jax.jit(decode).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  o, lse = jax.eval_shape(decode, *args)
  combine = merge.build_merge(
      batch=batch, num_splits=splits, heads_padded=hp, dv=512, max_tokens=mb * 64,
      out_dtype=jnp.bfloat16, interpret=None, stage_out=True, out_heads=heads, group=group,
      partial_heads=heads, **tiling)
  out, lse_out = jax.eval_shape(combine, i32(batch), i32(batch, splits + 1), o, lse)
  assert out.shape == (batch, heads, 512) and lse_out.shape == (batch, heads)
  text = jax.jit(combine).trace(i32(batch), i32(batch, splits + 1), o, lse).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
