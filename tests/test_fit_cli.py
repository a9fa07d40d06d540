"""fit from a pack directory (headers only) and the `quantizer fit` / `quantizer plan` commands:
tables, --json, --explain, exit codes 0 (fits), 1 (does not fit), 2 (bad input)."""

from __future__ import annotations

import json
import shutil

import pytest
from one_line import one_line
from safetensors_check import assert_safetensors_agree

from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.safetensors_file import PlannedTensor, read_header, write_safetensors
from quantizer.cli import build_parser, main
from quantizer.contract.pack_spec import pack_spec
from quantizer.contract.plan import Plan
from quantizer.errors import UserError
from quantizer.exl3 import leaf_layout
from quantizer.fit import fit_table
from quantizer.pack.fit_table import pack_fit_table
from quantizer.fit.memory import MARGIN_GIB, FitTarget, fit
from quantizer.fit.stored import stored_from_pack
from quantizer.model.targets import classified_layout, stored_parts, target_map
from quantizer.pack.manifest import MANIFEST_NAME, Manifest
from quantizer.plan.uniform import uniform_plan
from quantizer.shipped import model_config_path

TINY = model_config_path("tiny-v41.json")


def write_fake_pack(out, cfg: ModelConfig, plan: Plan):
    """A pack as issue 4 lays it out (shards, index, config.json with quantization_config), with the
    tensor data left as holes: fit reads headers only."""
    tmap = target_map(cfg)
    tensors = []
    for spec, _ in classified_layout(cfg):
        key = spec.name.rsplit(".", 1)[0]
        k = plan.k.get(key) if key in tmap else None
        if k is None:
            tensors.append(PlannedTensor(spec.name, spec.dtype, spec.shape, None))
        elif spec.name.endswith(".weight"):
            t = tmap[key]
            for part, rows in stored_parts(cfg, t, k):  # a quantized wo_a as its o_groups slices
                out_features = rows[1] - rows[0] if rows else t.out_features
                tensors += [PlannedTensor(part + suffix, dtype, shape, None) for suffix, shape, dtype, _
                            in leaf_layout(t.in_features, out_features, k, plan.codebook)]
    out.mkdir()
    half = len(tensors) // 2
    weight_map = {}
    for i, part in enumerate((tensors[:half], tensors[half:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        write_safetensors(out / name, part, align=64)
        weight_map.update({t.name: name for t in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads(TINY.read_text())
    config["quantization_config"] = {"quant_method": "exl3", "bits": 3, "bpw": plan.achieved_bpw,
                                     "head_bits": 6, "codebook": plan.codebook}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    cfg = ModelConfig.from_file(TINY)
    plan = uniform_plan(cfg, 2.5)
    return write_fake_pack(tmp_path_factory.mktemp("pack") / "tiny-2.5", cfg, plan), cfg, plan


def test_pack_headers_give_the_plans_tensors(tiny_pack):
    pack, cfg, plan = tiny_pack
    assert any(n.startswith("__align_pad__.") for n in read_header(next(pack.glob("*.safetensors"))).tensors)
    pack_cfg, stored = stored_from_pack(pack)
    assert pack_cfg.num_layers == cfg.num_layers
    want = sorted((t.name, t.nbytes, t.storage, t.K) for t in pack_spec(cfg, plan).tensors)
    assert sorted((t.name, t.nbytes, t.storage, t.K) for t in stored) == want
    from_headers = {t.name[: -len(".trellis")].split(".slice.")[0]: t.K for t in stored if t.name.endswith(".trellis")}
    assert from_headers == {key: k for key, k in plan.k.items() if k is not None}
    assert len(set(from_headers.values())) >= 3  # K read from trellis.shape[-1] / 16, half rates included
    for sparks in (1, 2, 4):
        a = fit(pack_cfg, stored, FitTarget(sparks, 4096, 1, "vllm-exl3"))
        b = fit(cfg, pack_spec(cfg, plan).tensors, FitTarget(sparks, 4096, 1, "vllm-exl3"))
        assert [m.weights_gib for m in a.ranks] == [m.weights_gib for m in b.ranks]


def test_pack_missing_svh_is_reported(tiny_pack, tmp_path):
    pack, _, _ = tiny_pack
    broken = tmp_path / "broken"
    shutil.copytree(pack, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = broken / index["weight_map"]["head.svh"]
    kept = [PlannedTensor(e.name, e.dtype, e.shape, None) for e in read_header(shard).tensors.values()
            if e.name != "head.svh" and not e.name.startswith("__align_pad__.")]
    write_safetensors(shard, kept, align=64)
    del index["weight_map"]["head.svh"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="head.trellis has no head.suh/.svh"):
        stored_from_pack(broken)


def test_cli_on_a_pack_json_and_explain(tiny_pack, capsys):
    pack, _, _ = tiny_pack
    assert main(["fit", str(pack), "--sparks", "4", "--context", "64K", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["ranks"]) == 4 and all(r["weights_gib"] > 0 for r in data["ranks"]) and data["fits"]
    assert data["context"] == 65_536
    assert main(["fit", str(pack), "--sparks", "2", "--loader", "tensorfold", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "FITS:" in out and "weights by class" in out and out.count("source:") >= 8
    assert "engine tensorfold" in out and out.count("native") == 1  # the design floor: under --explain, one line
    assert "lower bound, not an engine a pack runs in: under DeepSeek's design floor (native" in out


@pytest.mark.slow
def test_cli_does_not_fit_exits_1_with_the_verdict(capsys):
    code = main(["fit", "--model-config", "deepseek-v4.1-flash", "--bpw", "2.9", "--sparks", "1",
                 "--loader", "vllm-exl3", "--context", "1M"])
    out = capsys.readouterr().out
    assert code == 1
    verdict = [line for line in out.splitlines() if line.startswith("DOES NOT FIT")]
    assert len(verdict) == 1 and "short by" in verdict[0] and "fits 4 Sparks" in verdict[0]
    assert "no bpw >= 1.0 fits here" in verdict[0]  # vllm-exl3 keeps all but the routed experts in source form


def test_cli_bad_inputs_exit_2(tmp_path, capsys):
    assert main(["fit", "--model-config", str(TINY), "--bpw", "3", "--sparks", "2", "--loader", "exllamav3"]) == 2
    assert "--sparks 2: the exllamav3 engine runs on 1 Spark(s) only" in capsys.readouterr().err
    assert main(["fit", "--model-config", "no-such-model", "--bpw", "3"]) == 2
    assert "no shipped shape" in capsys.readouterr().err
    assert main(["fit", "--model-config", str(TINY)]) == 2
    assert "--recipe" in capsys.readouterr().err
    assert main(["fit", str(tmp_path)]) == 2  # not a pack
    capsys.readouterr()


def test_plan_cli_writes_plan_and_recipe(tmp_path, capsys):
    assert main(["plan", "--model-config", str(TINY), "--bpw", "2.5", "--out", str(tmp_path / "p.json"),
                 "--recipe-out", str(tmp_path / "r.yaml"), "--drafter-bits", "4", "--loader", "exllamav3"]) == 0
    out = capsys.readouterr().out
    assert "routed experts by layer: L0" in out and "without Engram tables" in out
    plan = Plan.load(tmp_path / "p.json")
    assert plan.k["mtp.0.ffn.experts.0.w1"] == 4.0
    assert main(["fit", "--model-config", str(TINY), "--plan", str(tmp_path / "p.json"), "--sparks", "1"]) == 0
    assert main(["fit", "--model-config", str(TINY), "--recipe", str(tmp_path / "r.yaml"), "--sparks", "1"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "9"])
@pytest.mark.parametrize("command", [["plan", "--model-config", "deepseek-v4.1-flash", "--bpw"],
                                     ["fit", "--model-config", "deepseek-v4.1-flash", "--bpw"],
                                     ["demo", "--sizes"]])
def test_a_bpw_that_is_no_rate_exits_2_before_any_work(capsys, command, value):
    assert main([*command, value]) == 2
    err = capsys.readouterr().err
    assert f"{command[-1]} {float(value):g}: must be a number above 0 and at most 8" in err and "Traceback" not in err



def test_fit_of_a_plan_charges_the_engine_its_loader_profile_runs_in(tmp_path, capsys):
    """A tensorfold plan is fitted against TensorFold's runtime and KV, not the hardware file's default
    engine (vLLM); --loader (or old --engine) sizes it in vLLM's memory model instead, with what the plan
    breaks of that profile as one finding, and the memory verdict's exit code."""
    assert main(["plan", "--model-config", str(TINY), "--bpw", "3", "--loader", "tensorfold",
                 "--out", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    fit_plan = ["fit", "--model-config", str(TINY), "--plan", str(tmp_path / "p.json"), "--sparks", "2", "--json"]
    assert main(fit_plan) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["engine"] == "tensorfold" and own["findings"] is None
    for other in (["--loader", "vllm-exl3"], ["--engine", "vllm"]):
        assert main(fit_plan + other) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["engine"] == "vllm-exl3" and data["findings"]["profile"] == "vllm-exl3"
        assert data["findings"]["by_rule"]["layout"] > 0 and data["kv_bytes_per_token"] != own["kv_bytes_per_token"]


def test_the_manifest_holds_no_fit_verdict_and_old_ones_are_ignored(tiny_v41, fp16_plan, tmp_path):
    pack = tmp_path / "pack"
    assert main(["build", str(tiny_v41), "--plan", str(fp16_plan), "--out", str(pack), "--no-calibrate"]) == 0
    assert_safetensors_agree(pack)
    data = json.loads((pack / MANIFEST_NAME).read_text())
    assert "fit" not in data
    cfg, stored = stored_from_pack(pack)
    engine = Plan.load(fp16_plan).profile.fit_engine
    table = pack_fit_table(pack)
    assert table.pop("planned_context") is None and "planned" not in table  # no launch.env: no planned context
    decode = [row.pop("decode") for engines in table["topologies"].values() for row in engines.values()]
    assert table == fit_table(cfg, stored, context=cfg.max_position_embeddings, engine=engine)
    assert all(d["tokens_per_second"] > 0 and d["launches_per_token"] > 0 for d in decode)  # and what a token costs
    data["fit"] = {"topologies": {"1": {"vllm": {"fits": True}}}}  # what an older version wrote
    assert Manifest.from_dict(data, "old manifest").shards == Manifest.load(pack).shards


@pytest.mark.parametrize("command", [["fit", "--model-config", "deepseek-v4.1-flash", "--bpw", "2.9"],
                                     ["plan", "--model-config", "deepseek-v4.1-flash", "--sparks", "2"],
                                     ["build", "SRC", "--sparks", "2", "--out", "PACK"]])
def test_the_margin_is_gib_at_least_zero_on_every_command_that_fits(command, capsys):
    for value in ("-1", "a lot"):
        with pytest.raises(SystemExit) as stop:
            build_parser().parse_args(command + ["--margin", value])
        assert stop.value.code == 2
        one_line(capsys.readouterr().err, f"argument --margin: {value!r}: GiB as a number >= 0")
    assert build_parser().parse_args(command).margin == MARGIN_GIB == 1.0


def test_fit_json_states_the_margin_and_the_verdict_names_it_inside(capsys):
    args = ["fit", "--model-config", "deepseek-v4.1-flash", "--bpw", "2.5", "--sparks", "2", "--loader", "vllm-exl3",
            "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    free = min(r["free_gib"] for r in report["ranks"])
    assert report["margin_gib"] == 1.0 and report["fits"] and free > 1.0 and "margin" not in report["verdict"]
    assert main(args + ["--margin", f"{free + 0.5:.3f}"]) == 0
    assert f"less than the {free + 0.5:.3f}".rstrip("0") in json.loads(capsys.readouterr().out)["verdict"]


@pytest.mark.slow
def test_cold_share_leaves_the_least_routed_experts_in_the_page_cache_where_the_plan_would_not_fit(tmp_path, capsys):
    """fit --cold-share with the calibration's routing sizes a plan as `plan` and `build` place it (issue 60: the
    flag was accepted and ignored): the real model at 1.9 bpw with --overlay does not fit one Spark at 512K with
    every expert copied, and fits with 5% of the routed tokens left to cold experts (docs/guide.md, one Spark)."""
    from quantizer.plan.sensitivity import synthetic_summary

    summary = synthetic_summary(ModelConfig.from_file(model_config_path("deepseek-v4.1-flash.json")))
    summary.save(tmp_path / "summary.json")
    fit_cmd = ["fit", "--model-config", "deepseek-v4.1-flash", "--bpw", "1.9", "--overlay", "--loader", "exllamav3-v41",
               "--sparks", "1", "--context", "512K", "--json"]
    assert main(fit_cmd) == 1
    hot = json.loads(capsys.readouterr().out)
    assert main([*fit_cmd, "--cold-share", "0.05", "--calibration", str(tmp_path / "summary.json")]) == 0
    captured = capsys.readouterr()
    cold = json.loads(captured.out)
    moved = hot["ranks"][0]["weights_gib"] - cold["ranks"][0]["weights_gib"]
    assert moved > hot["short_gib"] and cold["ranks"][0]["mapped_gib"] == pytest.approx(hot["ranks"][0]["mapped_gib"] + moved)
    [line] = [line for line in captured.err.splitlines() if line.startswith("cold experts: ")]  # stdout stays JSON
    assert int(line.split()[2]) > 0 and "served from the mapped file" in line and "% of the calibration's routed" in line


def test_cold_share_is_refused_where_it_would_change_nothing(tiny_pack, tmp_path, capsys):
    """Where no expert can be left cold by the flag (a pack or checkpoint is sized as stored, a one-Spark pack's
    launch.env fixes its cold experts, an engine that copies every weight) --cold-share is one line and exit 2."""
    from quantizer.fit.launch import Launch

    pack, _, _ = tiny_pack
    summary = tmp_path / "summary.json"
    one_spark = ["--loader", "exllamav3-v41", "--sparks", "1", "--cold-share", "0.05"]
    launched = tmp_path / "launched"
    shutil.copytree(pack, launched)
    (launched / "launch.env").write_text(Launch(drafter=False).render())
    cases = [
        ([str(pack), *one_spark, "--calibration", str(summary)], "chooses the cold experts of a plan"),
        ([str(launched), *one_spark, "--calibration", str(summary)], "its launch.env fixes its cold experts"),
        (["--model-config", str(TINY), "--bpw", "2.5", "--sparks", "2", "--loader", "vllm-exl3", "--cold-share", "0.05"],
         "the vllm-exl3 engine copies every weight into GPU memory"),
        (["--model-config", str(TINY), "--bpw", "1.6", *one_spark], "give --calibration WORK"),
        (["--model-config", str(TINY), "--bpw", "1.6", "--loader", "exllamav3-v41", "--sparks", "1",
          "--calibration", str(summary)], "add --cold-share S"),
        (["--model-config", str(TINY), "--bpw", "1.6", "--loader", "exllamav3-v41", "--sparks", "1", "--cold-share", "1"],
         "at least 0 and below 1"),
    ]
    for args, message in cases:
        assert main(["fit", *args]) == 2, args
        one_line(capsys.readouterr().err, message)
