"""Dense MLA decode's split plan and configs: parts balanced over the step's
tiles, every block covered once, the merge path each plan takes, the tuned
entries."""

from __future__ import annotations

import dataclasses
import json

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels.mla_decode import (
    MLADecodeConfig,
    heuristic_config,
    mla_decode_plan,
)
from jaxkv.kernels.mla_decode.config import config_from_entries, default_config

from devices import H100, as_first_device, gpu
from mla_problem import BS, TUNING, segments


def test_plan_covers_blocks_exactly():
  lens = jnp.asarray([0, 1, 64, 65, 4096, 131072, 700], jnp.int32)
  config = MLADecodeConfig(num_splits=16, ctas_per_sm=2, min_chunk_blocks=8)
  plan = jax.jit(lambda s: mla_decode_plan(s, num_heads=128, config=config))(lens)
  bounds = np.asarray(plan.bounds)
  assert plan.num_splits == 16 and bounds.shape == (7, 17)
  nblk = -(-np.asarray(lens) // 64)
  np.testing.assert_array_equal(bounds[:, 0], 0)
  np.testing.assert_array_equal(bounds[:, -1], nblk)
  assert (np.diff(bounds, axis=1) >= 0).all()
  assert (np.diff(bounds, axis=1)[nblk > 8 * 16] > 0).any()


def test_configs_valid():
  # Every tuned entry's validity: `test_every_tuning_file_gives_valid_configs`.
  entries = json.loads(TUNING.read_text())["entries"]
  for batch in (1, 8, 128):
    for heads in (16, 64, 128):
      assert heuristic_config(batch=batch, num_heads=heads).num_splits >= 1
  with pytest.raises(ValueError, match="num_splits"):
    MLADecodeConfig(num_splits=0)
  with pytest.raises(ValueError, match="split_overhead_tiles"):
    MLADecodeConfig(split_overhead_tiles=-1)
  with pytest.raises(ValueError, match="kv_swizzle"):
    MLADecodeConfig(kv_swizzle=32)
  with pytest.raises(ValueError, match="q_regs"):
    MLADecodeConfig(q_regs=96)
  # The tuned and heuristic configs stream under the 128-byte swizzle; two
  # head groups, bound by the chain, hold 128 query channels in registers.
  for batch in (1, 8, 128):
    one, two = (heuristic_config(batch=batch, num_heads=h) for h in (64, 128))
    assert (one.kv_swizzle, one.q_regs, two.kv_swizzle, two.q_regs) == (128, 0, 128, 128)
  for entry in entries:
    config = config_from_entries(entries, batch=entry["max_batch"], num_heads=entry["heads"][0])
    want = (128, 0) if max(entry["heads"]) <= 64 else (128, 128)
    assert (config.kv_swizzle, config.q_regs) == want, entry


def test_every_tuning_file_gives_valid_configs():
  files = sorted(TUNING.parent.glob("*.json"))
  assert [f.name for f in files] == ["nvidia_h200.json"]
  for path in files:
    tuned = json.loads(path.read_text())
    assert tuned["op"] == "mla_decode" and tuned["device"] == path.stem
    for entry in tuned["entries"]:
      lo, hi = entry.get("min_batch", 1), entry.get("max_batch", 4096)
      for batch in {lo, (lo + hi) // 2, hi}:
        for heads in entry["heads"]:
          config = config_from_entries(tuned["entries"], batch=batch, num_heads=heads)
          assert isinstance(config, MLADecodeConfig)
          named = {k: getattr(config, k) for k in entry["config"]}
          assert named == entry["config"], (path.name, entry, batch)


def test_an_entry_replaces_only_the_heuristics_fields_it_names():
  entries = [{"min_batch": 2, "heads": [128], "config": {"q_regs": 64}},
             {"max_batch": 8, "heads": [64], "config": {"num_splits": 5, "kv_swizzle": 64}}]
  for batch in (2, 3, 8, 9, 128, 4096):
    got = config_from_entries(entries, batch=batch, num_heads=128, num_sms=132)
    want = heuristic_config(batch=batch, num_heads=128, num_sms=132)
    assert got == dataclasses.replace(want, q_regs=64) and got.num_splits == want.num_splits
  assert config_from_entries(entries, batch=1, num_heads=128) is None  # below min_batch
  for batch in (1, 8):
    got = config_from_entries(entries, batch=batch, num_heads=64, num_sms=114)
    want = heuristic_config(batch=batch, num_heads=64, num_sms=114)
    assert got == dataclasses.replace(want, num_splits=5, kv_swizzle=64)
  assert config_from_entries(entries, batch=9, num_heads=64) is None  # past max_batch
  assert config_from_entries(entries, batch=4, num_heads=16) is None
  with pytest.raises(ValueError, match="q_regs"):
    config_from_entries([{"heads": [16], "config": {"q_regs": 96}}], batch=1, num_heads=16)


def test_an_h100_runs_the_heuristic_under_the_128_byte_swizzle(monkeypatch):
  """The H100 has no tuning file: its sweep (NOTES.md, "The H100's own
  configs") found nothing past the spread but the 128-byte swizzle at two head
  groups (0.95-0.99 of the time), which the heuristic now takes everywhere."""
  as_first_device(monkeypatch, gpu(*H100))
  for batch in (1, 2, 8, 37, 128, 512):
    for heads in (16, 63, 64, 65, 96, 100, 128):
      got = default_config(batch=batch, num_heads=heads)
      assert got == heuristic_config(batch=batch, num_heads=heads), (batch, heads)
      assert (got.kv_swizzle, got.q_regs) == ((128, 0) if heads <= 64 else (128, 128))
      lens = jnp.full((batch,), 4096, jnp.int32)
      assert mla_decode_plan(lens, num_heads=heads).num_splits == got.num_splits


def test_the_on_device_check_runs_the_default_layouts(monkeypatch):
  """`benchmarks/check_mla_decode.py` builds its configs on the layout that
  the device's default config takes at each head count (`layout_for`; a
  variant's fields on top), and `check_same_result` has a case under the
  two-group default: defaults that moved without the device check would fail
  here (until 2026-12-07 it checked the 64-byte base layout alone)."""
  import importlib
  import pathlib

  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "benchmarks"))
  check = importlib.import_module("check_mla_decode")
  for device in (gpu(*H100, core_count=132), gpu("NVIDIA H200", "9.0", core_count=132)):
    as_first_device(monkeypatch, device)
    for batch, heads in ((8, 16), (8, 64), (3, 96), (8, 128), (128, 128)):
      want = default_config(batch=batch, num_heads=heads)
      assert check.layout_for(heads, batch) == {"kv_swizzle": want.kv_swizzle,
                                                "q_regs": want.q_regs}, (device, heads)
      assert check.layout_for(heads, batch, {"kv_swizzle": 64}) == {"kv_swizzle": 64,
                                                                   "q_regs": want.q_regs}
    two = default_config(batch=10, num_heads=128)
    assert (128, two.kv_swizzle, two.q_regs) in {case[:3] for case in check.SAME_CASES}


def _cut_points(ntiles, parts, chunk, overhead):
  """Each part's first tile, walking the cost line token by token: a row costs
  `overhead` (at its start) plus its tiles; part p starts at cost p * chunk."""
  line = []  # the global tile at each unit of cost (a row's overhead maps to its first tile)
  tile = 0
  for n in ntiles:
    if n:
      line += [tile] * overhead + list(range(tile, tile + n))
      tile += n
  return [line[p * chunk] if p * chunk < len(line) else tile for p in range(parts + 1)]


_LENGTH = st.one_of(st.just(0), st.integers(1, 3 * BS), st.integers(1, 40 * BS))


@pytest.mark.parametrize(
    "seq_lens,splits,ctas,overhead",
    [
        ([BS + 1, 3 * BS, 0, 2 * BS - 3, 5, 4 * BS, BS], 3, 4, 3),
        ([BS + 1, 3 * BS, 0, 2 * BS - 3, 5, 4 * BS, BS], 3, 4, 0),
        ([0, 0, 7], 2, 132, 3),
        ([4096, 131072, 1, 0, 65 * BS, 700], 16, 264, 3),
        ([BS] * 40, 2, 8, 3),
        ([BS] * 40, 2, 8, 0),
        ([5 * BS, BS, BS, 9 * BS, 2 * BS, BS + 1], 4, 3, 2),
    ],
)
def test_plan_parts_are_balanced_and_cover_every_block_once(seq_lens, splits, ctas, overhead):
  _check_plan(seq_lens, splits=splits, ctas=ctas, overhead=overhead, min_chunk=1, heads=64)


@hypothesis.given(
    # A few batch sizes only: the plan's small ops compile once per shape.
    seq_lens=st.sampled_from([5, 24]).flatmap(
        lambda n: st.lists(_LENGTH, min_size=n, max_size=n)
    ),
    splits=st.sampled_from([1, 3, 7]),
    ctas=st.sampled_from([4, 264]),
    overhead=st.integers(0, 8),
    min_chunk=st.integers(1, 40),
    heads=st.sampled_from([64, 128]),
)
@hypothesis.settings(max_examples=25)
def test_plan_invariants_on_random_steps(seq_lens, splits, ctas, overhead, min_chunk, heads):
  _check_plan(seq_lens, splits=splits, ctas=ctas, overhead=overhead, min_chunk=min_chunk, heads=heads)


def _check_plan(seq_lens, *, splits, ctas, overhead, min_chunk, heads):
  """The plan against a walk of the cost line: parts, splits, bounds, coverage."""
  lens = jnp.asarray(seq_lens, jnp.int32)
  config = MLADecodeConfig(
      num_splits=splits, ctas_per_sm=1, min_chunk_blocks=min_chunk,
      split_overhead_tiles=overhead,
  )
  plan = jax.jit(lambda s: mla_decode_plan(s, num_heads=heads, config=config, num_sms=ctas))(lens)
  nblk = -(-np.asarray(seq_lens) // BS)
  cost = int(nblk.sum() + overhead * (nblk > 0).sum())
  parts = plan.num_parts
  assert parts == max(1, min(ctas // -(-heads // 64), len(seq_lens) * splits))
  # Equal cost per part, unless a row would need more splits; one split: one part.
  if splits == 1:
    chunk = max(cost, 1)
  else:
    chunk = max(-(-cost // parts), min_chunk, -(-int(nblk.max()) // (splits - 1)))
  np.testing.assert_array_equal(plan.part_start, _cut_points(nblk, parts, chunk, overhead))
  bounds = np.asarray(plan.bounds)
  rs = np.asarray(plan.row_start)
  np.testing.assert_array_equal(rs, np.concatenate([[0], np.cumsum(nblk)]))
  seen = np.zeros((len(seq_lens), int(nblk.max()) + 1), np.int32)
  for p, segs in enumerate(segments(plan, seq_lens)):
    # A part's tiles plus an overhead per row it starts stay within its chunk,
    # give or take one overhead where a cut falls inside a row's.
    starts_here = sum(1 for row, lo, _, _ in segs if lo == 0)
    assert sum(n for _, _, n, _ in segs) + overhead * starts_here <= chunk + overhead
    for row, lo, n, split in segs:
      assert 0 <= split < splits
      # The split's blocks are exactly what the plan's bounds say.
      assert (bounds[row, split], bounds[row, split + 1]) == (lo, lo + n)
      seen[row, lo:lo + n] += 1
  for row, k in enumerate(nblk):
    np.testing.assert_array_equal(seen[row, :k], 1)
    assert (seen[row, k:] == 0).all()
    if k:
      ps = np.asarray(plan.part_start)
      p = int(plan.row_part[row])
      assert ps[p] <= rs[row] < ps[p + 1]
  assert (np.diff(bounds, axis=1) >= 0).all()
  np.testing.assert_array_equal(bounds[:, 0], 0)
  np.testing.assert_array_equal(bounds[:, -1], nblk)


def test_merge_path_by_plan_shape():
  """Which merge rows of many splits take, and the grouped merge's tiling:
  the shapes measured on the H200 (merge_tiling.use_grouped's docstring)."""
  from jaxkv.kernels.mla_decode.merge_tiling import GROUP_SMEM, grouped_tiling, use_grouped

  cases = {  # (batch, head groups, splits): (grouped, cols, groups in flight)
      (1, 2, 67): (True, 8, 9),  # 1 x 128 x 128K: every group in flight
      (4, 1, 52): (True, 16, 5),  # 4 x 64 x 128K: a ring of 5 of 7 groups
      (2, 2, 52): (True, 16, 5),
      (1, 1, 133): (False, 8, 10),  # 64 CTAs: the two passes
      (8, 1, 27): (True, 8, 4),  # 512 CTAs of 8 channels, every group in flight
      (8, 2, 15): (False, 8, 2),  # 15 splits, two head groups: the per-split ring
      (1, 1, 27): (False, 8, 4),  # a grid of 64 CTAs: the per-split ring
      (4, 2, 52): (False, 32, 2),  # wide tiles: not measured, not taken
  }
  assert not use_grouped(batch=1, head_groups=2, num_splits=129)  # past GROUP_MAX_SPLITS
  for (batch, groups, splits), want in cases.items():
    cols, stages = grouped_tiling(batch=batch, head_groups=groups, num_splits=splits)
    assert (use_grouped(batch=batch, head_groups=groups, num_splits=splits), cols, stages) == want
    assert stages * 8 * 64 * cols * 4 <= GROUP_SMEM


def test_plans_count_the_devices_sms(request):
  """A GPU that reports its multiprocessors (`core_count`) sizes the split
  plan and the heuristic config; the CPU counts an H200's 132."""
  from jaxkv.kernels import _common

  assert _common.num_sms() == _common.DEFAULT_SMS == 132
  lens = jnp.full((128,), 4096, jnp.int32)
  assert mla_decode_plan(lens, num_heads=64).num_parts == 132
  request.getfixturevalue("h100_pcie")
  assert _common.num_sms() == 114 and _common.device_kind() == "nvidia_h100_pcie"
  assert mla_decode_plan(lens, num_heads=64).num_parts == 114
  assert mla_decode_plan(lens, num_heads=128).num_parts == 57
  assert heuristic_config(batch=1, num_heads=64) == heuristic_config(
      batch=1, num_heads=64, num_sms=114) != heuristic_config(batch=1, num_heads=64, num_sms=132)
