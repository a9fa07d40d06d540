#!/usr/bin/env bash
# Writes docs/example-card.md: the card `quantizer build` and `ppl --record` write for a pack of the
# bundled small model (calibrated uniform 3 bpw), run in a scratch directory so the card names no
# machine path. Run from the repository root: bash docs/example-card.sh
set -euo pipefail
repo=$(pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cp -r quantizer/small_model "$scratch/small-v41"
cd "$scratch"
python -m quantizer build small-v41 --bpw 3 --method uniform --calib-rows 16 --calib-cols 512 --out small-v41-3.0bpw
python -m quantizer ppl small-v41-3.0bpw --against small-v41 --text "$repo/calibration/heldout.jsonl" --rows 8 --cols 512 --record
python -m quantizer verify small-v41-3.0bpw
cp small-v41-3.0bpw/README.md "$repo/docs/example-card.md"
