"""The stream schedule's arithmetic (`sparse_mla_decode.stream`), in plain Python."""

import itertools

from jaxkv.kernels.sparse_mla_decode.stream import (
    boundary_row,
    cut_boundaries,
    part_bounds,
    part_rows,
    segment,
)


def stream_segments(*, batch, tiles, parts):
  """Each part's segments as (row, first tile, count), as the kernels walk them."""
  total = batch * tiles
  out = []
  for p in range(parts):
    beg, end = part_bounds(p, total=total, parts=parts)
    first, last = part_rows(beg, end, tiles=tiles)
    out.append([(row, *segment(row, beg, end, tiles=tiles)) for row in range(first, last)])
  return out


def test_segments_cover_every_tile_once_and_cut_a_row_at_most_once():
  """For every batch >= parts: the parts' segments cover each row's tiles
  exactly once, in order; a part is 2-3 segments at most where its run is
  under two rows; a row is cut at most once, at the boundary `boundary_row`
  names, its first piece ending part p - 1 and its second starting part p."""
  for tiles, parts in itertools.product((1, 2, 3, 5, 32), (2, 3, 7, 66, 132)):
    for batch in sorted({parts, parts + 1, 2 * parts - 1, 2 * parts, 3 * parts + 5}):
      segs = stream_segments(batch=batch, tiles=tiles, parts=parts)
      covered = {}
      for p, part in enumerate(segs):
        assert part and all(n > 0 for _, _, n in part)
        beg, end = part_bounds(p, total=batch * tiles, parts=parts)
        assert sum(n for _, _, n in part) == end - beg >= tiles
        if end - beg < 2 * tiles:
          assert len(part) <= 3
        for row, lo, n in part:
          covered.setdefault(row, []).append((lo, n, p))
      assert sorted(covered) == list(range(batch))
      cuts = 0
      for row, pieces in covered.items():
        assert [lo for lo, _, _ in pieces] == [0] + [lo + n for lo, n, _ in pieces[:-1]]
        assert sum(n for _, n, _ in pieces) == tiles and len(pieces) <= 2
        if len(pieces) == 2:
          cuts += 1
          p = pieces[1][2]
          assert pieces[0][2] == p - 1 and pieces[0][0] == 0 and pieces[1][0] > 0
          assert boundary_row(p, total=batch * tiles, parts=parts, tiles=tiles) == (row, True)
      assert cuts == cut_boundaries(batch=batch, tiles=tiles, parts=parts)


def test_boundaries_between_rows_cut_none():
  assert boundary_row(1, total=8, parts=2, tiles=4) == (1, False)
  assert boundary_row(1, total=12, parts=3, tiles=3) == (1, True)
  assert cut_boundaries(batch=132, tiles=32, parts=132) == 0
  assert cut_boundaries(batch=200, tiles=32, parts=132) == 124  # 131 less 7 between rows
