"""Sparse MLA decode's schedules that cut or group rows, against the jnp
reference in the Mosaic GPU interpreter: splits merged in clusters, the last
rows cut into pieces (merged after the kernel or in clusters of two), and the
stream schedule's equal runs of the batch's tiles."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels.sparse_mla_decode import (
    SparseMLADecodeConfig,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)
from jaxkv.kernels.sparse_mla_decode.stream import Stream

from sparse_problem import (
    FAST,
    INTERPRET,
    SCALE,
    check,
    inputs,
    poison_unselected,
    run_decode,
)


@pytest.mark.parametrize(
    "heads, mode, splits",
    [(64, "select", 2), (16, "multiply", 4), (96, "select", 8)],
)
def test_cluster_merge(heads, mode, splits):
  """`cluster_merge`: a row's splits, one cluster, merge in the kernel (the
  interpreter runs a cluster's CTAs at once and meets them at a cluster
  barrier): the reference's result, and the combine kernel's within a bf16
  rounding with the same LSE. Row 1 has no valid index; row 0's last split
  none (at 96 heads the last head group's real rows are stored alone; at 16
  heads the queries are float32, and so is the result). Clusters of 8 run
  rows 0 and 1 alone and against the reference alone, for the interpreter's
  time."""
  batch = 2 if splits == 8 else 3
  q, cache, idx = inputs(40 + splits, batch, heads, 64 * splits, dead_rows=(1,))
  idx = idx.at[0, -64:].set(-1)
  if heads == 16:
    q = q.astype(jnp.float32)
  # (Two splits with the race detector: the partials' stores and the merge's
  # loads are ordered by the cluster barrier alone.)
  out, lse = run_decode(q, cache, idx, mode, splits, interpret=INTERPRET if splits == 2 else FAST,
                  cluster_merge=True)
  assert out.shape == (batch, heads, 512) and out.dtype == q.dtype and lse.shape == (batch, heads)
  assert (np.asarray(out[1], np.float32) == 0).all() and (np.asarray(lse[1]) == -np.inf).all()
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  live = np.asarray([0, 2][:batch - 1])
  check(out[live], lse[live], ref_out[live], ref_lse[live])
  if splits == 8:
    return
  # (float32 partials, as the clusters exchange: like for like.)
  comb_out, comb_lse = run_decode(q, cache, idx, mode, splits, interpret=FAST, cluster_merge=False,
                                  f16_partials=False)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(comb_out, np.float32),
                             rtol=2**-7, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(comb_lse), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("heads, pieces", [(16, 2), (128, 2), (64, 4)])
def test_rows_cut_into_pieces(heads, pieces):
  """`cut_rows`: the last two rows' top-k lists cut into pieces, a CTA each,
  merged after the kernel, beside a whole row: halves of one and two tiles
  (a three-tile list), or four pieces of one, one, one and two tiles (five).
  Row 1's first half (first three pieces) holds no valid index, row 2 none
  at all. At 16 heads the clean call runs with the race detector on, and
  XLA's combine gives the reference's result in the same rows.
  At 16 heads and in four pieces also: the whole row is bit for bit what
  `cut_rows=0` gives; NaN in slot 0 and in every slot no row indexes leaves
  "select" bit-equal to clean memory, and "multiply" gives NaN exactly where
  the reference does."""
  tiles = 3 if pieces == 2 else 5
  q, cache, idx = inputs(53 if pieces == 2 else 59, 3, heads, 64 * tiles, invalid=0.2,
                          dead_rows=(2,))
  idx = idx.at[1, :64 * (tiles // 2 + 1)].set(-1)
  config = SparseMLADecodeConfig(cut_rows=2, pieces=pieces)

  def run(c, mode, config=config, interpret=FAST):
    return sparse_mla_decode(q, c, idx, sm_scale=SCALE, mask_mode=mode, interpret=interpret,
                             config=config)

  out, lse = run(cache, "select", interpret=INTERPRET if heads == 16 else FAST)
  assert out.shape == (3, heads, 512) and out.dtype == q.dtype and lse.shape == (3, heads)
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE)
  check(out[:2], lse[:2], ref_out[:2], ref_lse[:2])
  assert (np.asarray(out[2], np.float32) == 0).all() and (np.asarray(lse[2]) == -np.inf).all()
  if heads == 128:
    return
  if heads == 16:  # the same pieces merged by XLA's combine into the same rows
    xla_out, xla_lse = run(cache, "select", config=SparseMLADecodeConfig(
        cut_rows=2, pieces=pieces, combine="xla"))
    check(xla_out[:2], xla_lse[:2], ref_out[:2], ref_lse[:2])
    assert (np.asarray(xla_out[2], np.float32) == 0).all()
  whole_out, whole_lse = run(cache, "select", config=SparseMLADecodeConfig(cut_rows=0))
  np.testing.assert_array_equal(np.asarray(out[0], np.float32), np.asarray(whole_out[0], np.float32))
  np.testing.assert_array_equal(np.asarray(lse[0]), np.asarray(whole_lse[0]))

  poisoned = poison_unselected(cache, idx)
  sel_out, sel_lse = run(poisoned, "select")
  np.testing.assert_array_equal(np.asarray(sel_out, np.float32), np.asarray(out, np.float32))
  np.testing.assert_array_equal(np.asarray(sel_lse), np.asarray(lse))
  ref_nan, _ = sparse_mla_decode_reference(q, poisoned, idx, sm_scale=SCALE, mask_mode="multiply")
  want = np.isnan(np.asarray(ref_nan, np.float32)).any(axis=(1, 2))
  np.testing.assert_array_equal(want, [True, True, False])
  mul_out, _ = run(poisoned, "multiply")
  np.testing.assert_array_equal(np.isnan(np.asarray(mul_out, np.float32)).any(axis=(1, 2)), want)
  assert (np.asarray(mul_out[2], np.float32) == 0).all()


@pytest.mark.parametrize("heads, mode", [(16, "select"), (128, "multiply")])
def test_rows_cut_in_halves_merged_in_clusters(heads, mode):
  """`cut_rows` with `cluster_merge`: whole rows 0 and 1 as a cluster of two
  CTAs that merge nothing, rows 2 and 3 cut in halves (of one tile and
  two), each a cluster that merges its halves. Row 2's first half holds no
  valid index, row 3 none at all. The reference's result, the combine
  path's within a bf16 rounding with the same LSE (the whole rows bit for
  bit); NaN in slot 0 and in every slot no row indexes leaves "select"
  bit-equal to clean memory, and "multiply" gives NaN exactly where the
  reference does. (At 16 heads the merged pieces and the LSE are staged and
  stored at the query's 16 rows alone.)"""
  q, cache, idx = inputs(57, 4, heads, 192, invalid=0.2, dead_rows=(3,))
  idx = idx.at[2, :128].set(-1)

  def run(c, mode, merge, interpret=FAST):
    config = SparseMLADecodeConfig(cut_rows=2, cluster_merge=merge)
    return sparse_mla_decode(q, c, idx, sm_scale=SCALE, mask_mode=mode, interpret=interpret,
                             config=config)

  # (The race detector at 16 heads: the halves' partials and the merge's loads
  # are ordered by the cluster barrier alone.)
  out, lse = run(cache, mode, True, interpret=INTERPRET if heads == 16 else FAST)
  assert out.shape == (4, heads, 512) and out.dtype == q.dtype and lse.shape == (4, heads)
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  check(out[:3], lse[:3], ref_out[:3], ref_lse[:3])
  assert (np.asarray(out[3], np.float32) == 0).all() and (np.asarray(lse[3]) == -np.inf).all()
  comb_out, comb_lse = run(cache, mode, False)
  np.testing.assert_array_equal(np.asarray(out[:2], np.float32),
                                np.asarray(comb_out[:2], np.float32))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(comb_out, np.float32),
                             rtol=2**-7, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(comb_lse), rtol=1e-6, atol=1e-6)

  poisoned = poison_unselected(cache, idx)
  if mode == "select":
    sel_out, sel_lse = run(poisoned, "select", True)
    np.testing.assert_array_equal(np.asarray(sel_out, np.float32), np.asarray(out, np.float32))
    np.testing.assert_array_equal(np.asarray(sel_lse), np.asarray(lse))
    return
  ref_nan, _ = sparse_mla_decode_reference(q, poisoned, idx, sm_scale=SCALE, mask_mode="multiply")
  want = np.isnan(np.asarray(ref_nan, np.float32)).any(axis=(1, 2))
  np.testing.assert_array_equal(want, [True, True, True, False])
  mul_out, _ = run(poisoned, "multiply", True)
  np.testing.assert_array_equal(np.isnan(np.asarray(mul_out, np.float32)).any(axis=(1, 2)), want)
  assert (np.asarray(mul_out[3], np.float32) == 0).all()


@pytest.mark.parametrize(
    "heads, mode, batch, tiles, parts, combine, whole, segment",
    [(64, "select", 5, 2, 3, "kernel", False, None),
     (128, "multiply", 5, 2, 3, "kernel", None, None),
     (16, "select", 6, 2, 4, "xla", False, None), (64, "multiply", 4, 2, 2, "kernel", False, None),
     (64, "select", 7, 3, 5, "kernel", True, None), (16, "select", 7, 3, 5, "xla", True, None),
     (64, "select", 4, 2, 3, "kernel", True, None), (128, "select", 6, 2, 3, "kernel", True, 0),
     (64, "select", 7, 4, 5, "kernel", False, 2), (128, "multiply", 5, 4, 3, "kernel", True, 1)],
)
def test_stream_schedule(heads, mode, batch, tiles, parts, combine, whole, segment):
  """`parts`: equal shares of the batch's tiles per CTA, rows cut between
  runs merged after the kernel (`stream.Stream`). Laid end to end
  (`stream_whole=False`): 5 rows of 2 tiles in 3 parts (tiles 0-2, 3-5,
  6-9): rows 1 and 2 cut, part 1 three segments (a row's second tile, a
  whole row, a row's first tile); 6 rows in 4 parts (rows 1 and 4 cut); 4
  rows in 2 parts (the boundary between rows 1 and 2: nothing cut). Whole
  rows first: 5 rows in 3 parts (rows 0-2 whole, row 3 in two pieces, row
  4 whole in part 2's run; at 128 heads, `stream_whole=None`: the plan's
  rule lays them end to end, two leftover tiles for three parts); 7 rows
  of 3 tiles in 5 parts (row 5 in three pieces, row 6 in two: a slot of
  no piece); 4 rows of 2 tiles in 3 parts (fewer leftover tiles than
  parts: part 2's run is empty); 6 rows in 3 parts (two whole rows each,
  nothing cut, `stream_segment=0`). (The others take the default
  `stream_segment`, equal tiles there: the plain layout, or leftover runs
  too short for a cost.) Cut by cost
  (`stream_segment`): 7 rows of 4 tiles in 5 parts at 2 tiles a segment
  (runs 0-4, 4-10, 10-16, 16-20, 20-28 where equal tiles give 0-5, 5-11,
  ...: row 2 in halves, the others whole; cuts a tile from a row's edge
  moved to it); 5 rows of 4 tiles, one whole row a part, at 1 (the
  leftover runs 0-2, 2-4, 4-8: row 3 in halves, row 4 whole). Row 1's
  first tile holds no valid index, the last row none at all. The
  reference's result (the dead row 0 and -inf), the race detector on the
  first case; in the select cases, NaN in slot 0 and in every slot no row
  indexes leaves "select" bit-equal to clean memory, and "multiply" gives
  NaN exactly where the reference does (row 1's NaN null block, met only in
  its first tile, poisons the row). The multiply cases' results are
  float32."""
  q, cache, idx = inputs(61 + batch, batch, heads, 64 * tiles, invalid=0.2,
                          dead_rows=(batch - 1,))
  idx = idx.at[1, :64].set(-1)
  if mode == "multiply":
    q = q.astype(jnp.float32)  # a float32 result, from registers and the merge
  config = SparseMLADecodeConfig(parts=parts, combine=combine, stream_whole=whole,
                                 stream_segment=segment)
  if segment:  # a cut that differs from the equal one
    stream = Stream(batch, tiles, parts, batch // parts if whole else 0, segment)
    equal = Stream(batch, tiles, parts, stream.whole)
    assert [stream.runs(p) for p in range(parts)] != [equal.runs(p) for p in range(parts)]
    assert stream.overhead == segment and stream.snap == (segment == 2)
  first = heads == 64 and mode == "select" and batch == 5

  def run(c, mode, interpret=FAST):
    return sparse_mla_decode(q, c, idx, sm_scale=SCALE, mask_mode=mode, interpret=interpret,
                             config=config)

  out, lse = run(cache, mode, interpret=INTERPRET if first else FAST)
  assert out.shape == (batch, heads, 512) and out.dtype == q.dtype and lse.shape == (batch, heads)
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  check(out[:-1], lse[:-1], ref_out[:-1], ref_lse[:-1])
  assert (np.asarray(out[-1], np.float32) == 0).all() and (np.asarray(lse[-1]) == -np.inf).all()
  if mode == "multiply":
    return
  poisoned = poison_unselected(cache, idx)
  sel_out, _ = run(poisoned, "select")
  np.testing.assert_array_equal(np.asarray(sel_out, np.float32), np.asarray(out, np.float32))
  ref_nan, _ = sparse_mla_decode_reference(q, poisoned, idx, sm_scale=SCALE, mask_mode="multiply")
  want = np.isnan(np.asarray(ref_nan, np.float32)).any(axis=(1, 2))
  assert want[1] and not want[-1]
  mul_out, _ = run(poisoned, "multiply")
  np.testing.assert_array_equal(np.isnan(np.asarray(mul_out, np.float32)).any(axis=(1, 2)), want)


@pytest.mark.parametrize("mode, f16", [("select", False), ("multiply", True)])
def test_stream_rows_never_read_an_earlier_rows_slots(mode, f16):
  """The stream runs several rows' tiles through one CTA's stages. Row 1 (cut
  at tile 3, 5 rows of 2 tiles in 3 parts) selects a NaN slot in its second
  tile, a piece of its own in part 1; part 1 then runs row 2, whose second
  tile holds -1s. A -1's stage row must not keep what an earlier tile left
  there: the NaN slot, or (float16 partials) the staged NaN piece's bits.
  Rows 0 and 2-4 are the reference's, finite, in both modes (the null block
  is finite). (Row 1 itself, a NaN in a slot it selected, is not compared.)"""
  q, cache, idx = inputs(91, 5, 16, 128, invalid=0.0)
  nan_slot = int(idx[1, 67])
  others = np.arange(5) != 1
  idx = idx.at[others].set(jnp.where(idx[others] == nan_slot, 1 + nan_slot % 7, idx[others]))
  idx = idx.at[2, 64::3].set(-1)  # (67: where row 1 had the NaN slot)
  cache = cache.reshape(-1, 576).at[nan_slot].set(jnp.nan).reshape(cache.shape)
  out, lse = sparse_mla_decode(q, cache, idx, sm_scale=SCALE, mask_mode=mode, interpret=FAST,
                               config=SparseMLADecodeConfig(parts=3, f16_partials=f16))
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  rows = np.flatnonzero(others)
  check(out[rows], lse[rows], ref_out[rows], ref_lse[rows])
