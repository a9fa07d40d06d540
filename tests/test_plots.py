"""The `--plot FILE` figures of fit and plan: a readable PNG of the figure's size whose bars and
cells are the numbers the command computed; and what a missing plots extra or a bad path gets.
(demo's figure is tested with the demo run in test_demo.py; the notebook in test_notebook.py.)"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from PIL import Image

from quantizer.checkpoint.config import ModelConfig
from quantizer.cli import main
from quantizer.contract.plan import Plan
from quantizer.model.targets import targets
from quantizer.plots import DPI, save_figure
from quantizer.shipped import model_config_path, shipped

TINY = "tiny-v41"


def spy_figures(monkeypatch, cli_module: str) -> list:
    """The figures a CLI module hands to save_figure (still saved)."""
    drawn = []

    def spy(fig, path):
        drawn.append(fig)
        return save_figure(fig, path)

    monkeypatch.setattr(f"{cli_module}.save_figure", spy)
    return drawn


def assert_readable_png(path, fig) -> None:
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        w, h = fig.get_size_inches() * DPI
        assert img.format == "PNG" and img.size == (round(w), round(h))
        pixels = np.asarray(img.convert("RGB"), dtype=float)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # drawn on, not a blank canvas


def test_fit_plot_stacks_every_term_of_each_rank_to_its_visible_memory(tmp_path, monkeypatch, capsys):
    drawn = spy_figures(monkeypatch, "quantizer.commands.fit")
    png = tmp_path / "fit.png"
    recipe = shipped("configs", "recipes", "2.5.yaml")
    assert main(["fit", "--model-config", "deepseek-v4.1-flash", "--recipe", str(recipe), "--sparks", "2",
                 "--context", "256K", "--json", "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    (fig,) = drawn
    assert_readable_png(png, fig)
    ax = fig.axes[0]
    ranks = report["ranks"]
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
    assert all(len(h) == len(ranks) == 2 for h in bars.values())
    assert bars["weights: routed_expert"] == pytest.approx([m["weights_by_class_gib"]["routed_expert"] for m in ranks])
    assert bars["KV pool"] == pytest.approx([m["kv_pool_gib"] for m in ranks])
    assert bars["free"] == pytest.approx([m["free_gib"] for m in ranks])
    assert "SWA rings" not in bars  # zero on every rank: no bar
    for i, m in enumerate(ranks):  # it fits: the stack is exactly what the rank can see
        assert sum(h[i] for h in bars.values()) == pytest.approx(m["visible_gib"])
        weights = sum(h[i] for n, h in bars.items() if "weights" in n)
        assert weights == pytest.approx(m["weights_gib"])
    assert "largest context" in ax.get_title()


def test_fit_plot_of_a_pack_that_does_not_fit_stacks_past_visible(tmp_path, monkeypatch):
    drawn = spy_figures(monkeypatch, "quantizer.commands.fit")
    png = tmp_path / "fit.png"
    recipe = shipped("configs", "recipes", "2.9.yaml")
    assert main(["fit", "--model-config", "deepseek-v4.1-flash", "--recipe", str(recipe), "--sparks", "1",
                 "--plot", str(png)]) == 1
    (fig,) = drawn
    assert_readable_png(png, fig)
    bars = {c.get_label(): c.patches[0].get_height() for c in fig.axes[0].containers}
    assert "free" not in bars and sum(bars.values()) > 121.6  # short: stacked past the visible memory
    assert "does not fit" in fig.axes[0].get_title() and "no context fits" in fig.axes[0].get_title()


def test_plan_plot_draws_each_plans_k_per_layer_and_projection(tmp_path, monkeypatch):
    drawn = spy_figures(monkeypatch, "quantizer.commands.plan")
    other, png = tmp_path / "other.json", tmp_path / "k.png"
    assert main(["plan", "--model-config", TINY, "--bpw", "4", "--loader", "exllamav3", "--out", str(other)]) == 0
    assert main(["plan", "--model-config", TINY, "--bpw", "2.5", "--loader", "exllamav3", "--plot", str(png),
                 "--plot-against", str(other)]) == 0
    (fig,) = drawn
    assert_readable_png(png, fig)
    cfg = ModelConfig.from_file(model_config_path(f"{TINY}.json"))
    trunk = [t for t in targets(cfg) if t.budgeted and t.layer is not None]
    rows = list(dict.fromkeys(f"{t.group} {t.proj}" for t in trunk))
    layers = sorted({t.layer for t in trunk})
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 2 and "2.5" in panels[0].get_title() and "4" in panels[1].get_title()
    grids = [ax.images[0].get_array() for ax in panels]
    assert all(g.shape == (len(rows), len(layers)) for g in grids)
    for g, plan in zip(grids, (None, Plan.load(other))):
        for t in trunk:
            if t.expert in (None, 0) and plan is not None:
                assert g[rows.index(f"{t.group} {t.proj}"), layers.index(t.layer)] == plan.k[t.key]
    assert np.nanmean(grids[0]) < np.nanmean(grids[1])  # the 2.5 bpw plan spends less than the 4 bpw one
    assert [tick.get_text() for tick in panels[0].get_yticklabels()] == rows


@pytest.mark.parametrize("argv", [
    ["fit", "--model-config", "deepseek-v4.1-flash", "--bpw", "2.9"],
    ["plan", "--model-config", TINY, "--bpw", "3"],
    ["demo"],  # refused before the minutes of work, not after
])
def test_missing_plots_extra_is_one_line_naming_it(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what find_spec sees when it is not installed
    png = tmp_path / "x.png"
    assert main(argv + ["--plot", str(png)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "pip install 'quantizer[plots]'" in captured.err
    assert captured.out == "" and not png.exists()


def test_bad_plot_paths_are_user_errors(tmp_path, capsys):
    assert main(["plan", "--model-config", TINY, "--bpw", "3", "--plot", str(tmp_path / "k.txt")]) == 2
    assert "name a .png, .svg or .pdf file" in capsys.readouterr().err
    assert main(["fit", "--model-config", TINY, "--bpw", "3", "--plot", str(tmp_path / "no" / "k.png")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["plan", "--model-config", TINY, "--bpw", "3", "--plot-against", str(tmp_path / "p.json")]) == 2
    assert "--plot-against draws into --plot" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
