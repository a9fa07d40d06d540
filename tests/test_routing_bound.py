"""bench/routing_bound.py's closed-form router weight refit (it must recover the map from the pack's router
inputs to the native logits, and stay at the native weight where quantization did not move them), and its
measure of how nearly tied a router's k-th and (k+1)-th experts are."""

from __future__ import annotations

from pathlib import Path

import torch
from script_module import script_module

BENCH = Path(__file__).resolve().parents[1] / "bench" / "routing_bound.py"


def test_weight_refit_undoes_a_linear_change_of_the_router_inputs():
    g = torch.Generator().manual_seed(0)
    native_x, native_w = torch.randn(4096, 16, generator=g), torch.randn(8, 16, generator=g)
    mix = torch.eye(16) + 0.2 * torch.randn(16, 16, generator=g)  # what quantization did to the inputs
    pack_x = native_x @ mix
    with script_module(BENCH) as bench:
        w = bench.fit_linear(pack_x, native_x @ native_w.T, native_w, ridge=1e-6)
    assert torch.allclose(pack_x @ w.T, native_x @ native_w.T, atol=1e-3)
    assert not torch.allclose(w, native_w, atol=1e-2)  # a different weight does it, not the native one


def test_weight_refit_keeps_the_native_weight_where_the_inputs_did_not_move():
    g = torch.Generator().manual_seed(1)
    x, native_w = torch.randn(512, 16, generator=g), torch.randn(8, 16, generator=g)
    with script_module(BENCH) as bench:
        w = bench.fit_linear(x, x @ native_w.T, native_w)
    assert torch.allclose(w, native_w, atol=1e-4)


def test_selection_margin_is_the_gap_at_the_kth_expert_over_the_chosen_mean():
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    with script_module(BENCH) as bench:
        margin = bench.selection_margin(scores, k=2)
    assert torch.allclose(margin, torch.tensor([(3.0 - 2.0) / 3.5, 0.0]))  # a tie: any error swaps an expert
