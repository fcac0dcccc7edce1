"""Which devices run the Pallas kernels compiled (NVIDIA Hopper GPUs), and what
the ops do on any other: their default config runs the jnp form (the decode
references, zero_blocks' scatter, write_kv's scatter), and a config that asks
for a kernel gets a `ValueError` naming the device, before anything is
launched."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels import _common
from jaxkv.kernels.mla_decode import MLADecodeConfig, mla_decode, mla_decode_reference
from jaxkv.kernels.mla_decode.config import default_config as dense_default
from jaxkv.kernels.sparse_mla_decode import (
    SparseMLADecodeConfig,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)
from jaxkv.kernels.sparse_mla_decode.config import default_config as sparse_default
from jaxkv.kernels.write_kv import write_kv
from jaxkv.kernels.write_kv.config import get_config as write_kv_config
from jaxkv.kernels.zero_blocks import ZeroBlocksConfig, zero_blocks, zero_blocks_reference
from jaxkv.kernels.zero_blocks.config import get_config as zero_blocks_config

import mla_problem as dense
import sparse_problem as sparse
from devices import A100, B200, H100, as_first_device, gpu


def test_the_kernels_run_on_hopper_alone():
  assert _common.runs_kernels(gpu(*H100))
  assert _common.runs_kernels(gpu("NVIDIA H200", None))  # none reported: Mosaic GPU's 9.0
  for device in (gpu(*A100), gpu(*B200), gpu("AMD Instinct MI300X", "gfx942", "rocm")):
    assert not _common.runs_kernels(device) and _common.other_gpu(device)
  cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")
  assert not _common.runs_kernels(cpu) and not _common.other_gpu(cpu)
  assert not _common.other_gpu(gpu(*H100))


@pytest.mark.parametrize("device", [A100, B200])
def test_another_gpu_runs_the_reference_by_default(monkeypatch, device):
  as_first_device(monkeypatch, gpu(*device))
  assert dense_default(batch=4, num_heads=64).implementation == "xla"
  assert sparse_default(batch=4, num_heads=64, topk=128).implementation == "xla"
  assert write_kv_config("LBNHC").backend == "xla"  # a many-layer layout
  assert zero_blocks_config(1152).implementation == "xla"
  q, cache, table, lens = dense.problem(3, [70, 0, 129], 16)
  cache = jnp.asarray(cache, jnp.bfloat16)
  table, lens = jnp.asarray(table), jnp.asarray(lens)
  for mode in ("select", "multiply"):
    got = mla_decode(q, cache, table, lens, sm_scale=dense.SCALE, mask_mode=mode)
    want = mla_decode_reference(q, cache, table, lens, sm_scale=dense.SCALE, mask_mode=mode)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  q, cache, idx = sparse.inputs(4, 3, 16, 128)
  got = sparse_mla_decode(q, cache, idx, sm_scale=sparse.SCALE)
  want = sparse_mla_decode_reference(q, cache, idx, sm_scale=sparse.SCALE)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_hopper_runs_the_kernels_by_default(monkeypatch):
  as_first_device(monkeypatch, gpu(*H100))  # its sparse file names other shapes: the heuristic
  assert dense_default(batch=4, num_heads=64).implementation == "pallas"
  assert write_kv_config("LBNHC").backend == "pallas"
  assert zero_blocks_config(1152).implementation == "pallas"
  assert sparse_default(batch=4, num_heads=64, topk=128).implementation == "pallas"
  as_first_device(monkeypatch, gpu("NVIDIA H200", "9.0"))  # the tuned file
  assert dense_default(batch=128, num_heads=64).implementation == "pallas"
  assert sparse_default(batch=128, num_heads=64, topk=2048).implementation == "pallas"


def test_the_kernels_asked_for_elsewhere_name_the_device(monkeypatch):
  q, cache, table, lens = dense.problem(5, [70, 3], 16)
  dense_args = (q, jnp.asarray(cache, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens))
  sq, scache, idx = sparse.inputs(6, 2, 16, 128)

  def calls(interpret=None):
    yield lambda: mla_decode(*dense_args, sm_scale=dense.SCALE, interpret=interpret,
                             config=MLADecodeConfig(implementation="pallas"))
    yield lambda: sparse_mla_decode(sq, scache, idx, sm_scale=sparse.SCALE, interpret=interpret,
                                    config=SparseMLADecodeConfig(implementation="pallas"))
    yield lambda: zero_blocks(jnp.ones((4, 8, 64), jnp.bfloat16), jnp.asarray([1]), layout="BNC",
                              interpret=interpret, config=ZeroBlocksConfig(implementation="pallas"))
    yield lambda: write_kv(jnp.zeros((2, 4, 3, 8, 64), jnp.bfloat16),
                           jnp.ones((1, 2, 8, 64), jnp.bfloat16), jnp.asarray([1]),
                           layout="LBNHC", interpret=interpret, backend="pallas")

  # This machine's CPU, compiled on purpose.
  for call in calls(interpret=False):
    with pytest.raises(ValueError, match=r"Hopper GPUs .*not for the cpu device .*='xla'"):
      call()
  as_first_device(monkeypatch, gpu(*A100))
  for call in calls():
    with pytest.raises(ValueError, match=r"not for the NVIDIA A100-SXM4-80GB \(compute capability 8.0\)"):
      call()


@pytest.mark.parametrize(
    "layout, shape, block_size",
    [
        ("BNC", (12, 4, 576), 8),  # MLA rows, two kernel blocks a logical one
        ("LBNHC", (3, 8, 4, 2, 16), 4),  # many layers: a run per layer
        ("BHCN", (8, 2, 3, 4), 8),  # slot axis innermost: a row per element
    ],
)
def test_zero_blocks_scatters_on_another_gpu(monkeypatch, layout, shape, block_size):
  """The scatter zeroes exactly the named blocks' and tails' bytes, every
  other byte (NaN payloads included) as it was, as the reference does."""
  as_first_device(monkeypatch, gpu(*A100))
  raw = np.random.default_rng(9).integers(1, 2**16, size=shape, dtype=np.uint16)
  cache = jnp.asarray(raw.view(jnp.bfloat16))
  # Tails whose runs end where a kept row starts (block 2's first slots).
  ids = jnp.asarray([3, -1, 0], jnp.int32)
  tails = (jnp.asarray([1, 2, -1], jnp.int32), jnp.asarray([3, 2, 1], jnp.int32))
  got = zero_blocks(cache, ids, layout=layout, block_size=block_size, tails=tails)
  want = zero_blocks_reference(cache, ids, layout=layout, block_size=block_size, tails=tails)
  got, want = np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)
  np.testing.assert_array_equal(got, want)
  assert (want == 0).any() and (want == raw).any()


def test_implementation_is_checked():
  with pytest.raises(ValueError, match="implementation='triton' must be one of"):
    MLADecodeConfig(implementation="triton")
  with pytest.raises(ValueError, match="implementation"):
    SparseMLADecodeConfig(implementation="triton")
  with pytest.raises(ValueError, match="implementation"):
    ZeroBlocksConfig(implementation="triton")
