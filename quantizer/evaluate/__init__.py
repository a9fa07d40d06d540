"""`quantizer eval`: lm-evaluation-harness tasks on a pack and its source, side by side.

harness.py (which imports lm_eval, the `eval` extra) holds the lm_eval model class over our reference
forward; paired.py compares the two models' per-document scores."""
