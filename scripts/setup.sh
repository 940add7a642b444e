#!/usr/bin/env bash
# Create .venv with the whole stack (CPU torch here; pyproject states ranges a GPU user installs),
# warm DeepSpeed's CPU extension once, and (as root) install the SSH and SLURM testbed packages.
# Idempotent: a second run only checks. Usage: scripts/setup.sh [--no-testbeds]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
stamp=$VENV/.setup-$(sha256sum pyproject.toml | cut -c1-12)

if [ ! -x $VENV/bin/python ]; then
    echo "setup: creating $VENV"
    $PY -m venv $VENV
fi
if [ ! -f "$stamp" ]; then
    echo "setup: installing the Python stack into $VENV (a few minutes on a fresh machine)"
    $VENV/bin/pip install -q --upgrade pip wheel setuptools 2>&1 | grep -v "^WARNING: Location" || true
    # torch first and pinned: here it takes the CPU wheel on disk; unpinned it would pull a CUDA build.
    $VENV/bin/pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
    $VENV/bin/pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
    $VENV/bin/python -c "import torch, accelerate, transformers, trl, datasets, deepspeed, paramiko, submitit, omegaconf" \
        || { echo "setup: the Python stack did not install" >&2; exit 1; }
    rm -f $VENV/.setup-*
    touch "$stamp"
fi
# DeepSpeed compiles its CPU communication extension on first use (~47 s); do it once here, for this venv
# (the build is keyed to the venv's paths: a .so built for another venv is rebuilt). A build that was killed
# leaves torch's lock file behind and every later run would wait on it forever: clear locks older than 10 min.
find ~/.cache/torch_extensions -name lock -mmin +10 -delete 2>/dev/null || true
echo "setup: DeepSpeed CPU extension (builds once, ~1 min; then a no-op)"
timeout 900 $VENV/bin/python -c "from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder; ShareMemCommBuilder().load()" \
    >/dev/null 2>&1 || echo "setup: warning: DeepSpeed CPU extension did not build (DeepSpeed tests will build it)"
if [ "${1:-}" != "--no-testbeds" ] && [ "$(id -u)" = 0 ]; then
    for s in scripts/install_ssh_deps.sh scripts/install_slurm_deps.sh scripts/install_container_deps.sh \
             scripts/install_browser_deps.sh; do
        [ -x "$s" ] && bash "$s"
    done
fi
echo "setup: ok ($($VENV/bin/python -c 'import torch, trl, accelerate; print(f"torch {torch.__version__}, accelerate {accelerate.__version__}, trl {trl.__version__}")'))"
