"""Shared plumbing for every kernel: the interpret switch and tuned-config lookup."""

from __future__ import annotations

import functools
import json
import re
from importlib import resources
from typing import Any

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu


def resolve_interpret(interpret: Any) -> plgpu.InterpretGPUParams | None:
  """Turns the public `interpret=` argument into what `plgpu.kernel` takes.

  Args:
    interpret: `None` runs the compiled kernel on a GPU and the Pallas GPU
      interpreter where there is none; `True` forces the interpreter; an
      `plgpu.InterpretGPUParams` forces it with those settings; `False` forces
      compilation (and fails without a GPU).

  Returns:
    `None` for a compiled launch, else the interpreter parameters.
  """
  if isinstance(interpret, plgpu.InterpretGPUParams):
    return interpret
  if interpret is None:
    return None if _has_gpu() else plgpu.InterpretGPUParams()
  if interpret is True:
    return plgpu.InterpretGPUParams()
  if interpret is False:
    return None
  raise ValueError(
      "interpret must be None, True, False or a plgpu.InterpretGPUParams, got"
      f" {interpret!r}"
  )


@functools.cache
def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def device_kind() -> str:
  """A file-name-safe name of the first device, e.g. `nvidia_h200`."""
  kind = jax.devices()[0].device_kind
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_")


@functools.cache
def load_tuning(op: str, kind: str) -> dict[str, Any] | None:
  """Tuned configs of `op` for a device kind, or None where none were tuned.

  The files live at `configs/tuning/<op>/<kind>.json` and ship as package data.
  """
  path = resources.files("jaxkv._configs").joinpath("tuning", op, f"{kind}.json")
  if not path.is_file():
    return None
  return json.loads(path.read_text())
