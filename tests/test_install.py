"""jaxkv.kernels is importable from outside the repository, and only under jaxkv."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PROBE = (
    "import importlib.util, jaxkv, jaxkv.kernels, jaxkv.kernels._common as c;"
    "assert importlib.util.find_spec('kernels') is None, 'top-level kernels importable';"
    "assert c.load_tuning('no_such_op', 'cpu') is None;"
    "import jaxkv._config as cfg; assert 'tiny-mla' in cfg.list_model_configs();"
    "print(jaxkv.kernels.__file__)"
)


def _probe(cwd, env=None):
  return subprocess.run(
      [sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, check=True
  ).stdout.strip()


def test_editable_install_imports_from_outside(tmp_path):
  # The test environment installs jaxkv editable (scripts/setup.sh).
  path = _probe(tmp_path)
  assert pathlib.Path(path).resolve() == REPO / "kernels" / "__init__.py"


@pytest.mark.slow
def test_wheel_install_imports_from_outside(tmp_path):
  target = tmp_path / "site"
  subprocess.run(
      [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
       "--target", str(target), str(REPO)],
      check=True, capture_output=True, text=True,
  )
  env = dict(os.environ, PYTHONPATH=str(target), PYTHONSAFEPATH="1")
  path = _probe(tmp_path, env)
  assert pathlib.Path(path).is_relative_to(target), path
  assert (target / "jaxkv" / "_configs" / "models" / "deepseek-v3.yaml").is_file()
