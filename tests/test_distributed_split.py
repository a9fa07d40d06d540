"""How work is shared out among ranks, without starting any: every item goes to exactly one rank, the
same way on every rank; units are balanced by weights; calibration's sample quotas add up to the
total whatever the number of chunks."""

from __future__ import annotations

import pytest

from quantizer.calibrate.collect import quota
from quantizer.distributed import Ranks


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_units_are_spread_once_each_largest_first_onto_the_least_loaded_rank(world):
    weights = [5, 100, 7, 100, 3, 60, 60, 1, 40, 9]
    shares = [Ranks(rank, world).spread(weights) for rank in range(world)]
    assert sorted(i for share in shares for i in share) == list(range(len(weights)))
    loads = [sum(weights[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(weights)  # the greedy bound
    assert all(share == sorted(share) for share in shares)  # each rank works in plan order
    if world == 2:
        assert shares == [[1, 5, 8], [0, 2, 3, 4, 6, 7, 9]]  # loads 200 and 185


@pytest.mark.parametrize("n,world", [(5, 2), (2, 3), (32, 8), (1, 1)])
def test_row_chunks_go_in_contiguous_blocks_with_chunk_0_on_rank_0(n, world):
    blocks = [list(Ranks(rank, world).contiguous(n)) for rank in range(world)]
    assert [c for b in blocks for c in b] == list(range(n))
    assert n == 0 or blocks[0][:1] == [0]


@pytest.mark.parametrize("total,chunks", [(128, 1), (128, 3), (4096, 32), (5, 8)])
def test_sample_quotas_add_up_to_the_total(total, chunks):
    quotas = [quota(total, chunks, c) for c in range(chunks)]
    assert sum(quotas) == total and all(q >= 0 for q in quotas)
    assert quotas[0] == min(total, -(-total // chunks))
