"""The stream schedule of one-split sparse decode: every CTA an equal share of the batch's tiles.

`parts` CTAs per head group share the batch's `batch * tiles` tiles (row r's
tile t is tile `r * tiles + t`). Part p first takes `whole` rows of its own,
whole: rows `[p * whole, (p + 1) * whole)`, run A. The rest of the batch,
rows `[parts * whole, batch)` (the leftover rows, `left` tiles laid end to
end), is cut into `parts` runs as even as whole tiles allow, one per part
behind its whole rows: run B, leftover tiles `[start(p), start(p + 1))`.
With `whole = 0` every row is leftover: the batch's tiles laid end to end in
`parts` equal runs.

With `segment_cost = c > 0` the leftover runs are cut by cost instead: a row
segment costs a part c tiles of its own (its query, its row sums, its finish
and store), so a run that crosses a row's edge should take fewer tiles. The
cut is made on a line where each leftover row is c units of overhead and then
its tiles; the line is cut in `parts` equal runs, and a cut inside a row's
overhead moves to the row's first tile. (At 83 rows x 128 heads, 66 parts a
head group, a segment at 4 tiles: the worst part, in those units, goes from
52, its whole row, 7 tiles and 1 in two more segments, to 50, its whole row
and 10 tiles in one more.) With the cuts more than c apart on the line
(`overhead` caps c) every run keeps at least one tile. A segment of one
tile costs more than the line charges (its query's load and its finish
come back to back: on an H100 at 83 x 128, parts `[32, 1, 5]` ran 6k cycles
over the fit of the others, a tile and a half), so where the runs are long
enough (`snap`) a cut one tile from a row's edge moves to the edge.

Inside a run, a row's tiles are one segment: a whole row is the row's
result, written by the part; a leftover row touched by several parts' runs
is cut into pieces, one per run (`row_pieces` of them, in order along the
row), piece j of leftover row i at `[i, j]` of the pieces' outputs, which
`piece_merge` merges into the result in place.

With `whole = batch // parts` (`SparseMLADecodeConfig.stream_whole`; by
default where `plan.stream_whole_pays`) few rows are cut: at 83 rows x 128
heads in 66 parts per head group, 17 rows per head group in 4-5 pieces,
against 63 rows in two with `whole = 0`; the merge reads and writes about
half the bytes.

Unlike rows cut into pieces behind a wave of whole rows (`plan.wave_plan`),
every CTA ends at about the same time whatever the batch.

The functions take Python ints (the plan's model and the tests) or traced
int32 scalars (the kernels) for their row, part and tile arguments.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp


def _min(a, b):
  return min(a, b) if all(isinstance(x, int) for x in (a, b)) else jnp.minimum(a, b)


def _where(c, a, b):
  return (a if c else b) if isinstance(c, bool) else jnp.where(c, a, b)


def _max(a, b):
  return max(a, b) if all(isinstance(x, int) for x in (a, b)) else jnp.maximum(a, b)


@dataclasses.dataclass(frozen=True)
class Stream:
  """A stream schedule's static shape (module docstring)."""

  batch: int
  tiles: int  # a row's tiles
  parts: int  # CTAs per head group
  whole: int = 0  # whole rows per part, before its leftover run
  segment_cost: int = 0  # a row segment's own cost in tiles: the leftover runs are cut by cost

  def __post_init__(self):
    assert self.tiles >= 1 and self.parts >= 1 and 0 <= self.whole * self.parts <= self.batch
    assert self.segment_cost >= 0

  @property
  def first_left_row(self) -> int:
    """The first leftover row."""
    return self.parts * self.whole

  @property
  def left_rows(self) -> int:
    return self.batch - self.first_left_row

  @property
  def left(self) -> int:
    """The leftover rows' tiles."""
    return self.left_rows * self.tiles

  @functools.cached_property
  def overhead(self) -> int:
    """The segment cost the cut uses: `segment_cost`, capped so that the
    cuts on the cost line lie more than one row's overhead apart (`line //
    parts > overhead`): two never move to one row's first tile, and every
    run keeps a tile at least."""
    if self.left < self.parts:
      return 0
    c = self.segment_cost
    while c and self.left_rows * (self.tiles + c) // self.parts <= c:
      c -= 1
    return c

  @functools.cached_property
  def snap(self) -> int:
    """With the cut by cost: how far from a row's edge a cut moves to it (1
    where the cuts lie more than `overhead + 2` apart on the line, so that
    moving two of them by a tile each leaves every run a tile; else 0)."""
    c = self.overhead
    return int(bool(c) and self.tiles > 2 and self.line // self.parts > c + 2)

  @functools.cached_property
  def line(self) -> int:
    """The cost line's length: each leftover row's overhead and tiles."""
    return self.left_rows * (self.tiles + self.overhead)

  def start(self, part):
    """Where part `part`'s leftover run starts, in leftover tiles: as even
    as whole tiles allow (by cost with `segment_cost`: module docstring), and
    where there are fewer tiles than parts, one tile a part for the first
    `left` parts."""
    if self.left < self.parts:
      return _min(part, self.left)
    c = self.overhead
    if not c:
      return part * self.left // self.parts
    u = part * self.line // self.parts  # the cut on the cost line
    row, at = u // (self.tiles + c), u % (self.tiles + c)
    at = _max(at - c, 0)  # the tile in the row (0 from inside its overhead)
    if self.snap:  # within `snap` tiles of the row's edge: the edge
      at = _where(at <= self.snap, 0, _where(at >= self.tiles - self.snap, self.tiles, at))
    return row * self.tiles + at

  def first_part(self, x):
    """The part whose leftover run holds leftover tile `x`: the largest p
    with start(p) <= x."""
    if self.left < self.parts:
      return x
    if self.snap:  # the last tile a cut can lie on and still move to x or before
      s, t, first = self.snap, self.tiles, x // self.tiles * self.tiles  # x's row's first tile
      at = x - first
      x = _where(at <= s, first + s, _where(at >= t - s, first + t - s - 1, x))
    # The last point of the cost line at or before tile x (the cuts before
    # it start at or before x): x's own, behind its row's overhead.
    u = x + (x // self.tiles + 1) * self.overhead if self.overhead else x
    return ((u + 1) * self.parts - 1) // self.line

  def runs(self, part):
    """Part `part`'s two runs as `[begin, end)` in the batch's tiles."""
    a = part * self.whole * self.tiles
    b = self.first_left_row * self.tiles
    return (a, a + self.whole * self.tiles), (b + self.start(part), b + self.start(part + 1))

  def run_rows(self, beg, end):
    """The rows `[first, last)` that tiles `[beg, end)` touch (none if empty)."""
    first = beg // self.tiles
    last = (end + self.tiles - 1) // self.tiles
    if all(isinstance(x, int) for x in (beg, end)):
      return first, last if end > beg else first
    return first, jnp.where(end > beg, last, first)

  def segment(self, row, beg, end):
    """Row `row`'s tiles inside `[beg, end)`: (first tile of the row, count)."""
    lo = _max(beg - row * self.tiles, 0)
    hi = _min(end - row * self.tiles, self.tiles)
    return lo, hi - lo

  def row_pieces(self, i):
    """How many runs leftover row `i` is cut into (1: one run holds it whole)."""
    if self.left < self.parts:
      return self.tiles
    x = i * self.tiles
    return self.first_part(x + self.tiles - 1) - self.first_part(x) + 1

  def piece(self, part, row):
    """Which piece of leftover row `row` (a batch row) part `part`'s run holds."""
    x = (row - self.first_left_row) * self.tiles
    if self.left < self.parts:
      return self.start(part) - x
    return part - self.first_part(x)

  @property
  def max_pieces(self) -> int:
    """The most pieces of a leftover row (1: none is cut)."""
    return max((self.row_pieces(i) for i in range(self.left_rows)), default=1)

  @property
  def cut_rows(self) -> int:
    """How many leftover rows are cut (into more than one piece)."""
    return sum(self.row_pieces(i) > 1 for i in range(self.left_rows))

  @property
  def cut_pieces(self) -> int:
    """How many pieces the cut rows have in all (what the merge reads)."""
    return sum(n for n in map(self.row_pieces, range(self.left_rows)) if n > 1)
