"""bench/asymmetric_experts.py: the asymmetric target maps the quantized inputs to the native outputs (and
is the native weight where the inputs did not move), each expert linear's tokens are weighted as `build`'s
default weighting does, and an unknown variant or a negative damping is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from script_module import script_module

BENCH = Path(__file__).resolve().parents[1] / "bench" / "asymmetric_experts.py"


def test_the_asymmetric_target_maps_the_quantized_inputs_to_the_native_outputs():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2048, 16, generator=g), torch.randn(8, 16, generator=g)
    xq = x @ (torch.eye(16) + 0.2 * torch.randn(16, 16, generator=g))  # what quantization before did to them
    omega = torch.rand(2048, generator=g) + 0.5
    with script_module(BENCH) as bench:
        a = bench.asymmetric_target(w, x, xq, omega, damp=1e-6)
        same = bench.asymmetric_target(w, x, x, omega, damp=0.01)
    assert torch.allclose(xq @ a.T, x @ w.T, atol=1e-3)
    assert not torch.allclose(a, w, atol=1e-2)
    assert torch.allclose(same, w, atol=1e-4)


def test_gate_and_up_read_every_token_and_down_its_routed_tokens_plus_the_prior():
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [3, 1]])
    gates = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.9, 0.1], [0.7, 0.3]])
    with script_module(BENCH) as bench:
        up = bench.token_weights("w3", 0, ids, gates)
        down = bench.token_weights("w2", 0, ids, gates)
        prior = bench.PRIOR_TOKENS * float((gates ** 2).mean()) / 4
    assert torch.equal(up, torch.ones(4))
    assert torch.allclose(down, torch.tensor([0.36, 0.0, 0.01, 0.0]) + prior)


@pytest.mark.parametrize("argv, needle", [
    (["pack", "--variants", "native,gptq"], "unknown gptq"),
    (["pack", "--damp", "-1"], "--damp -1.0: must be 0 or more"),
])
def test_a_wrong_value_is_refused(capsys, argv, needle):
    with script_module(BENCH) as bench, pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert stop.value.code == 2
    assert needle in capsys.readouterr().err
