"""The stream schedule of one-split sparse decode: every CTA an equal run of the batch's tiles.

All rows' top-k tiles laid end to end (row r's tile t is tile `r * tiles + t`
of `total = batch * tiles`) are cut into `parts` runs of equal length, one
CTA per run and head group: part p covers tiles `[p * total // parts, (p + 1)
* total // parts)`. Inside a part, a row's tiles are one segment: a whole
row is the row's result, a row cut by a part's end or start is one of its two
pieces (with `batch >= parts` every run is at least a row long, so a row is
cut at most once). The pieces of the row cut at boundary p (the start of
part p, `1 <= p < parts`) are partial `p - 1`: piece 0 (the row's first
tiles) from part p - 1, piece 1 from part p; `piece_merge` merges them into
the result in place. Where a boundary falls between two rows, no row is cut
there and nothing is written or merged for it.

Unlike rows cut into pieces behind a wave of whole rows (`plan.wave_plan`),
every CTA ends at the same time whatever the batch: 200 x 64 heads is 1.52
whole-row waves, which whole rows run in two.

The functions take Python ints (the plan's model and the tests) or traced
int32 scalars (the kernels).
"""

from __future__ import annotations

import jax.numpy as jnp


def part_bounds(part, *, total: int, parts: int):
  """Part `part`'s first tile and the tile after its last."""
  return part * total // parts, (part + 1) * total // parts


def part_rows(beg, end, *, tiles: int):
  """The rows `[first, last)` that tiles `[beg, end)` touch."""
  return beg // tiles, (end + tiles - 1) // tiles


def segment(row, beg, end, *, tiles: int):
  """Row `row`'s tiles inside `[beg, end)`: (first tile of the row, count)."""
  if all(isinstance(x, int) for x in (row, beg, end)):
    lo, hi = max(beg - row * tiles, 0), min(end - row * tiles, tiles)
  else:
    lo = jnp.maximum(beg - row * tiles, 0)
    hi = jnp.minimum(end - row * tiles, tiles)
  return lo, hi - lo


def boundary_row(boundary, *, total: int, parts: int, tiles: int):
  """The row that boundary `boundary` (the start of that part) cuts, and
  whether it cuts one (False where the boundary falls between rows)."""
  beg = boundary * total // parts
  return beg // tiles, beg % tiles != 0


def boundary_rows(*, batch: int, tiles: int, parts: int) -> list[tuple[int, bool]]:
  """`boundary_row` of boundaries 1 to `parts - 1`, in order (the stream's
  partial `p - 1` belongs to boundary p)."""
  total = batch * tiles
  return [boundary_row(p, total=total, parts=parts, tiles=tiles) for p in range(1, parts)]


def cut_boundaries(*, batch: int, tiles: int, parts: int) -> int:
  """How many rows the stream cuts (each into two pieces)."""
  return sum(cut for _, cut in boundary_rows(batch=batch, tiles=tiles, parts=parts))
