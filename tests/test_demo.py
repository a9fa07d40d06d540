"""`quantizer demo --json` on the bundled model at one size: every pack is verified, the methods spend
the same bytes, and our allocator's pack costs less KL than uniform K at those bytes."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from quantizer.cli import main

KEYS = {"bpw", "method", "achieved_bpw", "bytes", "ppl", "kl", "kl_stderr", "top1", "nll_delta",
        "nll_delta_stderr", "verified", "fits_1_spark", "weights_gib"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = io.StringIO()
    work = tmp_path_factory.mktemp("demo")
    with contextlib.redirect_stdout(out):
        assert main(["demo", "--json", "--sizes", "2.5", "--methods", "uniform,ours-stock", "--eval-rows", "4",
                     "--work", str(work)]) == 0
    return {r["method"]: r for r in json.loads(out.getvalue())}


def test_rows_name_every_method_with_size_fit_and_quality(rows):
    assert set(rows) == {"uniform", "ours-stock"}
    for r in rows.values():
        assert set(r) == KEYS and r["bpw"] == 2.5 and r["verified"] and r["fits_1_spark"]
        assert 0 < r["kl"] and 0 < r["top1"] < 1 and r["ppl"] > 1 and r["bytes"] > 0
        assert r["achieved_bpw"] <= 2.5 + 1e-9


def test_ours_costs_less_kl_than_uniform_at_equal_bytes(rows):
    ours, uniform = rows["ours-stock"], rows["uniform"]
    assert abs(ours["bytes"] - uniform["bytes"]) <= 0.01 * uniform["bytes"]
    assert ours["kl"] < uniform["kl"]


def test_unknown_method_and_empty_evaluation_are_user_errors(capsys):
    assert main(["demo", "--methods", "uniform,best"]) == 2
    assert "unknown method(s) best" in capsys.readouterr().err
    assert main(["demo", "--eval-rows", "0"]) == 2
    assert "--eval-rows 0: rows must be at least 1" in capsys.readouterr().err
