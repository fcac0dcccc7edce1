"""Test-wide settings: 8 fake CPU devices, strict dtype promotion, jaxtyping checks."""

import os

# Must be set before jax is imported anywhere in the test process.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxtyping  # noqa: E402

# Runtime shape/dtype checks of every jaxtyping-annotated jaxkv signature.
jaxtyping.install_import_hook(["jaxkv"], "beartype.beartype")

import hypothesis  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

hypothesis.settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True
)
hypothesis.settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _reset_gpu_interpreter():
  """An exception inside an interpreted kernel leaves global state behind."""
  yield
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  gpu_callbacks.reset_gpu_interpret_mode_state()
