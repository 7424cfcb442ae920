#!/usr/bin/env bash
# FlashAttention-4's wheels for the GPU machine (python 3.12, torch 2.11+cu130), for the bench
# hook BENCH_SDPA_IMPL=FA4 and scripts/bench_attention.py (issue #15). Run from the repo root,
# after ../shared/device/wheels.sh. Three ignored folders:
#   .whl_fa4/    flash-attn-4 and the small wheels it needs (~9 MB)
#   .fa4_part1/  .fa4_part2/   the CUDA 13 CUTLASS DSL library (one 92 MB wheel, 226 MB
#                unpacked) as an xz'd tar split in two: a device call carries at most 64 MiB
#                with the working tree, so the parts travel in two calls to one warm machine
#                (gpu_session.sh steps fa4a, then fa4 within 30 s; fa4a's part stays there).
# On the machine the tar unpacks into /tmp/site, and nvidia_cutlass_dsl/dsl_packages goes on
# PYTHONPATH (what the meta-package's .pth file does, which --target folders do not run).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
for d in .whl_fa4 .fa4_part1 .fa4_part2; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
rm -rf .whl_fa4 .fa4_part1 .fa4_part2 && mkdir -p .whl_fa4 .fa4_part1 .fa4_part2
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$@" 2>&1 | grep -v '^WARNING' || true
}
get .whl_fa4 flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 \
    nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
    apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
tmp=$(mktemp -d)
get "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
mkdir "$tmp/x" && (cd "$tmp/x" && python3 -m zipfile -e "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl .)
tar -C "$tmp/x" -cf - . | xz -9e -T0 > "$tmp/cu13.tar.xz"
split -b 40M -d "$tmp/cu13.tar.xz" "$tmp/cu13.tar.xz."
mv "$tmp/cu13.tar.xz.00" .fa4_part1/ && mv "$tmp"/cu13.tar.xz.0[1-9] .fa4_part2/
(cd "$tmp" && sha256sum cu13.tar.xz) > .fa4_part2/cu13.tar.xz.sha256  # checked after joining
rm -rf "$tmp"
du -sh .whl_fa4 .fa4_part1 .fa4_part2
