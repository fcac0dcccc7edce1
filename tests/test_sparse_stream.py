"""The stream schedule's arithmetic (`sparse_mla_decode.stream.Stream`), in plain Python."""

import itertools

from jaxkv.kernels.sparse_mla_decode.stream import Stream


def stream_segments(stream):
  """Each part's segments as (row, first tile, count), as the kernels walk them."""
  out = []
  for p in range(stream.parts):
    segs = []
    for beg, end in stream.runs(p):
      first, last = stream.run_rows(beg, end)
      segs += [(row, *stream.segment(row, beg, end)) for row in range(first, last)]
    out.append(segs)
  return out


def test_segments_cover_every_tile_once_and_pieces_are_numbered_along_the_row():
  """For every batch >= parts, with and without whole rows first, with
  and without a cut by cost: the parts' segments cover each row's tiles
  exactly once, in order, none empty; the parts' tile counts differ by one
  at most (by cost: each leftover run holds a tile at least and costs, a
  segment at `overhead` tiles, at most its share of the cost line, one
  segment more and the `snap` tiles at each end); a part's whole rows are
  its own (`whole` of them, first); a row cut into pieces is a leftover row, its
  pieces `row_pieces` of them, numbered 0, 1, ... along the row by `piece`;
  a leftover row in one run has `row_pieces` 1 and is one whole segment."""
  for tiles, parts in itertools.product((1, 2, 3, 5, 32), (2, 3, 7, 66, 132)):
    for batch, segment in itertools.product(
        sorted({parts, parts + 1, 2 * parts - 1, 2 * parts, 3 * parts + 5}), (0, 1, 4, 40)):
      for whole in sorted({0, 1, batch // parts}):
        stream = Stream(batch, tiles, parts, whole, segment)
        segs = stream_segments(stream)
        covered = {}
        sizes = [sum(n for _, _, n in part) for part in segs]
        assert sum(sizes) == batch * tiles
        if not stream.overhead:
          assert max(sizes) - min(sizes) <= 1
        else:  # every run a tile at least; each costs at most its share of the line,
          # c, and the tiles its ends moved to a row's edge
          c, snap = stream.overhead, stream.snap
          assert 1 <= c <= segment and stream.line // parts > c + 2 * snap
          costs = [sum(n + c for _, _, n in part[whole:]) for part in segs]
          assert min(sizes) > whole * tiles
          assert max(costs) <= -(-stream.line // parts) + c + 2 * snap
        for p, part in enumerate(segs):
          assert all(n > 0 for _, _, n in part)
          assert [row for row, _, _ in part[:whole]] == list(range(p * whole, (p + 1) * whole))
          assert all(lo == 0 and n == tiles for _, lo, n in part[:whole])
          for row, lo, n in part:
            covered.setdefault(row, []).append((lo, n, p))
        assert sorted(covered) == list(range(batch))
        cut = cut_pieces = 0
        for row, pieces in covered.items():
          assert [lo for lo, _, _ in pieces] == [0] + [lo + n for lo, n, _ in pieces[:-1]]
          assert sum(n for _, n, _ in pieces) == tiles
          if row < stream.first_left_row:
            assert len(pieces) == 1
            continue
          assert stream.row_pieces(row - stream.first_left_row) == len(pieces)
          assert [stream.piece(p, row) for _, _, p in pieces] == list(range(len(pieces)))
          cut += len(pieces) > 1
          cut_pieces += len(pieces) if len(pieces) > 1 else 0
        assert (cut, cut_pieces) == (stream.cut_rows, stream.cut_pieces)
        assert stream.max_pieces == max(
            [len(v) for r, v in covered.items() if r >= stream.first_left_row], default=1)


def test_fewer_leftover_tiles_than_parts_take_a_tile_a_part():
  """133 rows of 32 tiles in 132 parts: one whole row each, then the last
  row's 32 tiles one to each of the first 32 parts (the other 100 runs are
  empty); the plain stream cuts 127 rows in two instead."""
  stream = Stream(133, 32, 132, 1)
  assert [stream.runs(p)[1] for p in (0, 31, 32, 131)] == [
      (4224, 4225), (4255, 4256), (4256, 4256), (4256, 4256)]
  assert stream.run_rows(4256, 4256) == (133, 133)
  assert (stream.cut_rows, stream.max_pieces) == (1, 32)
  plain = Stream(133, 32, 132, 0)
  assert (plain.cut_rows, plain.max_pieces) == (127, 2)


def test_whole_rows_first_cut_fewer_rows_in_more_pieces():
  """83 x 128 heads (66 parts a head group, 32 tiles a row): 17 leftover rows
  in 4-5 pieces against 63 rows in two; 140 rows: 8 in up to 9; a batch of
  whole rows only cuts none."""
  assert (Stream(83, 32, 66, 1).cut_rows, Stream(83, 32, 66, 1).max_pieces) == (17, 5)
  assert (Stream(83, 32, 66, 0).cut_rows, Stream(83, 32, 66, 0).max_pieces) == (63, 2)
  assert (Stream(140, 32, 66, 2).cut_rows, Stream(140, 32, 66, 2).max_pieces) == (8, 9)
  assert (Stream(132, 32, 66, 2).cut_rows, Stream(132, 32, 66, 2).max_pieces) == (0, 1)
  assert Stream(132, 32, 66, 0).cut_rows == 0


def test_cut_by_cost_shortens_the_worst_part():
  """83 x 128 heads (66 parts a head group, one whole row a part, 17 leftover
  rows of 32 tiles), a segment at 4 tiles: the worst part's cost, its whole
  row's included, falls from 52 (32 + 7 + 1 tiles in three segments) to 50
  (32 + 10 in two), the same 17 rows cut in 5 pieces at most. The cap keeps
  the cuts more than a row's overhead apart on the line: at most 9 tiles
  here (17 x 41 // 66 = 10 > 9), 3 at 140 x 128 (8 x 35 // 66 = 4), none
  with fewer leftover tiles than parts (the tile-a-part cut)."""
  def worst(stream, c=4):
    return max((sum(n + c for _, _, n in part), [n for _, _, n in part])
               for part in stream_segments(stream))

  equal, by_cost = Stream(83, 32, 66, 1), Stream(83, 32, 66, 1, 4)
  assert worst(equal) == (52, [32, 7, 1]) and worst(by_cost) == (50, [32, 10])
  assert (by_cost.cut_rows, by_cost.max_pieces) == (equal.cut_rows, equal.max_pieces) == (17, 5)
  # A cut one tile from a row's edge moves to it where the runs are long
  # enough: at 3 tiles a segment, no part of 83 x 128 keeps a one-tile piece
  # (its `[32, 1, 5]` parts ran 6k cycles over the others on an H100).
  by_3 = Stream(83, 32, 66, 1, 3)
  assert by_3.snap == 1 and worst(by_3, 3) == (48, [32, 10])
  assert min(n for part in stream_segments(by_3) for _, _, n in part) == 2

  class Unsnapped(Stream):
    snap = 0

  assert any(n == 1 for part in stream_segments(Unsnapped(83, 32, 66, 1, 3)) for _, _, n in part)
  assert Stream(75, 32, 66, 1, 3).snap == 0  # 9 x 35 // 66 = 4: runs too short
  assert Stream(83, 32, 66, 1, 40).overhead == 9
  assert Stream(133, 32, 132, 1, 4).overhead == 0  # 32 leftover tiles, 132 parts
  assert Stream(140, 32, 66, 2, 4).overhead == 3
  assert worst(Stream(140, 32, 66, 2)) == (83, [32, 32, 2, 1])
  assert worst(Stream(140, 32, 66, 2, 4)) == (81, [32, 32, 5])
