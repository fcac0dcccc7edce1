"""Devices the tests pretend to run on: which one the kernels and configs see
(`kernels._common.first_device`) and whether a GPU is present."""

from __future__ import annotations

import types

from jaxkv.kernels import _common

A100 = ("NVIDIA A100-SXM4-80GB", "8.0")
B200 = ("NVIDIA B200", "10.0")
H100 = ("NVIDIA H100 80GB HBM3", "9.0")


def gpu(kind, capability, platform="gpu", core_count=108):
  """A device as JAX reports one (`core_count`: its multiprocessors, which
  size the plans)."""
  return types.SimpleNamespace(platform=platform, device_kind=kind,
                               compute_capability=capability, core_count=core_count)


def as_first_device(monkeypatch, device):
  """Makes `device` the one configs and plans are picked for, and calls
  compiled (a GPU present)."""
  monkeypatch.setattr(_common, "first_device", lambda: device)
  monkeypatch.setattr(_common, "_has_gpu", lambda: True)
