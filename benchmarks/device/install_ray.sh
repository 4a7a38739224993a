#!/usr/bin/env bash
# On the GPU machine, once every part that stage_ray.sh made is in /tmp/stage/ray/ (and
# .stage/ray/SHA256 and VERSION travelled with this call's tree): join the parts, check the
# SHA-256, and install ray[serve] offline into the image's Python. pip resolves against what the
# image already has and takes only what is missing from the wheels, so nothing it has is replaced.
set -euo pipefail
cd "$(dirname "$0")/../.."
stage=/tmp/stage/ray
cat "$stage"/part-* > "$stage/wheels.tar"
echo "$(cat .stage/ray/SHA256)  $stage/wheels.tar" | sha256sum -c --quiet
tar -C "$stage" -xf "$stage/wheels.tar"
python3 -m pip install --quiet --disable-pip-version-check --no-index --find-links "$stage/wheels" \
  "ray[serve]==$(cat .stage/ray/VERSION)"
python3 -c "import ray, ray.serve, fastapi, uvicorn; print('ray', ray.__version__, 'fastapi', fastapi.__version__)"
