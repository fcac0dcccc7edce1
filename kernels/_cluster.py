"""The barrier of a cluster whose CTAs hand each other results through GMEM:
sparse decode's merge of a row's splits in its cluster (`sparse_mla_decode.cluster`)
and dense decode's grouped merge in halves (`mla_decode.grouped_merge`)."""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm


def cluster_sync() -> None:
  """Every thread of the cluster's CTAs meets here (`barrier.cluster` arrive
  with release, wait with acquire, both at cluster scope): each thread's
  stores before it, to GMEM too, are visible to every thread of the cluster
  after it. Every warpgroup of every CTA must call it once (a thread that
  has exited is not waited for), at a point all of a warp's threads reach
  together (`.aligned`)."""

  @plgpu.inline_mgpu()
  def _sync(_ctx):
    llvm.inline_asm(
        ir.Type.parse("!llvm.void"), [],
        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;",
        "", has_side_effects=True,
    )

  _sync()


def interpreted_cluster_sync(barrier) -> None:
  """`cluster_sync` in the Pallas GPU interpreter, which has no
  `barrier.cluster`: every CTA's thread arrives on `barrier` (a
  `plgpu.ClusterBarrier` over the cluster's axes, one arrival per thread of a
  CTA that meets it) in each CTA of the cluster, then waits on its own. The
  interpreter's GMEM stores are visible at once."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)
