"""The tune stage: after encoding, with every EXL3 code fixed, fit each block's `suh`/`svh` vectors so
the quantized block reproduces the native block's outputs on calibration rows (docs/tuning.md)."""
