"""make-tiny: refuses what it cannot do safely."""

from __future__ import annotations

import pytest

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
    assert not (tiny_v41 / "tokenizer.json").exists()  # its Engram hash runs on raw ids


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
