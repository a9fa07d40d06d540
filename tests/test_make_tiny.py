"""make-tiny: refuses what it cannot do safely."""

from __future__ import annotations

import pytest
from one_line import one_line

from quantizer.cli import main
from quantizer.errors import UserError
from quantizer.tiny.make import make_tiny


def test_full_size_needs_sparse(tmp_path):
    with pytest.raises(UserError, match="add --sparse"):
        make_tiny(tmp_path / "out", "v41", full_size=True)


def test_refuses_a_non_empty_directory_and_leaves_it_alone(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        make_tiny(tmp_path, "v41")
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_seed_makes_it_reproducible(tmp_path):
    a = make_tiny(tmp_path / "a", "v4", seed=3)
    b = make_tiny(tmp_path / "b", "v4", seed=3)
    c = make_tiny(tmp_path / "c", "v4", seed=4)
    for shard in sorted(a.glob("*.safetensors")):
        assert shard.read_bytes() == (b / shard.name).read_bytes()
    assert any(s.read_bytes() != (c / s.name).read_bytes() for s in a.glob("*.safetensors"))


def test_v4_full_size_layout(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "v4"), "--arch", "v4", "--full-size", "--sparse"]) == 0
    assert main(["inspect", str(tmp_path / "v4"), "--json"]) == 0
    import json

    inv = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert (inv["tensors"], inv["bytes"]) == (72_317, 166_878_536_440)


def test_v4_drafter_names_and_tokenizer_are_what_exllamav3_reads(tiny_v4, tiny_v41):
    # exllamav3's V4 MTP reads the Markov head as an Embedding and a Linear (`.weight` leaves), and its
    # converter needs the model directory's tokenizer.json.
    import json

    from quantizer.textdata import shipped_tokenizer_path

    names = json.loads((tiny_v4 / "model.safetensors.index.json").read_text())["weight_map"]
    last = "mtp.2.markov_head"
    assert {f"{last}.markov_w1.weight", f"{last}.markov_w2.weight"} <= set(names)
    assert not any(n.endswith(("markov_w1", "markov_w2")) for n in names)
    assert (tiny_v4 / "tokenizer.json").read_bytes() == shipped_tokenizer_path().read_bytes()
    assert not (tiny_v41 / "tokenizer.json").exists()  # its Engram hash runs on raw ids unless --tokenizer


def test_a_users_partial_directory_is_kept_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    mine = tmp_path / "ck.partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    out = make_tiny(tmp_path / "ck", "v4")
    assert (mine / "notes.txt").read_text() == "mine" and (out / "config.json").exists()
    assert oct(out.stat().st_mode & 0o777) == "0o755"

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("quantizer.tiny.native_writer.write_safetensors", full_disk)
    with pytest.raises(OSError):
        make_tiny(tmp_path / "other", "v4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.partial"]


def test_v41_tokenizer_sizes_the_engram_map_to_it_and_keeps_the_weights(tiny_v41, tmp_path, capsys):
    """make-tiny --tokenizer (issue 60): the shipped tokenizer.json, with engram_compressed_vocab_size set to the
    number of ids it normalises to, so the Engram hash the forward runs (and the fork's checks) accepts it; the
    tables and every weight are those of the checkpoint without it."""
    import json

    from quantizer.model.engram import compressed_token_map
    from quantizer.textdata import default_tokenizer, shipped_tokenizer_path

    assert main(["make-tiny", str(tmp_path / "ck"), "--arch", "v41", "--tokenizer"]) == 0
    out = tmp_path / "ck"
    assert (out / "tokenizer.json").read_bytes() == shipped_tokenizer_path().read_bytes()
    config, plain = (json.loads((root / "config.json").read_text())["text_config"] for root in (out, tiny_v41))
    assert config["engram_compressed_vocab_size"] == compressed_token_map(default_tokenizer())[1] < config["vocab_size"]
    assert {k: v for k, v in config.items() if k != "engram_compressed_vocab_size"} == \
        {k: v for k, v in plain.items() if k != "engram_compressed_vocab_size"}
    for shard in sorted(tiny_v41.glob("*.safetensors")):
        assert (out / shard.name).read_bytes() == shard.read_bytes()
    text = tmp_path / "a.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    capsys.readouterr()
    assert main(["ppl", str(out), "--text", str(text), "--rows", "1", "--cols", "32", "--json"]) == 0  # Engram on the map
    assert json.loads(capsys.readouterr().out)["tokens"] == 31


def test_tokenizer_is_refused_with_the_full_size_layout(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "ck"), "--full-size", "--sparse", "--tokenizer"]) == 2
    one_line(capsys.readouterr().err, "--tokenizer writes the tiny models' tokenizer")
    assert not (tmp_path / "ck").exists()


@pytest.mark.slow
def test_a_tokenizer_tiny_v41_builds_a_one_spark_pack_that_verifies(tmp_path, capsys):
    """The refusal of `build --loader exllamav3-v41` on a source without tokenizer.json (tests/test_one_spark.py)
    is answered by make-tiny --tokenizer: that checkpoint builds to a one-Spark pack, and verify --full is clean."""
    ck, pack = tmp_path / "ck", tmp_path / "pack"
    assert main(["make-tiny", str(ck), "--arch", "v41", "--tokenizer"]) == 0
    assert main(["build", str(ck), "--loader", "exllamav3-v41", "--bpw", "1.6", "--method", "uniform", "--no-calibrate",
                 "--work", str(tmp_path / "work"), "--out", str(pack)]) == 0
    assert (pack / "tokenizer.json").read_bytes() == (ck / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert main(["verify", str(pack), "--full"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("clean") and "loader exllamav3-v41" in out
