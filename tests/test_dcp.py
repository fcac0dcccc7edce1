"""local_valid_slots: rank-local valid counts under decode context parallelism."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxkv._dcp import local_valid_slots


def brute_force(num_valid, dcp_size, rank, interleave):
  """Deals tokens one by one: token t goes to rank (t // interleave) % size."""
  return sum((t // interleave) % dcp_size == rank for t in range(num_valid))


@given(
    num_valid=st.integers(0, 300),
    dcp_size=st.integers(1, 8),
    interleave=st.integers(1, 9),
    data=st.data(),
)
def test_matches_dealing_tokens(num_valid, dcp_size, interleave, data):
  rank = data.draw(st.integers(0, dcp_size - 1))
  got = local_valid_slots(num_valid, dcp_size, rank, interleave)
  assert isinstance(got, int)
  assert got == brute_force(num_valid, dcp_size, rank, interleave)


def test_issue_case_all_ranks():
  """DCP 8, interleave 1, 275,089 tokens in logical blocks of 12,288 tokens:
  the last block holds 4,753 tokens; rank 0 keeps 595 slots, ranks 1-7 594."""
  tokens, block = 275_089, 12_288
  last = tokens % block
  assert last == 4_753
  want = [595] + [594] * 7
  assert [local_valid_slots(last, 8, r, 1) for r in range(8)] == want
  # The same from the sequence length, modulo the rank-local block size.
  assert [local_valid_slots(tokens, 8, r, 1) % (block // 8) for r in range(8)] == want
  assert sum(want) == last


def test_arrays_and_jit():
  num_valid = jnp.array([0, 1, 7, 4_753, 275_089], jnp.int32)
  ranks = jnp.arange(8, dtype=jnp.int32).reshape(8, 1)
  f = jax.jit(local_valid_slots, static_argnames=("dcp_size", "interleave"))
  got = f(num_valid.reshape(1, -1), dcp_size=8, dcp_rank=ranks, interleave=2)
  assert got.dtype == jnp.int32 and got.shape == (8, 5)
  want = [[brute_force(int(n), 8, r, 2) if n < 5000 else local_valid_slots(int(n), 8, r, 2)
           for n in num_valid] for r in range(8)]
  np.testing.assert_array_equal(np.asarray(got), want)
  # Every token is on exactly one rank.
  np.testing.assert_array_equal(np.asarray(got).sum(0), np.asarray(num_valid))


@pytest.mark.parametrize(
    "args, match",
    [
        ((10, 0, 0, 1), "dcp_size"),
        ((10, 4, 4, 1), "dcp_rank"),
        ((10, 4, -1, 1), "dcp_rank"),
        ((10, 4, 0, 0), "interleave"),
        ((-1, 4, 0, 1), "num_valid"),
        ((1.5, 4, 0, 1), "num_valid"),
    ],
)
def test_bad_arguments(args, match):
  with pytest.raises(ValueError, match=match):
    local_valid_slots(*args)
