"""A pytest plugin that writes every Mosaic GPU module the tests lower, as text
without debug info, to the folder named by $DUMP_LOWERED, with an index of
their hashes (`index.txt`: hash, test id, module number within the test).

Two runs (before and after a change) whose indexes are equal lowered the same
kernels: a refactor that keeps them equal changes no device code. Run the
CUDA lowering tests with it, e.g.

    DUMP_LOWERED=/tmp/before PYTHONPATH=scripts .venv/bin/python -m pytest \
        -p dump_lowered -k lower tests
    diff <(sort /tmp/before/index.txt) <(sort /tmp/after/index.txt)

(`-n` must not be given: the module numbers count within one process. A
module's dump name, numbered across the process, is left out of the text.)
"""

import collections
import hashlib
import os
import re

from jax.experimental.mosaic.gpu import core

_serde = core._run_serde_pass
_counts = collections.Counter()


def _dumping_serde(module, *, serialize, ir_version=None):
  if serialize:  # the module as the kernel call embeds it
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    _counts[test] += 1
    text = module.operation.get_asm(enable_debug_info=False)
    # A process-wide counter numbers each module's dump name: drop it.
    text = re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', "", text)
    out = os.environ["DUMP_LOWERED"]
    os.makedirs(out, exist_ok=True)
    name = hashlib.md5(test.encode()).hexdigest()[:10] + f"_{_counts[test]}"
    with open(os.path.join(out, f"{name}.mlir"), "w") as f:
      f.write(text)
    with open(os.path.join(out, "index.txt"), "a") as f:
      digest = hashlib.sha256(text.encode()).hexdigest()[:16]
      f.write(f"{digest} {test} #{_counts[test]} {name}.mlir\n")
  return _serde(module, serialize=serialize, ir_version=ir_version)


core._run_serde_pass = _dumping_serde
