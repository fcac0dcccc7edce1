"""sparse_mla_decode against its jnp reference, in the Mosaic GPU interpreter."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.kernels.sparse_mla_decode import (
    SparseMLADecodeConfig,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)
from jaxkv.kernels.sparse_mla_decode.config import (
    MAX_CLUSTER_CTAS,
    PLAN_MARGIN,
    cluster_merge_pays,
    config_from_entries,
    heuristic_config,
    merges_in_cluster,
    plan_cost,
    rows_to_cut,
    wave_plan,
    RowCut,
    _span,
)

INTERPRET = plgpu.InterpretGPUParams(detect_races=True)
# Without the race detector (~40% faster): for tests whose subject is the values,
# on kernel paths that the race-checked tests also run.
FAST = plgpu.InterpretGPUParams()
NUM_BLOCKS, BLOCK_SIZE = 4, 16
SCALE = 576**-0.5
TUNING = pathlib.Path(__file__).parents[1] / "configs/tuning/sparse_mla_decode/nvidia_h200.json"


def _inputs(seed, batch, heads, topk, *, invalid=0.3, dup=False, dead_rows=()):
  kq, kc, ki, km = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (batch, heads, 576), jnp.float32).astype(jnp.bfloat16)
  cache = jax.random.normal(kc, (NUM_BLOCKS, BLOCK_SIZE, 576), jnp.float32)
  cache = cache.astype(jnp.bfloat16)
  # Slot 0 (the null block) is never a valid index here.
  idx = jax.random.randint(ki, (batch, topk), 1, NUM_BLOCKS * BLOCK_SIZE, jnp.int32)
  if dup:
    idx = idx.at[:, 1::2].set(idx[:, 0::2])
  idx = jnp.where(jax.random.uniform(km, (batch, topk)) < invalid, -1, idx)
  for r in dead_rows:
    idx = idx.at[r].set(-1)
  return q, cache, idx


def _poison_unselected(cache, idx):
  """The cache with NaN in slot 0 (the null block) and in every slot no index selects."""
  used = np.zeros(NUM_BLOCKS * BLOCK_SIZE, bool)
  used[np.asarray(idx)[np.asarray(idx) >= 0]] = True
  used[0] = False
  rows = cache.reshape(-1, 576)
  return jnp.where(jnp.asarray(used)[:, None], rows, jnp.nan).reshape(cache.shape)


def _run(q, cache, idx, mode, splits=1, interpret=INTERPRET, q_regs=0, stage_out=True,
         cluster_merge=None, combine="kernel"):
  return sparse_mla_decode(
      q, cache, idx, sm_scale=SCALE, mask_mode=mode, interpret=interpret,
      config=SparseMLADecodeConfig(num_splits=splits, q_regs=q_regs, stage_out=stage_out,
                                   cluster_merge=cluster_merge, combine=combine),
  )


def _check(out, lse, ref_out, ref_lse):
  out = np.asarray(out, np.float32)
  ref_out = np.asarray(ref_out, np.float32)
  assert np.isfinite(out).all()
  err = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
  assert err < 1e-2, err
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "heads, mode, splits, dup, q_regs",
    [
        (16, "select", 1, False, 0),
        (64, "multiply", 2, True, 0),
        (128, "select", 1, True, 0),
        # The query's first channels fed to the QK from apart (registers when
        # compiled; the same SMEM slice here).
        (128, "multiply", 1, False, 128),
        (16, "select", 2, True, 64),
    ],
)
def test_matches_reference(heads, mode, splits, dup, q_regs):
  q, cache, idx = _inputs(
      heads, 2, heads, 64 * splits, dup=dup, dead_rows=(1,) if heads == 16 else ()
  )
  if heads == 16:  # float32 queries: one split writes the result in their dtype
    q = q.astype(jnp.float32)
  out, lse = _run(q, cache, idx, mode, splits, q_regs=q_regs)
  assert out.shape == (2, heads, 512) and out.dtype == q.dtype
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  if heads == 16:  # the all-invalid row
    assert (np.asarray(out[1], np.float32) == 0).all()
    assert (np.asarray(lse[1]) == -np.inf).all()
  live = np.isfinite(np.asarray(ref_lse)).all(axis=1)
  _check(out[live], lse[live], ref_out[live], ref_lse[live])


@pytest.mark.parametrize("mode", ["select", "multiply"])
def test_long_index_list(mode):
  """Eight tiles of indices in one split: the producer's index ring wraps around
  (and in "select" the query's first 192 channels are fed from apart, the same
  slice for every tile)."""
  q, cache, idx = _inputs(11, 1, 16, 256, invalid=0.2 if mode == "select" else 0.0)
  out, lse = _run(q, cache, idx, mode, q_regs=192 if mode == "select" else 0)
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  _check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize(
    "mode, topk, heads",
    [("select", 128, 128), ("multiply", 64, 64), ("multiply", 64, 8), ("select", 128, 96)],
)
def test_result_staged_in_smem_matches_direct_stores(mode, topk, heads):
  """`stage_out`: the result goes out by TMA from the last tile's stage (stage 1
  at two tiles, 0 at one): bit for bit the registers' direct stores. At 8
  and 96 heads the query goes in unpadded and the staged stores write the
  real heads alone (the direct stores a padded result, sliced in XLA)."""
  q, cache, idx = _inputs(31, 3, heads, topk, dead_rows=(2,))
  out, lse = _run(q, cache, idx, mode)
  assert out.shape == (3, heads, 512) and lse.shape == (3, heads)
  direct_out, direct_lse = _run(q, cache, idx, mode, interpret=FAST, stage_out=False)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(direct_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(direct_lse))
  assert (np.asarray(out[2], np.float32) == 0).all()
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  _check(out[:2], lse[:2], ref_out[:2], ref_lse[:2])


def test_nan_poisoning():
  """NaN in slot 0 and in every slot no row indexes (values: no race detector)."""
  q, cache, idx = _inputs(7, 5, 16, 128, invalid=0.0, dead_rows=(3,))
  # Rows 1, 2 and 4 hold a -1, row 0 none; row 4's second split (of two) is all -1.
  idx = idx.at[1, 5].set(-1).at[2, ::3].set(-1).at[4, 64:].set(-1)
  live = np.asarray([0, 1, 2, 4])
  poisoned = _poison_unselected(cache, idx)
  clean_out, clean_lse = _run(q, cache, idx, "select", interpret=FAST)
  out, lse = _run(q, poisoned, idx, "select", interpret=FAST)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clean_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean_lse))
  # The same with two splits merged by the kernel's clusters.
  merged = [_run(q, c, idx, "select", splits=2, interpret=FAST, cluster_merge=True)
            for c in (cache, poisoned)]
  for a, b in zip(*merged):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE)
  _check(out[live], lse[live], ref_out[live], ref_lse[live])

  # "multiply" gives NaN exactly where the reference (the production bug) does,
  # with the rows' -1s in one split, both, or a split of -1s alone; two splits
  # merged by the merge kernel, by XLA's combine, or by the kernel's clusters.
  ref_nan, _ = sparse_mla_decode_reference(q, poisoned, idx, sm_scale=SCALE, mask_mode="multiply")
  want = np.isnan(np.asarray(ref_nan, np.float32)).any(axis=(1, 2))
  np.testing.assert_array_equal(want, [False, True, True, False, True])
  for splits, cluster, combine in ((1, None, "kernel"), (2, False, "kernel"), (2, False, "xla"),
                                   (2, True, "kernel")):
    out, lse = _run(q, poisoned, idx, "multiply", splits=splits, interpret=FAST,
                    cluster_merge=cluster, combine=combine)
    nan_rows = np.isnan(np.asarray(out, np.float32)).any(axis=(1, 2))
    np.testing.assert_array_equal(nan_rows, want)
    assert np.isfinite(np.asarray(out[0], np.float32)).all()
    assert (np.asarray(out[3], np.float32) == 0).all()  # no valid index at all

  zeroed = poisoned.at[0, 0].set(0)
  out, lse = _run(q, zeroed, idx, "multiply", interpret=FAST)
  ref_out, ref_lse = sparse_mla_decode_reference(q, zeroed, idx, sm_scale=SCALE, mask_mode="multiply")
  _check(out[live], lse[live], ref_out[live], ref_lse[live])


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
  heads the queries are float32, and so is the result)."""
  q, cache, idx = _inputs(40 + splits, 3, heads, 64 * splits, dead_rows=(1,))
  idx = idx.at[0, -64:].set(-1)
  if heads == 16:
    q = q.astype(jnp.float32)
  # (Two splits with the race detector: the partials' stores and the merge's
  # loads are ordered by the cluster barrier alone.)
  out, lse = _run(q, cache, idx, mode, splits, interpret=INTERPRET if splits == 2 else FAST,
                  cluster_merge=True)
  assert out.shape == (3, heads, 512) and out.dtype == q.dtype and lse.shape == (3, heads)
  assert (np.asarray(out[1], np.float32) == 0).all() and (np.asarray(lse[1]) == -np.inf).all()
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  live = np.asarray([0, 2])
  _check(out[live], lse[live], ref_out[live], ref_lse[live])
  comb_out, comb_lse = _run(q, cache, idx, mode, splits, interpret=FAST, cluster_merge=False)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(comb_out, np.float32),
                             rtol=2**-7, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(comb_lse), rtol=1e-6, atol=1e-6)


def test_cluster_merge_pays():
  """`cluster_merge=None`: clusters of 2 splits, and of 4 or 8 within
  MAX_CLUSTER_CTAS CTAs (beyond, they took two waves on the H200)."""
  assert MAX_CLUSTER_CTAS == 120
  assert cluster_merge_pays(batch=8, num_heads=64, num_splits=8)  # 64 CTAs
  assert cluster_merge_pays(batch=15, num_heads=64, num_splits=8)  # 120
  assert not cluster_merge_pays(batch=16, num_heads=64, num_splits=8)  # 128
  assert cluster_merge_pays(batch=7, num_heads=128, num_splits=8)  # 112
  assert cluster_merge_pays(batch=30, num_heads=64, num_splits=4)  # 120
  assert not cluster_merge_pays(batch=31, num_heads=64, num_splits=4)  # 124
  assert not cluster_merge_pays(batch=32, num_heads=16, num_splits=4)
  assert cluster_merge_pays(batch=64, num_heads=64, num_splits=2)  # 128
  assert cluster_merge_pays(batch=32, num_heads=128, num_splits=2)
  assert not cluster_merge_pays(batch=1, num_heads=64, num_splits=16)
  assert not cluster_merge_pays(batch=8, num_heads=64, num_splits=1)
  config = SparseMLADecodeConfig(num_splits=8)
  assert merges_in_cluster(config, batch=8, num_heads=64)
  assert not merges_in_cluster(config, batch=16, num_heads=64)
  forced = SparseMLADecodeConfig(num_splits=8, cluster_merge=True)
  assert merges_in_cluster(forced, batch=16, num_heads=64)
  off = SparseMLADecodeConfig(num_splits=8, cluster_merge=False)
  assert not merges_in_cluster(off, batch=8, num_heads=64)


@pytest.mark.parametrize("heads, pieces", [(16, 2), (128, 2), (64, 4)])
def test_rows_cut_into_pieces(heads, pieces):
  """`cut_rows`: the last two rows' top-k lists cut into pieces, a CTA each,
  merged after the kernel, beside a whole row: halves of one and two tiles
  (a three-tile list), or four pieces of one, one, one and two tiles (five).
  Row 1's first half (first three pieces) holds no valid index, row 2 none
  at all. At 16 heads the clean call runs with the race detector on. At 16
  and 64 heads, XLA's combine gives the reference's result in the same rows.
  At 16 heads and in four pieces also: the whole row is bit for bit what
  `cut_rows=0` gives; NaN in slot 0 and in every slot no row indexes leaves
  "select" bit-equal to clean memory, and "multiply" gives NaN exactly where
  the reference does."""
  tiles = 3 if pieces == 2 else 5
  q, cache, idx = _inputs(53 if pieces == 2 else 59, 3, heads, 64 * tiles, invalid=0.2,
                          dead_rows=(2,))
  idx = idx.at[1, :64 * (tiles // 2 + 1)].set(-1)
  config = SparseMLADecodeConfig(cut_rows=2, pieces=pieces)

  def run(c, mode, config=config, interpret=FAST):
    return sparse_mla_decode(q, c, idx, sm_scale=SCALE, mask_mode=mode, interpret=interpret,
                             config=config)

  out, lse = run(cache, "select", interpret=INTERPRET if heads == 16 else FAST)
  assert out.shape == (3, heads, 512) and out.dtype == q.dtype and lse.shape == (3, heads)
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE)
  _check(out[:2], lse[:2], ref_out[:2], ref_lse[:2])
  assert (np.asarray(out[2], np.float32) == 0).all() and (np.asarray(lse[2]) == -np.inf).all()
  if heads == 128:
    return
  # The same pieces merged by XLA's combine into the same rows.
  xla_out, xla_lse = run(cache, "select", config=SparseMLADecodeConfig(
      cut_rows=2, pieces=pieces, combine="xla"))
  _check(xla_out[:2], xla_lse[:2], ref_out[:2], ref_lse[:2])
  assert (np.asarray(xla_out[2], np.float32) == 0).all()
  whole_out, whole_lse = run(cache, "select", config=SparseMLADecodeConfig(cut_rows=0))
  np.testing.assert_array_equal(np.asarray(out[0], np.float32), np.asarray(whole_out[0], np.float32))
  np.testing.assert_array_equal(np.asarray(lse[0]), np.asarray(whole_lse[0]))

  poisoned = _poison_unselected(cache, idx)
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
  q, cache, idx = _inputs(57, 4, heads, 192, invalid=0.2, dead_rows=(3,))
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
  _check(out[:3], lse[:3], ref_out[:3], ref_lse[:3])
  assert (np.asarray(out[3], np.float32) == 0).all() and (np.asarray(lse[3]) == -np.inf).all()
  comb_out, comb_lse = run(cache, mode, False)
  np.testing.assert_array_equal(np.asarray(out[:2], np.float32),
                                np.asarray(comb_out[:2], np.float32))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(comb_out, np.float32),
                             rtol=2**-7, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(comb_lse), rtol=1e-6, atol=1e-6)

  poisoned = _poison_unselected(cache, idx)
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


def test_halves_merge_in_clusters_where_they_pair_up():
  """`cluster_merge=None` with rows cut in halves: clusters of two wherever the
  whole rows pair up, never for more pieces; an explicit `cluster_merge=True`
  elsewhere is a clear error."""
  auto = SparseMLADecodeConfig()
  for batch, heads in ((96, 128), (99, 128), (170, 64), (196, 64)):
    cut = wave_plan(batch=batch, num_heads=heads, topk=2048, num_splits=1)
    assert cut.pieces == 2 and cut.rows and (batch - cut.rows) % 2 == 0
    assert merges_in_cluster(auto, batch=batch, num_heads=heads, cut=cut)
  assert not merges_in_cluster(auto, batch=97, num_heads=128, cut=RowCut(36, 2))  # 61 whole
  assert not merges_in_cluster(auto, batch=96, num_heads=128, cut=RowCut(0, 2))
  assert not merges_in_cluster(auto, batch=98, num_heads=128, cut=RowCut(36, 4))
  off = SparseMLADecodeConfig(cluster_merge=False)
  assert not merges_in_cluster(off, batch=96, num_heads=128, cut=RowCut(36, 2))
  forced = SparseMLADecodeConfig(cluster_merge=True)
  for batch, heads, cut in ((97, 128, RowCut(36, 2)), (96, 128, RowCut(0, 2)),
                            (98, 128, RowCut(36, 4))):
    with pytest.raises(ValueError, match="cluster_merge"):
      merges_in_cluster(forced, batch=batch, num_heads=heads, cut=cut)
  with pytest.raises(ValueError, match="cluster_merge"):
    SparseMLADecodeConfig(cut_rows=0, cluster_merge=True)
  with pytest.raises(ValueError, match="cluster_merge"):
    SparseMLADecodeConfig(cut_rows=2, pieces=4, cluster_merge=True)
  # Forced, the automatic plan cuts halves that pair up, even where more pieces
  # would be its choice.
  for batch, heads in ((67, 128), (150, 64), (97, 128)):
    cut = rows_to_cut(forced, batch=batch, num_heads=heads, topk=2048)
    assert cut.pieces == 2 and cut.rows and (batch - cut.rows) % 2 == 0, cut
    assert merges_in_cluster(forced, batch=batch, num_heads=heads, cut=cut)
  assert rows_to_cut(auto, batch=67, num_heads=128, topk=2048).pieces == 16
  q, cache, idx = _inputs(0, 3, 64, 128)
  with pytest.raises(ValueError, match="cluster_merge"):  # one whole row: no pair
    sparse_mla_decode(q, cache, idx, sm_scale=SCALE, interpret=FAST,
                      config=SparseMLADecodeConfig(cut_rows=2, cluster_merge=True))


def _greedy_span(costs, num_sms):
  """Each CTA, in launch order, on the SM that frees first: when the last ends."""
  free = [0.0] * num_sms
  for cost in costs:
    i = min(range(num_sms), key=free.__getitem__)
    free[i] += cost
  return max(free)


def test_span_is_the_greedy_schedule():
  """`_span`'s bisection against a schedule of every CTA on the first free
  SM, on shapes drawn at random (whole CTAs first, then the pieces)."""
  rng = np.random.default_rng(0)
  for _ in range(200):
    sms = int(rng.integers(1, 20))
    whole = int(rng.integers(0, sms + 1))
    pieces = int(rng.integers(0, 60))
    cta = float(rng.integers(10, 80))
    piece = float(rng.integers(1, 40))
    want = _greedy_span([cta] * whole + [piece] * pieces, sms)
    assert abs(_span(whole, pieces, cta, piece, sms) - want) < 1e-6, (sms, whole, pieces)


def test_wave_plan():
  """Rows are cut only where one CTA per row and head group overruns one wave,
  up to two; just past one wave, a few rows in many pieces; near two waves,
  halves that pair up; past the point where no cut beats the whole rows'
  two waves, none. The plan is never worse than no cut in its own model."""
  def plan(batch, heads, topk=2048, splits=1, pieces=None):
    return wave_plan(batch=batch, num_heads=heads, topk=topk, num_splits=splits,
                     pieces=pieces)

  assert plan(66, 128) == RowCut(0, 2) and plan(132, 64) == RowCut(0, 2)  # one wave exactly
  assert plan(264, 64) == RowCut(0, 2) and plan(128, 128) == RowCut(0, 2)  # two waves, nearly full
  # No cut beats two waves of whole rows, the stream does; past two waves, the
  # stream where the last wave is light.
  assert plan(110, 128) == RowCut(0, 2, 66) and plan(265, 64) == RowCut(0, 2, 132)
  assert plan(200, 128) == RowCut(0, 2, 66) and plan(400, 64) == RowCut(0, 2, 132)
  assert plan(120, 128) == RowCut(0, 2) and plan(230, 64) == RowCut(0, 2)
  assert wave_plan(batch=110, num_heads=128, topk=2048, num_splits=1, stream=False) == RowCut(0, 2)
  assert plan(300, 64, splits=2) == RowCut(0, 2)
  assert plan(150, 64, splits=2) == RowCut(0, 2) and plan(150, 64, topk=64) == RowCut(0, 2)
  for batch, heads in ((67, 128), (133, 64), (70, 128)):  # just past one wave
    cut = plan(batch, heads)
    assert cut.rows <= 4 and cut.pieces == 16, cut
  for batch, heads in ((96, 128), (99, 128), (196, 64)):  # near two waves
    cut = plan(batch, heads)
    assert cut.pieces == 2 and (batch - cut.rows) % 2 == 0, cut
  assert plan(133, 64, pieces=2).pieces == 2 and plan(133, 64, topk=256).pieces <= 4
  for batch, heads in ((67, 128), (80, 128), (99, 128), (110, 128), (140, 16), (150, 64),
                       (200, 64)):
    groups = -(-heads // 64)
    cut = plan(batch, heads)
    costs = [plan_cost(batch=batch, num_heads=heads, tiles=32, cut=c)
             for c in (cut, RowCut(0, 2), RowCut(batch - 132 // groups, 2),
                       RowCut(0, 2, 132 // groups))]
    # (No cut where no cut was modelled `PLAN_MARGIN` slower.)
    assert costs[0] <= min(costs[1:]) or (
        cut == RowCut(0, 2) and min(costs[1:]) >= costs[0] * (1 - PLAN_MARGIN)), (batch, heads, costs)
  assert plan(200, 16) == RowCut(0, 2)  # a cut modelled within the margin of no cut


def test_cut_rows_validation():
  with pytest.raises(ValueError, match="cut_rows"):
    SparseMLADecodeConfig(cut_rows=-1)
  with pytest.raises(ValueError, match="cut_rows"):
    SparseMLADecodeConfig(num_splits=2, cut_rows=1)
  for pieces in (1, 33, True, 2.0):
    with pytest.raises((TypeError, ValueError), match="pieces"):
      SparseMLADecodeConfig(cut_rows=1, pieces=pieces)
  q, cache, idx = _inputs(0, 2, 16, 64)
  for config in (SparseMLADecodeConfig(cut_rows=3), SparseMLADecodeConfig(cut_rows=1),
                 SparseMLADecodeConfig(cut_rows=1, pieces=3)):
    with pytest.raises(ValueError, match="cut_rows"):
      sparse_mla_decode(q, cache, idx, sm_scale=SCALE, config=config)


def test_parts_validation():
  """`parts`: 0, None or at least 2, one split without cut rows or clusters,
  at most the batch (each part at least a row long)."""
  for parts in (1, -2, True, 2.0):
    with pytest.raises((TypeError, ValueError), match="parts"):
      SparseMLADecodeConfig(parts=parts)
  for kw in (dict(num_splits=2), dict(cut_rows=1), dict(cluster_merge=True, cut_rows=2)):
    with pytest.raises(ValueError, match="parts"):
      SparseMLADecodeConfig(parts=3, **kw)
  config = SparseMLADecodeConfig(parts=3)
  assert rows_to_cut(config, batch=5, num_heads=64, topk=256) == RowCut(0, 2, 3)
  q, cache, idx = _inputs(0, 2, 16, 64)
  with pytest.raises(ValueError, match="parts"):
    sparse_mla_decode(q, cache, idx, sm_scale=SCALE, config=SparseMLADecodeConfig(parts=3))


@pytest.mark.parametrize(
    "heads, mode, batch, tiles, parts, combine",
    [(64, "select", 5, 2, 3, "kernel"), (128, "multiply", 5, 2, 3, "kernel"),
     (16, "select", 6, 2, 4, "xla"), (64, "multiply", 4, 2, 2, "kernel")],
)
def test_stream_schedule(heads, mode, batch, tiles, parts, combine):
  """`parts`: equal runs of the batch's tiles per CTA, rows cut between runs
  merged after the kernel. 5 rows of 2 tiles in 3 parts (tiles 0-2, 3-5,
  6-9): rows 1 and 2 cut, part 1 three segments (a row's second tile, a
  whole row, a row's first tile); 6 rows in 4 parts (rows 1 and 4 cut); 4
  rows in 2 parts (the boundary between rows 1 and 2: nothing cut). Row 1's
  first tile holds no valid index, the last row none at all. The
  reference's result (the dead row 0 and -inf), the race detector on the
  first case; in the select cases, NaN in slot 0 and in every slot no row
  indexes leaves "select" bit-equal to clean memory, and "multiply" gives NaN
  exactly where the reference does (row 1's NaN null block, met only in its
  first piece, poisons the merged row). The multiply cases' results are
  float32."""
  q, cache, idx = _inputs(61 + batch, batch, heads, 64 * tiles, invalid=0.2,
                          dead_rows=(batch - 1,))
  idx = idx.at[1, :64].set(-1)
  if mode == "multiply":
    q = q.astype(jnp.float32)  # a float32 result, from registers and the merge
  config = SparseMLADecodeConfig(parts=parts, combine=combine)
  first = heads == 64 and mode == "select"

  def run(c, mode, interpret=FAST):
    return sparse_mla_decode(q, c, idx, sm_scale=SCALE, mask_mode=mode, interpret=interpret,
                             config=config)

  out, lse = run(cache, mode, interpret=INTERPRET if first else FAST)
  assert out.shape == (batch, heads, 512) and out.dtype == q.dtype and lse.shape == (batch, heads)
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE, mask_mode=mode)
  _check(out[:-1], lse[:-1], ref_out[:-1], ref_lse[:-1])
  assert (np.asarray(out[-1], np.float32) == 0).all() and (np.asarray(lse[-1]) == -np.inf).all()
  if mode == "multiply":
    return
  poisoned = _poison_unselected(cache, idx)
  sel_out, _ = run(poisoned, "select")
  np.testing.assert_array_equal(np.asarray(sel_out, np.float32), np.asarray(out, np.float32))
  ref_nan, _ = sparse_mla_decode_reference(q, poisoned, idx, sm_scale=SCALE, mask_mode="multiply")
  want = np.isnan(np.asarray(ref_nan, np.float32)).any(axis=(1, 2))
  assert want[1] and not want[-1]
  mul_out, _ = run(poisoned, "multiply")
  np.testing.assert_array_equal(np.isnan(np.asarray(mul_out, np.float32)).any(axis=(1, 2)), want)


@pytest.mark.parametrize("mode, splits", [("select", 1), ("multiply", 2)])
def test_ids_outside_the_cache_are_invalid(mode, splits):
  """An id past the cache's last slot, or negative other than -1, is invalid
  exactly as -1 is: masked, never clamped onto the last slot (NaN here, so a
  clamp would show) as a valid key."""
  num_slots = NUM_BLOCKS * BLOCK_SIZE
  q, cache, idx = _inputs(41, 3, 16, 128, invalid=0.2)
  idx = jnp.where(idx == num_slots - 1, 1, idx)  # the last slot is never valid here
  ks, kp = jax.random.split(jax.random.key(42))
  outside = jnp.asarray([num_slots, num_slots + 5, 2**31 - 1, -2, -(2**31)], jnp.int32)
  pick = jax.random.randint(ks, idx.shape, 0, outside.shape[0])
  odd = jnp.where(jax.random.uniform(kp, idx.shape) < 0.25, outside[pick], idx)
  odd = odd.at[2].set(jnp.where(jnp.arange(128) % 2 == 0, num_slots, -1))  # nothing valid
  as_minus_one = jnp.where((odd >= 0) & (odd < num_slots), odd, -1)
  assert (np.asarray(odd) != np.asarray(as_minus_one)).sum() > 40
  rows = cache.reshape(-1, 576)
  poisoned = rows.at[num_slots - 1].set(jnp.nan).reshape(cache.shape)

  out, lse = _run(q, poisoned, odd, mode, splits=splits, interpret=FAST)
  want_out, want_lse = _run(q, poisoned, as_minus_one, mode, splits=splits, interpret=FAST)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
  assert (np.asarray(out[2], np.float32) == 0).all() and (np.asarray(lse[2]) == -np.inf).all()
  ref_out, ref_lse = sparse_mla_decode_reference(q, poisoned, odd, sm_scale=SCALE, mask_mode=mode)
  _check(out[:2], lse[:2], ref_out[:2], ref_lse[:2])


def test_inside_jit_with_traced_indices():
  q, cache, idx = _inputs(3, 1, 16, 128)
  f = jax.jit(lambda q, c, i: _run(q, c, i, "select", 2))
  out, lse = f(q, cache, idx)
  ref_out, ref_lse = sparse_mla_decode_reference(q, cache, idx, sm_scale=SCALE)
  _check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize(
    "change, name",
    [
        (lambda q, c, i: (q[..., :512], c, i), "q.shape"),
        (lambda q, c, i: (q, c.astype(jnp.float32), i), "cache.shape"),
        (lambda q, c, i: (q, c, i[:, :32]), "indices.shape"),
        (lambda q, c, i: (q, c, i.astype(jnp.int16)), "indices.shape"),
        (lambda q, c, i: (q, c, i[:1]), "indices.shape"),
        (lambda q, c, i: (jnp.zeros((2, 129, 576), jnp.bfloat16), c, i), "q.shape"),
    ],
)
def test_bad_inputs(change, name):
  q, cache, idx = _inputs(0, 2, 16, 64)
  with pytest.raises(ValueError, match=name.replace(".", r"\.")):
    sparse_mla_decode(*change(q, cache, idx), sm_scale=SCALE)


@pytest.mark.parametrize(
    "kwargs, name",
    [({"dv": 256}, "dv"), ({"mask_mode": "zero"}, "mask_mode"),
     ({"config": SparseMLADecodeConfig(num_splits=4)}, "num_splits")],
)
def test_bad_options(kwargs, name):
  q, cache, idx = _inputs(0, 2, 16, 64)
  with pytest.raises(ValueError, match=name):
    sparse_mla_decode(q, cache, idx, sm_scale=SCALE, **kwargs)


def test_config_validation():
  with pytest.raises(ValueError, match="num_splits"):
    SparseMLADecodeConfig(num_splits=0)
  with pytest.raises(ValueError, match="implementation"):
    SparseMLADecodeConfig(implementation="triton")
  with pytest.raises(ValueError, match="q_regs"):
    SparseMLADecodeConfig(q_regs=32)
  # (The suite's runtime type checks answer first, with a TypeError.)
  with pytest.raises((TypeError, ValueError), match="stage_out"):
    SparseMLADecodeConfig(stage_out=1)
  for splits in (3, 16):
    with pytest.raises(ValueError, match="cluster_merge"):
      SparseMLADecodeConfig(num_splits=splits, cluster_merge=True)
  # One split merges in clusters only the halves of cut rows.
  with pytest.raises(ValueError, match="cluster_merge"):
    SparseMLADecodeConfig(num_splits=1, cut_rows=0, cluster_merge=True)
  SparseMLADecodeConfig(num_splits=1, cluster_merge=True)  # halves where the shape cuts rows
  with pytest.raises((TypeError, ValueError), match="cluster_merge"):
    SparseMLADecodeConfig(num_splits=2, cluster_merge=1)
  for combine in ("XLA", "pallas", None):
    with pytest.raises((TypeError, ValueError), match="combine"):
      SparseMLADecodeConfig(combine=combine)


def test_tuned_entries_match_their_batches_alone():
  """Each H200 entry holds at the batches it names, and no other batch takes it."""
  entries = json.loads(TUNING.read_text())["entries"]
  for entry in entries:
    for heads in entry["heads"]:
      for batch in (entry["min_batch"], entry["max_batch"]):
        config = config_from_entries(entries, batch=batch, num_heads=heads, topk=2048)
        assert config == SparseMLADecodeConfig(**entry["config"]), (entry, batch)
  # Elsewhere the heuristic answers (it covers the SMs once): between entries
  # (batch 12 at 64 heads), and at batches measured where its count was fastest.
  assert config_from_entries(entries, batch=12, num_heads=64, topk=2048) is None
  assert config_from_entries(entries, batch=8, num_heads=32, topk=2048) is None
  assert heuristic_config(batch=12, num_heads=64, topk=2048).num_splits == 8
  # With the merge kernel the heuristic's count won again at 5 and 16 x 64, 1 x 128
  # and 4 x 16, whose entries went; 4 x 128 keeps half of it, merged in clusters.
  for batch, heads, splits in ((5, 64, 16), (16, 64, 8), (1, 128, 32), (4, 16, 32)):
    assert config_from_entries(entries, batch=batch, num_heads=heads, topk=2048) is None
    assert heuristic_config(batch=batch, num_heads=heads, topk=2048).num_splits == splits
  assert heuristic_config(batch=4, num_heads=128, topk=2048).num_splits == 16
  config = config_from_entries(entries, batch=4, num_heads=128, topk=2048)
  assert config.num_splits == 8 and merges_in_cluster(config, batch=4, num_heads=128)
  assert heuristic_config(batch=8, num_heads=128, topk=2048).num_splits == 8
  # Where an entry's count differs from the heuristic's, it is the entry's.
  assert config_from_entries(entries, batch=3, num_heads=64, topk=2048).num_splits == 16
  assert heuristic_config(batch=3, num_heads=64, topk=2048).num_splits == 32
  # A tuned split count that does not divide topk's tiles falls back as well.
  assert config_from_entries(entries, batch=1, num_heads=16, topk=1024) is None
  assert heuristic_config(batch=1, num_heads=16, topk=1024).num_splits == 16


@pytest.mark.parametrize("mode", ["select", "multiply"])
def test_compiled_xla_implementation(mode):
  """A compiled call (interpret=False) runs config.implementation: here "xla"."""
  assert SparseMLADecodeConfig().implementation == "pallas"
  q, cache, idx = _inputs(5, 3, 16, 64, dead_rows=(2,))
  poisoned = cache.at[0, 0].set(jnp.nan)
  config = SparseMLADecodeConfig(implementation="xla")
  out, lse = sparse_mla_decode(
      q, poisoned, idx, sm_scale=SCALE, mask_mode=mode, interpret=False, config=config
  )
  ref_out, ref_lse = sparse_mla_decode_reference(q, poisoned, idx, sm_scale=SCALE, mask_mode=mode)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))
  has_pad = np.asarray((idx < 0).any(axis=1) & (idx >= 0).any(axis=1))
  nan_rows = np.isnan(np.asarray(out, np.float32)).any(axis=(1, 2))
  np.testing.assert_array_equal(nan_rows, has_pad if mode == "multiply" else np.zeros_like(has_pad))


def test_interpreter_without_enough_cpu_threads_fails_fast(monkeypatch):
  """As for dense decode: raise where the three warpgroups cannot run at once."""
  import importlib

  common = importlib.import_module("jaxkv.kernels._common")
  monkeypatch.setattr(common, "cpu_parallelism", lambda: 2)
  q, cache, idx = _inputs(0, 1, 16, 64)
  with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
    sparse_mla_decode(q, cache, idx, sm_scale=SCALE, interpret=INTERPRET)
  # A cluster of 4 CTAs' 12 warpgroups run at once.
  monkeypatch.setattr(common, "cpu_parallelism", lambda: 8)
  q, cache, idx = _inputs(0, 1, 16, 256)
  with pytest.raises(ValueError, match="runs 12 warpgroups"):
    sparse_mla_decode(q, cache, idx, sm_scale=SCALE, interpret=INTERPRET,
                      config=SparseMLADecodeConfig(num_splits=4, cluster_merge=True))


@pytest.mark.parametrize(
    "select, splits, heads, q_regs, stage_out",
    [(True, 1, 64, 0, False), (False, 2, 128, 0, False), (True, 1, 128, 128, False),
     (False, 1, 128, 128, True),
     # Unpadded queries: the zeroed query rows, the last group's shorter copies
     # and (staged) stores.
     (True, 1, 16, 0, True), (False, 2, 96, 0, False)],
)
def test_compiled_kernel_lowers_for_hopper(select, splits, heads, q_regs, stage_out):
  """The compiled kernel's own path (the per-thread cp.async gather, the stage
  mbarriers, "multiply"'s warp reduction) exists only for the GPU, where the
  interpreter cannot run it: lowering it for CUDA here catches a broken body on a
  CPU machine. (Its results are checked on the H200 by the benchmark script.)"""
  from jaxkv.kernels.sparse_mla_decode import kernel as K

  batch, topk = 2, 64 * splits
  call = K.build_kernel(
      batch=batch, heads_padded=-(-heads // 64) * 64, topk=topk, num_splits=splits,
      sm_scale=SCALE, select=select, interpret=None, q_regs=q_regs, stage_out=stage_out,
      out_dtype=jnp.bfloat16, q_heads=heads,
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
      out_dtype=jnp.bfloat16, q_heads=heads, cluster_merge=True,
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
        out_dtype=jnp.bfloat16, q_heads=heads, cut_rows=2, pieces=pieces,
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
      out_dtype=jnp.bfloat16, q_heads=heads, cut_rows=2, cluster_merge=True,
  )
  text = _assert_lowers(call, batch, heads, topk, select)
  assert "barrier.cluster.arrive.release.aligned" in text
  assert "gpu.cluster_block_id" in text


@pytest.mark.parametrize("select, heads", [(True, 128), (False, 16)])
def test_compiled_kernel_with_the_stream_schedule_lowers_for_hopper(select, heads):
  """`parts` on the compiled path: a loop over a part's row segments, the
  query reloaded per segment, the result, and both pieces' partial stores in
  one body."""
  from jaxkv.kernels.sparse_mla_decode import kernel as K

  batch, topk = 5, 128
  call = K.build_kernel(
      batch=batch, heads_padded=-(-heads // 64) * 64, topk=topk, num_splits=1,
      sm_scale=SCALE, select=select, interpret=None, q_regs=128, stage_out=True,
      out_dtype=jnp.bfloat16, q_heads=heads, parts=3,
  )
  _assert_lowers(call, batch, heads, topk, select)


@pytest.mark.parametrize(
    "heads, stage_out, pad, cut, splits",
    [(16, True, False, False, 1), (96, True, False, False, 1), (16, False, False, True, 1),
     (20, True, True, True, 1), (16, True, False, False, 2), (40, False, False, True, 2)],
)
def test_heads_below_a_head_group_need_no_pad_or_slice(heads, stage_out, pad, cut, splits):
  """One split, or splits merged in clusters, with a staged result at a
  multiple of 8 heads is the kernel alone: no XLA pad of q, no slice of the
  result; the direct stores write whole head groups (sliced), and other
  head counts are padded."""
  q, cache, idx = _inputs(3, 2, heads, 64 * splits)
  config = SparseMLADecodeConfig(num_splits=splits, stage_out=stage_out,
                                 cluster_merge=True if splits > 1 else None)
  jaxpr = jax.make_jaxpr(lambda q: sparse_mla_decode(
      q, cache, idx, sm_scale=SCALE, interpret=FAST, config=config))(q)
  (call,) = [e for e in jaxpr.eqns if "jaxpr" in e.params]
  ops = {e.params["name"].lstrip("_") if e.primitive.name == "jit" else e.primitive.name
         for e in call.params["jaxpr"].eqns}
  assert ("pad" in ops) == pad
  assert ("slice" in ops) == cut


def test_wave_plan_counts_the_devices_sms(request):
  """The automatic cut and the heuristic split count take the device's
  multiprocessors: 60 x 128 heads (120 CTAs) is one wave of an H200's 132
  SMs, and overruns one of 114."""
  auto = SparseMLADecodeConfig()
  assert rows_to_cut(auto, batch=60, num_heads=128, topk=2048) == RowCut(0, 2)
  request.getfixturevalue("h100_pcie")
  cut = rows_to_cut(auto, batch=60, num_heads=128, topk=2048)
  assert cut.rows > 0 and cut == wave_plan(batch=60, num_heads=128, topk=2048, num_splits=1,
                                           num_sms=114)
  assert heuristic_config(batch=2, num_heads=128, topk=2048) == heuristic_config(
      batch=2, num_heads=128, topk=2048, num_sms=114)
  assert heuristic_config(batch=2, num_heads=128, topk=2048, num_sms=114) != heuristic_config(
      batch=2, num_heads=128, topk=2048, num_sms=132)
