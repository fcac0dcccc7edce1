#!/usr/bin/env bash
# Installs this checkout into the GPU machine's python3 without touching its
# packages (no network there): source `scripts/device_setup.sh` at the start of
# every device command.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
  || python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/jaxkv_site . \
  && export PYTHONPATH=/tmp/jaxkv_site:${PYTHONPATH:-}
python3 -c "import jaxkv.kernels, jax; print('jaxkv ok on', jax.devices()[0].device_kind, jax.__version__)"
