"""Sparse MLA decode's compiled kernel lowered for CUDA on the CPU: the paths the
interpreter cannot run (the per-thread cp.async gather, stage mbarriers, clusters)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from sparse_problem import BLOCK_SIZE, NUM_BLOCKS, SCALE


@pytest.mark.parametrize(
    "select, splits, heads, q_regs, stage_out, kv_swizzle",
    [(True, 1, 64, 0, False, 64), (False, 2, 128, 0, False, 64), (True, 1, 128, 128, False, 64),
     (False, 1, 128, 128, True, 64),
     # Unpadded queries: the zeroed query rows, the last group's shorter copies
     # and (staged) stores.
     (True, 1, 16, 0, True, 64), (False, 2, 96, 0, False, 64),
     # The gather into 64-column tiles, the whole-P PV with P from registers.
     (True, 1, 128, 128, True, 128), (False, 2, 64, 0, False, 128)],
)
def test_compiled_kernel_lowers_for_hopper(select, splits, heads, q_regs, stage_out, kv_swizzle):
  """The compiled kernel's own path (the per-thread cp.async gather, the stage
  mbarriers, "multiply"'s warp reduction) exists only for the GPU, where the
  interpreter cannot run it: lowering it for CUDA here catches a broken body on a
  CPU machine. (Its results are checked on the H200 by the benchmark script.)"""
  from jaxkv.kernels.sparse_mla_decode import kernel as K

  batch, topk = 2, 64 * splits
  call = K.build_kernel(
      batch=batch, heads_padded=-(-heads // 64) * 64, topk=topk, num_splits=splits,
      sm_scale=SCALE, select=select, interpret=None, q_regs=q_regs, stage_out=stage_out,
      out_dtype=jnp.bfloat16, q_heads=heads, kv_swizzle=kv_swizzle,
  )
  _assert_lowers(call, batch, heads, topk, select)


def _assert_lowers(call, batch, heads, topk, select):
  args = (
      jax.ShapeDtypeStruct((batch, heads, 576), jnp.bfloat16),
      jax.ShapeDtypeStruct((NUM_BLOCKS * BLOCK_SIZE, 576), jnp.bfloat16),
      jax.ShapeDtypeStruct((batch, topk), jnp.int32),
  )
  text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  ops = ["nvvm.cp.async.shared.global", "nvvm.cp.async.mbarrier.arrive",
         "nvvm.mbarrier.try_wait.parity", "nvvm.mbarrier.init"]
  if not select:
    ops.append("nvvm.redux.sync")
  for op in ops:
    assert op in text, op
  return text


@pytest.mark.parametrize("select, heads, splits", [(True, 128, 8), (False, 16, 2)])
def test_compiled_kernel_with_cluster_merge_lowers_for_hopper(select, heads, splits):
  """`cluster_merge` on the compiled path: clusters, and `barrier.cluster` in
  place of the interpreter's cluster barrier."""
  from jaxkv.kernels.sparse_mla_decode import kernel as K

  batch, topk = 2, 64 * splits
  call = K.build_kernel(
      batch=batch, heads_padded=-(-heads // 64) * 64, topk=topk, num_splits=splits,
      sm_scale=SCALE, select=select, interpret=None, q_regs=128, stage_out=True,
      out_dtype=jnp.bfloat16, q_heads=heads, cluster_merge=True, kv_swizzle=128,
  )
  text = _assert_lowers(call, batch, heads, topk, select)
  assert "barrier.cluster.arrive.release.aligned" in text
  assert "gpu.cluster_block_id" in text


@pytest.mark.parametrize("select, heads", [(True, 128), (False, 16)])
def test_compiled_kernel_with_rows_cut_in_halves_lowers_for_hopper(select, heads):
  """`cut_rows` on the compiled path: tile counts per CTA known only at run
  time, and both the direct (staged) and the partial stores in one body, in
  halves and in three pieces."""
  from jaxkv.kernels.sparse_mla_decode import kernel as K

  batch, topk = 3, 192
  for pieces in (2, 3):
    call = K.build_kernel(
        batch=batch, heads_padded=-(-heads // 64) * 64, topk=topk, num_splits=1,
        sm_scale=SCALE, select=select, interpret=None, q_regs=128, stage_out=True,
        out_dtype=jnp.bfloat16, q_heads=heads, cut_rows=2, pieces=pieces, kv_swizzle=128,
    )
    _assert_lowers(call, batch, heads, topk, select)


@pytest.mark.parametrize("select, heads", [(True, 128), (False, 16)])
def test_compiled_kernel_with_halves_merged_in_clusters_lowers_for_hopper(select, heads):
  """`cut_rows` with `cluster_merge` on the compiled path: clusters of two,
  `barrier.cluster` met by the cut rows' clusters alone, and the merged
  pieces staged in the KV ring's bytes (at 16 heads the real rows alone)."""
  from jaxkv.kernels.sparse_mla_decode import kernel as K

  batch, topk = 4, 192
  call = K.build_kernel(
      batch=batch, heads_padded=-(-heads // 64) * 64, topk=topk, num_splits=1,
      sm_scale=SCALE, select=select, interpret=None, q_regs=128, stage_out=True,
      out_dtype=jnp.bfloat16, q_heads=heads, cut_rows=2, cluster_merge=True, kv_swizzle=128,
  )
  text = _assert_lowers(call, batch, heads, topk, select)
  assert "barrier.cluster.arrive.release.aligned" in text
  assert "gpu.cluster_block_id" in text


@pytest.mark.parametrize("select, heads, kv_swizzle, whole, segment", [
    (True, 128, 64, 0, 0), (False, 16, 64, 0, 0), (True, 128, 128, 0, 0),
    (False, 128, 128, 1, 0), (True, 64, 128, 1, 0), (False, 128, 128, 0, 2)])
def test_compiled_kernel_with_the_stream_schedule_lowers_for_hopper(select, heads, kv_swizzle,
                                                                    whole, segment):
  """`parts` on the compiled path: loops over a part's row segments (with
  `stream_whole`, its whole rows' loop, then its leftover run's), the query
  reloaded per segment, the result, and the pieces' partial stores in one
  body (under the 128-byte swizzle, with the fence at a segment's end);
  with `stream_segment`, the runs cut by cost on traced part indices (4
  tiles a row: cuts a tile from a row's edge move to it)."""
  from jaxkv.kernels.sparse_mla_decode import kernel as K
  from jaxkv.kernels.sparse_mla_decode.stream import Stream

  batch, topk = 5, 256 if segment else 128
  call = K.build_kernel(
      batch=batch, heads_padded=-(-heads // 64) * 64, topk=topk, num_splits=1,
      sm_scale=SCALE, select=select, interpret=None, q_regs=128, stage_out=True,
      out_dtype=jnp.bfloat16, q_heads=heads, parts=3, kv_swizzle=kv_swizzle,
      f16_partials=kv_swizzle == 128, stream_whole=whole, stream_segment=segment,
  )
  stream = Stream(batch, topk // 64, 3, whole, segment)
  assert (stream.overhead, stream.snap) == (segment, int(segment > 0))
  _assert_lowers(call, batch, heads, topk, select)


@pytest.mark.parametrize("tile_regions", [False, True])
def test_profiled_stream_kernel_fits_with_its_profile_buffer(tmp_path, tile_regions):
  """The profile build (`build_kernel(profile_dir=...)`, what
  `benchmarks/profile_sparse_mla_decode.py` runs) on the stream schedule:
  the kernel's body lowers for CUDA with `PROFILE_RANGES` ranges of SMEM
  buffer beside the ring (the dense kernel's 168 overran it by 3 KB). Only
  the host callback that dumps the trace, lowered after the kernel, cannot
  lower for CUDA on a CPU machine. Without the profiler the build lowers
  whole, `tile_regions` or not."""
  from jaxkv.kernels.sparse_mla_decode import kernel as K

  batch, heads, topk = 5, 128, 128
  build = functools.partial(
      K.build_kernel, batch=batch, heads_padded=128, topk=topk, num_splits=1, sm_scale=SCALE,
      select=True, interpret=None, q_regs=128, stage_out=True, out_dtype=jnp.bfloat16,
      q_heads=heads, parts=3, kv_swizzle=128, f16_partials=True, stream_whole=1)
  with pytest.raises(ValueError, match="backend cpu is different from the lowering platform"):
    _assert_lowers(build(profile_dir=str(tmp_path), tile_regions=tile_regions),
                   batch, heads, topk, True)
  _assert_lowers(build(tile_regions=tile_regions), batch, heads, topk, True)


def test_profiler_needs_a_compiled_kernel(tmp_path):
  from jaxkv.kernels.sparse_mla_decode import kernel as K

  with pytest.raises(ValueError, match="profile_dir needs a compiled kernel"):
    K.build_kernel(batch=1, heads_padded=64, topk=64, num_splits=1, sm_scale=SCALE,
                   select=True, interpret=object(), profile_dir=str(tmp_path))


@pytest.mark.parametrize("way, ops", [
    ("cp_async", ["nvvm.cp.async.shared.global", "nvvm.cp.async.mbarrier.arrive"]),
    ("tma_spans", ["nvvm.cp.async.bulk.tensor.shared.cluster.global", "nvvm.elect.sync"]),
    ("tma_rows", ["nvvm.cp.async.bulk.tensor.shared.cluster.global", "nvvm.elect.sync"]),
])
def test_gather_probe_lowers_for_hopper(way, ops):
  """`benchmarks/probe_gather.py` times the kernel's own `issue_gather` against
  TMA gathers that exist only in it: each way still lowers for CUDA, so a
  change to `gather.py` cannot leave the probe broken unseen."""
  import importlib.util
  import pathlib

  path = pathlib.Path(__file__).parents[1] / "benchmarks" / "probe_gather.py"
  spec = importlib.util.spec_from_file_location("probe_gather", path)
  probe = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(probe)
  rows, ctas, tiles = 1024, 2, 4
  text = jax.jit(probe.gather_kernel(ctas, tiles, rows, way)).trace(
      jax.ShapeDtypeStruct((ctas, tiles, 64), jnp.int32),
      jax.ShapeDtypeStruct((rows, 576), jnp.bfloat16),
  ).lower(lowering_platforms=("cuda",)).as_text()
  for op in [*ops, "nvvm.mbarrier.try_wait.parity", "nvvm.mbarrier.arrive.expect_tx"]:
    assert op in text, op
