"""Sparse MLA decode's plan and configs: split counts, rows cut into pieces by
the model of the waves, the stream's choice, clusters, validation, tuned entries."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxkv.kernels.sparse_mla_decode import (
    SparseMLADecodeConfig,
    sparse_mla_decode,
)
from jaxkv.kernels.sparse_mla_decode.config import (
    MAX_CLUSTER_CTAS,
    config_from_entries,
    default_config,
    heuristic_config,
)
from jaxkv.kernels.sparse_mla_decode.plan import (
    PLAN_MARGIN,
    RowCut,
    _span,
    cluster_merge_pays,
    merges_in_cluster,
    plan_cost,
    rows_to_cut,
    wave_plan,
)

from devices import H100, as_first_device, gpu
from sparse_problem import FAST, SCALE, TUNING, inputs


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
  q, cache, idx = inputs(0, 3, 64, 128)
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
    # (No cut where no cut was modelled `PLAN_MARGIN` slower; no stream where
    # the stream was modelled faster than a cut by less than that.)
    assert costs[0] <= min(costs[1:3]) or (
        cut == RowCut(0, 2) and min(costs[1:3]) >= costs[0] * (1 - PLAN_MARGIN)), (batch, heads, costs)
    assert costs[0] <= costs[3] or (not cut.parts and costs[3] >= costs[0] * (1 - PLAN_MARGIN) - 1e-9)
  assert plan(200, 16) == RowCut(0, 2)  # a cut modelled within the margin of no cut


def test_cut_rows_validation():
  with pytest.raises(ValueError, match="cut_rows"):
    SparseMLADecodeConfig(cut_rows=-1)
  with pytest.raises(ValueError, match="cut_rows"):
    SparseMLADecodeConfig(num_splits=2, cut_rows=1)
  for pieces in (1, 33, True, 2.0):
    with pytest.raises(ValueError, match="pieces"):
      SparseMLADecodeConfig(cut_rows=1, pieces=pieces)
  q, cache, idx = inputs(0, 2, 16, 64)
  for config in (SparseMLADecodeConfig(cut_rows=3), SparseMLADecodeConfig(cut_rows=1),
                 SparseMLADecodeConfig(cut_rows=1, pieces=3)):
    with pytest.raises(ValueError, match="cut_rows"):
      sparse_mla_decode(q, cache, idx, sm_scale=SCALE, config=config)


def test_parts_validation():
  """`parts`: 0, None or at least 2, one split without cut rows or clusters,
  at most the batch (each part at least a row long)."""
  for parts in (1, -2, True, 2.0):
    with pytest.raises(ValueError, match="parts"):
      SparseMLADecodeConfig(parts=parts)
  for kw in (dict(num_splits=2), dict(cut_rows=1), dict(cluster_merge=True, cut_rows=2)):
    with pytest.raises(ValueError, match="parts"):
      SparseMLADecodeConfig(parts=3, **kw)
  config = SparseMLADecodeConfig(parts=3)
  assert rows_to_cut(config, batch=5, num_heads=64, topk=256) == RowCut(0, 2, 3)
  q, cache, idx = inputs(0, 2, 16, 64)
  with pytest.raises(ValueError, match="parts"):
    sparse_mla_decode(q, cache, idx, sm_scale=SCALE, config=SparseMLADecodeConfig(parts=3))


def test_config_validation():
  with pytest.raises(ValueError, match="num_splits"):
    SparseMLADecodeConfig(num_splits=0)
  with pytest.raises(ValueError, match="implementation"):
    SparseMLADecodeConfig(implementation="triton")
  with pytest.raises(ValueError, match="q_regs"):
    SparseMLADecodeConfig(q_regs=32)
  for swizzle in (32, 256, True):
    with pytest.raises(ValueError, match="kv_swizzle"):
      SparseMLADecodeConfig(kv_swizzle=swizzle)
  # An int is not a bool here, though 1 == True.
  with pytest.raises(ValueError, match="stage_out"):
    SparseMLADecodeConfig(stage_out=1)
  with pytest.raises(ValueError, match="f16_partials"):
    SparseMLADecodeConfig(f16_partials=1)
  for splits in (3, 16):
    with pytest.raises(ValueError, match="cluster_merge"):
      SparseMLADecodeConfig(num_splits=splits, cluster_merge=True)
  # One split merges in clusters only the halves of cut rows.
  with pytest.raises(ValueError, match="cluster_merge"):
    SparseMLADecodeConfig(num_splits=1, cut_rows=0, cluster_merge=True)
  SparseMLADecodeConfig(num_splits=1, cluster_merge=True)  # halves where the shape cuts rows
  with pytest.raises(ValueError, match="cluster_merge"):
    SparseMLADecodeConfig(num_splits=2, cluster_merge=1)
  for combine in ("XLA", "pallas", None):
    with pytest.raises(ValueError, match="combine"):
      SparseMLADecodeConfig(combine=combine)


def test_tuned_entries_match_their_batches_alone():
  """No batch but those an H200 entry names takes it (that each holds at its
  own: `test_every_tuning_file_gives_valid_configs`, for every file)."""
  entries = json.loads(TUNING.read_text())["entries"]
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


def test_every_tuning_file_gives_valid_configs():
  files = sorted(TUNING.parent.glob("*.json"))
  assert [f.name for f in files] == ["nvidia_h100_80gb_hbm3.json", "nvidia_h200.json"]
  for path in files:
    tuned = json.loads(path.read_text())
    assert tuned["op"] == "sparse_mla_decode" and tuned["device"] == path.stem
    for entry in tuned["entries"]:
      for heads in entry["heads"]:
        for batch in (entry.get("min_batch", 1), entry["max_batch"]):
          config = config_from_entries(tuned["entries"], batch=batch, num_heads=heads, topk=2048)
          assert config == SparseMLADecodeConfig(**entry["config"]), (path.name, entry)


def test_the_h100_halves_the_heuristics_splits_where_its_run_said(monkeypatch):
  """The H100's file (NOTES.md, "The H100's split counts"): 16 splits at
  2 x 128 and 3-4 x 64, where the heuristic takes 32; the heuristic's count
  elsewhere, the three other shapes of that run among them."""
  as_first_device(monkeypatch, gpu(*H100, core_count=132))
  tuned = {(2, 128): 16, (3, 64): 16, (4, 64): 16}
  for batch in (1, 2, 3, 4, 8, 16, 83, 128):
    for heads in (16, 32, 64, 128):
      got = default_config(batch=batch, num_heads=heads, topk=2048)
      heuristic = heuristic_config(batch=batch, num_heads=heads, topk=2048)
      assert got.num_splits == tuned.get((batch, heads), heuristic.num_splits), (batch, heads)
      assert got.implementation == "pallas"
  for batch, heads in tuned:
    assert heuristic_config(batch=batch, num_heads=heads, topk=2048).num_splits == 32
  for batch, heads, splits in ((1, 32, 32), (4, 128, 16), (8, 64, 16)):
    assert default_config(batch=batch, num_heads=heads, topk=2048).num_splits == splits
  # 16 splits do not divide top-k 512's eight tiles: the heuristic's count.
  assert default_config(batch=2, num_heads=128, topk=512).num_splits == 8


@pytest.mark.parametrize("kind", [H100, ("NVIDIA H200", "9.0"), ("NVIDIA GH200 480GB", "9.0")])
def test_every_hopper_runs_the_128_byte_swizzle(monkeypatch, kind):
  """`kv_swizzle` 128 (NOTES.md, "The 128-byte swizzle in sparse decode"): the
  tuned entries name no swizzle, so every config of both files, and the
  heuristic's on a Hopper without a file, takes it."""
  as_first_device(monkeypatch, gpu(*kind, core_count=132))
  for batch in (1, 2, 3, 4, 8, 16, 32, 64, 83, 128, 300):
    for heads in (16, 32, 64, 128):
      assert default_config(batch=batch, num_heads=heads, topk=2048).kv_swizzle == 128


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


def test_stream_whole_rule_and_validation():
  """`stream_whole=None`: whole rows first at one head group always, at two
  where the leftover runs average 4 tiles a part or more (83 x 128: 8.2;
  140 x 128: 3.9; 200 x 128: 1.0); True and False force it. Anything but
  None or a bool is refused."""
  from jaxkv.kernels.sparse_mla_decode.plan import stream_whole_pays, stream_whole_rows

  pays = lambda b, h: stream_whole_pays(batch=b, num_heads=h, tiles=32,
                                        parts=132 // -(-h // 64))
  assert pays(83, 128) and pays(87, 128) and not pays(140, 128) and not pays(200, 128)
  assert pays(270, 64) and pays(400, 64) and pays(300, 16) and pays(133, 64)
  rows = lambda w, b, h: stream_whole_rows(w, batch=b, num_heads=h, tiles=32,
                                           parts=132 // -(-h // 64))
  assert rows(None, 83, 128) == 1 and rows(None, 200, 128) == 0 and rows(True, 200, 128) == 3
  assert rows(False, 270, 64) == 0 and rows(None, 270, 64) == 2
  for bad in (0, 1, "yes"):
    with pytest.raises(ValueError, match="stream_whole"):
      SparseMLADecodeConfig(stream_whole=bad)


def test_stream_segment_rule_and_validation():
  """`stream_segment=None`: the leftover runs cut by cost, a segment at
  `STREAM_SEGMENT_TILES`, behind whole rows only (in the plain layout the
  runs stay equal); a count passes through. The wrapper's default at
  83 x 128 heads (`stream_schedule`) is then the cut the H100 timed.
  Anything but None or an int in [0, 32] is refused."""
  from jaxkv.kernels.sparse_mla_decode.plan import (
      STREAM_SEGMENT_TILES,
      stream_schedule,
      stream_segment_tiles,
  )
  from jaxkv.kernels.sparse_mla_decode.stream import Stream

  seg = lambda s, h, w: stream_segment_tiles(s, num_heads=h, whole_rows=w)
  assert seg(None, 128, 1) == STREAM_SEGMENT_TILES[2] == 3
  assert seg(None, 64, 2) == STREAM_SEGMENT_TILES[1] == 3
  assert seg(None, 128, 0) == 0 and seg(4, 128, 0) == 4 and seg(0, 64, 1) == 0
  schedule = lambda w: stream_schedule(w, None, batch=83, num_heads=128, tiles=32, parts=66)
  stream = schedule(None)
  assert (stream.whole, stream.overhead) == (1, 3)
  assert (schedule(False).whole, schedule(False).segment_cost) == (0, 0)
  assert [stream.runs(p)[1] for p in (0, 1)] != [Stream(83, 32, 66, 1).runs(p)[1] for p in (0, 1)]
  for bad in (-1, 33, 2.0, True, "3"):
    with pytest.raises(ValueError, match="stream_segment"):
      SparseMLADecodeConfig(stream_segment=bad)
  assert SparseMLADecodeConfig(stream_segment=32).stream_segment == 32
