#!/usr/bin/env bash
# Here, on a machine that reaches PyPI: Ray Serve and every package it needs, as wheels for the
# GPU image (CPython 3.12, x86-64 manylinux; that image has no network and no ray, fastapi,
# uvicorn or pydantic), packed into one tar split into parts of at most 45 MiB under .stage/ray/
# (git-ignored), with the tar's SHA-256: a device call carries the tracked tree (~13 MB) beside
# one part, 64 MiB in all. numpy is left out: the image has it.
# Then one device call per part (benchmarks/device/README.md, "Ray Serve on the GPU machine").
#
#   bash benchmarks/device/stage_ray.sh            # ray[serve]==2.60.0, the version the tests run
#   RAY_VERSION=2.61.0 bash benchmarks/device/stage_ray.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
version="${RAY_VERSION:-2.60.0}"
out=.stage/ray
rm -rf "$out"
mkdir -p "$out/wheels"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$out/wheels" "ray[serve]==$version"
rm -f "$out"/wheels/numpy-*.whl
tar -C "$out" -cf "$out/wheels.tar" wheels
sha256sum "$out/wheels.tar" | cut -d' ' -f1 > "$out/SHA256"
echo "$version" > "$out/VERSION"
split -b 45M -d "$out/wheels.tar" "$out/part-"
rm -rf "$out/wheels" "$out/wheels.tar"
echo "ray[serve]==$version: $(ls "$out"/part-* | wc -l) part(s) in $out ($(du -sh "$out" | cut -f1))"
