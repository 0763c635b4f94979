#!/usr/bin/env bash
# The wheels the GPU machine lacks, downloaded here into a git-ignored folder
# that travels with the working tree (64 MiB in all, the tree included).
#
#     bash benchmarks/gpu_wheels.sh [DIR]      # default DIR: .gpu_wheels (repo root)
#
# The GPU machine (Python 3.12, x86_64, no registry) has torch, triton,
# transformers, grpcio, protobuf, numpy, pytest, hypothesis and matplotlib,
# but not xgrammar (structured output) nor grpcio-health-checking /
# grpcio-reflection (the server's health and reflection services). grpcio and
# protobuf travel too: our generated code needs grpcio >= 1.85.1 and protobuf
# >= 7.35.1, newer than the machine may hold. The versions are the ones this
# project is tested with. The project's own wheel (pip wheel --no-deps .)
# gives the machine its entry points and metadata; gpu_check.py imports the
# working tree itself.
#
# FlashInfer is left out: flashinfer-python 0.7.2.post1 alone is a 59 MiB
# wheel (2026-11), and it needs cuda-python, nvidia-cutlass-dsl and the cuDNN
# frontend besides: it cannot fit the 64 MiB carry (no backend of ours calls
# it yet). GPU_WHEELS_FLASHINFER=1 adds it anyway (the size check then fails).
#
# Prints the one line to put at the start of the device command.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-.gpu_wheels}
case $DIR in /*) ;; *) DIR=$ROOT/$DIR ;; esac
LIMIT_MIB=${GPU_WHEELS_LIMIT_MIB:-56} # the working tree (a few MiB) travels too
PYTHON=${PYTHON:-python3}

WHEELS=(
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
)
if [[ ${GPU_WHEELS_FLASHINFER:-0} == 1 ]]; then WHEELS+=(flashinfer-python); fi

PLATFORMS=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
  manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done

rm -rf "$DIR"
mkdir -p "$DIR"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" --platform any \
  -d "$DIR" "${WHEELS[@]}"
# Our own wheel: pure Python, built from this tree with the build tools at hand.
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w "$DIR" "$ROOT"

# Whatever travels must stay out of git (and .gitignore says so).
if ! git -C "$ROOT" check-ignore -q "$DIR/x.whl" 2>/dev/null; then
  echo "gpu_wheels.sh: $DIR is not git-ignored; it would be committed" >&2
  exit 1
fi

echo "wheels in $DIR:"
ls -l "$DIR" | awk 'NR > 1 { printf "  %8.2f MiB  %s\n", $5 / 1048576, $9 }'
TOTAL=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
printf 'total %.2f MiB (limit %d MiB)\n' "$(echo "$TOTAL / 1048576" | bc -l)" "$LIMIT_MIB"
if ((TOTAL > LIMIT_MIB * 1048576)); then
  echo "gpu_wheels.sh: the wheels exceed ${LIMIT_MIB} MiB: they and the tree must fit 64 MiB" >&2
  exit 1
fi

REL=${DIR#"$ROOT"/}
echo
echo "device command prefix (carry [\"$REL\"]):"
echo "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade" \
  "--target /tmp/site $REL/*.whl && export PYTHONPATH=/tmp/site || exit 1;"
