"""Shared plumbing for every kernel: the interpret switch, the device's SM count and
tuned-config lookup."""

from __future__ import annotations

import functools
import json
import math
import numbers
import os
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


def check_sm_scale(sm_scale: Any) -> None:
  """A `ValueError` naming `sm_scale` unless it is a finite positive real
  (a Python or NumPy scalar: it is a static argument of the kernels)."""
  if (not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool)
      or not math.isfinite(sm_scale) or not sm_scale > 0):
    raise ValueError(f"{sm_scale=} must be a finite positive float")


def require_interpreter_threads(num_threads: int, kernel: str) -> None:
  """Fails fast where the interpreter cannot run a kernel's warpgroups at once.

  The Pallas GPU interpreter runs every warpgroup of a block as its own CPU
  computation, all at the same time, and warpgroups that wait on each other
  (producer and consumers) need all of them running. The CPU backend runs at
  most max(cores, CPU devices) computations at once; with fewer, the kernel
  would hang forever instead of failing.

  Args:
    num_threads: warpgroups per block of the kernel.
    kernel: the kernel's name, for the message.
  """
  available = cpu_parallelism()
  if available < num_threads:
    raise ValueError(
        f"{kernel} in the Pallas GPU interpreter runs {num_threads} warpgroups at"
        f" once, but this machine's CPU backend runs {available} computations at"
        f" once (max of cores and CPU devices): before JAX starts, call"
        f" jax.config.update('jax_num_cpu_devices', {num_threads}) or set"
        f" XLA_FLAGS=--xla_force_host_platform_device_count={num_threads}"
    )


def cpu_parallelism() -> int:
  """Computations the CPU backend runs at once: max(usable cores, CPU devices)."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return max(cores or 1, len(jax.devices("cpu")))


@functools.cache
def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def first_device():
  """The device whose kind and SM count pick configs and plans: JAX's first."""
  return jax.devices()[0]


# The Mosaic GPU kernels use wgmma, setmaxnreg and TMA as sm_90a has them: they
# compile for NVIDIA Hopper GPUs (H100, H200, H20, GH200) alone.
KERNEL_CAPABILITY = "9.0"


def runs_kernels(device=None) -> bool:
  """Whether `device` (default: the first) runs the Pallas kernels compiled: an
  NVIDIA GPU of compute capability 9.0 (or one that reports none, which
  Mosaic GPU itself then compiles for as 9.0)."""
  device = device or first_device()
  capability = getattr(device, "compute_capability", None)
  return device.platform in ("gpu", "cuda") and capability in (KERNEL_CAPABILITY, None)


def other_gpu(device=None) -> bool:
  """Whether `device` (default: the first) is a GPU that cannot run the Pallas
  kernels compiled (an A100, a Blackwell, an AMD GPU): ops whose semantics
  have a jnp form default to it there."""
  device = device or first_device()
  return device.platform in ("gpu", "cuda", "rocm") and not runs_kernels(device)


# What a compiled call of an op with a jnp form runs: its kernel or XLA (the
# ops' configs' `implementation`).
IMPLEMENTATIONS = ("pallas", "xla")


def default_implementation() -> str:
  """The ops' default `implementation`: XLA where the first device is a GPU
  that cannot run the kernels, else the kernel (interpreted on a CPU)."""
  return "xla" if other_gpu() else "pallas"


def require_kernel_device(kernel: str, fallback: str) -> None:
  """A `ValueError` before a compiled launch of `kernel` on a device that
  cannot run it, naming the device and what runs there instead (`fallback`)."""
  device = first_device()
  if runs_kernels(device):
    return
  capability = getattr(device, "compute_capability", None)
  what = f"{device.device_kind} (compute capability {capability})" if capability else (
      f"{device.platform} device {device.device_kind!r}")
  raise ValueError(
      f"{kernel}'s Pallas kernel compiles for NVIDIA Hopper GPUs (compute capability"
      f" {KERNEL_CAPABILITY}) alone, not for the {what}: pass {fallback} (the same"
      " results without the kernel) or interpret=True"
  )


# Multiprocessors a plan counts where no GPU reports its own (the CPU and its
# interpreter): an H100 SXM's or H200's, so that plans made there are the H200's.
DEFAULT_SMS = 132


def num_sms() -> int:
  """The first device's multiprocessors where it is a GPU that reports them
  (`Device.core_count`: 132 on an H200, 114 on an H100 PCIe), else
  `DEFAULT_SMS`. Plans and heuristics size their grids by it."""
  device = first_device()
  count = getattr(device, "core_count", None) if device.platform in ("gpu", "cuda") else None
  return count if isinstance(count, int) and count > 0 else DEFAULT_SMS


def device_kind() -> str:
  """A file-name-safe name of the first device, e.g. `nvidia_h200`."""
  kind = first_device().device_kind
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
