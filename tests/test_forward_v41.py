"""The V4.1 reference forward on the tiny V4.1 checkpoint (no external reference runs V4.1):
finiteness, native names, causality, hooks, Engram, and the CSA2 sharing (Reuse / Reindex)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.source import Checkpoint
from quantizer.model.attention import attend, query_chunk
from quantizer.model.compression import candidate_mask, visibility_mask, visible_counts
from quantizer.model.engram import compressed_token_map, engram_primes
from quantizer.model.hooks import ForwardHooks
from quantizer.model.layout import native_layout
from quantizer.model.transformer import DeepseekModel, init_parameters
from quantizer.shipped import model_config_path, shipped

LENGTH = 200


@pytest.fixture(scope="module")
def checkpoint(tiny_v41):
    return Checkpoint.open(tiny_v41)


@pytest.fixture(scope="module")
def model(checkpoint):
    return DeepseekModel.from_checkpoint(checkpoint)


@pytest.fixture(scope="module")
def tokens(checkpoint):
    return torch.randint(3, checkpoint.config.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


def _run_blocks(model, tokens, upto=None, hooks=None):
    streams, state = model.start(tokens)
    for block in model.layers[:upto]:
        streams = block(streams, state, model.hasher, hooks)
    return streams, state


def test_logits_are_finite(logits, checkpoint):
    assert logits.shape == (2, LENGTH, checkpoint.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1


def test_state_dict_holds_every_native_tensor(model, checkpoint):
    state = model.state_dict()
    expected = {s.name for s in native_layout(checkpoint.config)
                if not s.name.endswith(".scale") and not s.name.startswith("mtp.")}
    assert set(state) == expected
    for name in expected:
        assert torch.equal(state[name], checkpoint.weight(name, state[name].dtype)), name


def test_query_chunking_and_key_padding_do_not_change_attention():
    """A whole-model comparison would be chaotic (1e-7 differences flip routing in a random tiny
    model), so the chunked attention core is compared directly."""
    gen = torch.Generator().manual_seed(0)
    B, S, H, hd, n, window = 2, 90, 4, 32, 30, 8
    q, kv, entries = torch.randn(B, S, H, hd, generator=gen), torch.randn(B, S, hd, generator=gen), torch.randn(
        B, n, hd, generator=gen)
    chosen = torch.rand(B, S, n, generator=gen) < 0.3

    def mask(c0, c1):
        return chosen[:, c0:c1] & visibility_mask(visible_counts(c0, c1, 3, q.device), n)[None]

    sinks = torch.randn(H, generator=gen)
    whole = attend(q, kv, entries, mask, sinks, window, budget=1 << 30)
    chunked = attend(q, kv, entries, mask, sinks, window, budget=B * H * 7 * (7 + window + n))
    assert query_chunk(B, H, S, window, n, B * H * 7 * (7 + window + n)) == 7
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)
    # the masked zero keys CUDA pads each chunk with change nothing
    padded = attend(q, kv, entries, mask, sinks, window, budget=B * H * 7 * (7 + window + n), align=64)
    torch.testing.assert_close(padded, chunked, rtol=0, atol=1e-6)


def test_later_tokens_do_not_change_earlier_logits(model, tokens, logits):
    changed = tokens.clone()
    changed[:, 150:] = (changed[:, 150:] + 17) % model.cfg.vocab_size
    with torch.no_grad():
        out = model(changed)
    torch.testing.assert_close(out[:, :150], logits[:, :150], rtol=0, atol=1e-5)
    assert (out[:, 150:] - logits[:, 150:]).abs().max() > 1e-2


@pytest.mark.parametrize("model_name", ["small_model", "small_model_v4"])
def test_a_rows_logits_do_not_depend_on_its_length(model_name):
    """The trained bundled models score many compressed entries exactly 0 (the indexer's ReLU), so the
    top-k tie-break decides; it must not change with how many entries later tokens add (it did: a
    96-token prefix of a 160-token row differed by up to 3.6 in its logits)."""
    ck = Checkpoint.open(shipped(model_name))
    model = DeepseekModel.from_checkpoint(ck)
    row = torch.randint(5, ck.config.vocab_size - 100, (1, 160), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(row)
        for length in (48, 96):
            torch.testing.assert_close(model(row[:, :length]), whole[:, :length], rtol=0, atol=1e-4)


def test_compressed_attention_reaches_beyond_every_window(model, tokens, logits):
    """Sliding windows of 8 over 10 layers reach back < 80 tokens; a change 190 tokens back still
    shows, so compressed entries (kv sources, Reuse and Reindex layers) carry it."""
    changed = tokens.clone()
    changed[:, 2] = (changed[:, 2] + 5) % model.cfg.vocab_size
    with torch.no_grad():
        out = model(changed)
    assert model.cfg.sliding_window * model.cfg.num_layers < 190
    assert (out[:, 192:] - logits[:, 192:]).abs().max() > 1e-4


def test_reuse_layer_attends_to_its_source_entries(model, tokens):
    cfg = model.cfg
    reuse = next(L for L in range(cfg.num_layers) if cfg.ratio(L) and not cfg.is_index_source(L))
    source = cfg.kv_source_for(reuse)
    with torch.no_grad():
        streams, state = _run_blocks(model, tokens, upto=reuse)
        block = model.layers[reuse]
        before = block(streams, dataclasses.replace(state, compressed=dict(state.compressed)), model.hasher)
        entries = state.compressed[source]
        altered = dict(state.compressed)
        altered[source] = dataclasses.replace(entries, entries=entries.entries * 3.0)
        after = block(streams, dataclasses.replace(state, compressed=altered), model.hasher)
    assert not hasattr(block.attn.compressor, "wkv") and block.attn.indexer is None
    assert (after[:, 100:] - before[:, 100:]).abs().max() > 1e-4


def test_reindex_layer_selects_inside_candidate_blocks(model, tokens):
    cfg = model.cfg
    reindex = next(L for L in range(cfg.num_layers)
                   if cfg.is_index_source(L) and L > cfg.candidate_source_layer_id)
    with torch.no_grad():
        _, state = _run_blocks(model, tokens)
    chosen = state.selections[reindex]  # [B, S, k]
    n = state.compressed[cfg.kv_source_for(reindex)].entries.shape[1]
    allowed = candidate_mask(state.candidates, cfg.candidate_block_size, n)
    valid = chosen >= 0
    assert valid.any()
    assert allowed.gather(-1, chosen.clamp_min(0))[valid].all()
    # the candidate blocks are a strict subset of what late queries could see
    assert allowed[:, -1].sum() < n


def test_hooks_see_every_quantizable_linear_and_change_nothing(model, tokens, logits):
    seen: dict[str, torch.Size] = {}
    routes = []

    def linear_input(name, x):
        seen[name] = x.shape

    hooks = ForwardHooks(linear_input=linear_input, routing=routes.append)
    with torch.no_grad():
        out = model(tokens, hooks)
    assert torch.equal(out, logits)
    quantizable = {s.name for s in native_layout(model.cfg)
                   if s.dtype in ("F8_E4M3", "I8") and not s.name.startswith("mtp.")
                   and not s.name.endswith("engram.embed.weight")}
    assert quantizable <= set(seen), sorted(quantizable - set(seen))[:5]
    for name, shape in seen.items():
        assert shape[-1] == model.state_dict()[name].shape[1], name
    assert [r.layer for r in routes] == [f"layers.{L}" for L in range(model.cfg.num_layers)]
    event = routes[0]
    assert event.expert_ids.shape == event.weights.shape == (2 * LENGTH, model.cfg.experts_per_token)


def test_all_expert_mode_feeds_every_token_to_every_expert(model, tokens, logits):
    rows: dict[str, int] = {}
    hooks = ForwardHooks(linear_input=lambda name, x: rows.__setitem__(name, x.shape[0]), all_experts=True)
    with torch.no_grad():
        out = model(tokens, hooks)
    torch.testing.assert_close(out, logits, rtol=0, atol=1e-5)
    for e in range(model.cfg.n_routed_experts):
        for proj in ("w1", "w2", "w3"):
            assert rows[f"layers.3.ffn.experts.{e}.{proj}.weight"] == 2 * LENGTH


def test_weight_override_replaces_a_weight(model, tokens, logits):
    target = "layers.5.attn.wo_b.weight"
    keep = ForwardHooks(weight_override=lambda name, w: None)
    zero = ForwardHooks(weight_override=lambda name, w: torch.zeros_like(w) if name == target else None)
    with torch.no_grad():
        assert torch.equal(model(tokens, keep), logits)
        assert (model(tokens, zero) - logits).abs().max() > 1e-3


def test_expert_override_routes_as_told_and_weighs_by_the_routers_scores(model, tokens, logits):
    """Forcing the router's own choice changes nothing; forcing other experts changes the output, and the
    forced experts are weighted by the router's scores over them, as its own choice would be."""
    layer = f"layers.{model.cfg.num_layers - 1}"
    seen = []
    own = ForwardHooks(expert_override=lambda name, ids: ids.clone() if name == layer else None, routing=seen.append)
    with torch.no_grad():
        assert torch.equal(model(tokens, own), logits)
    event = next(e for e in seen if e.layer == layer)
    other = (event.expert_ids + 1) % model.cfg.n_routed_experts
    forced = []
    swap = ForwardHooks(expert_override=lambda name, ids: other if name == layer else None, routing=forced.append)
    with torch.no_grad():
        assert (model(tokens, swap) - logits).abs().max() > 1e-3
    expect = event.scores.gather(1, other)
    expect = expect / expect.sum(-1, keepdim=True) * model.cfg.routed_scaling_factor
    gate = model.layers[model.cfg.num_layers - 1].ffn.gate
    torch.testing.assert_close(gate.weigh(event.scores, other), expect)


def test_engram_contributes(model, tokens, logits):
    tables = [b.engram.embed.weight for b in model.layers if b.engram is not None]
    assert len(tables) == len(model.cfg.engram_layer_ids)
    saved = [t.detach().clone() for t in tables]
    try:
        with torch.no_grad():
            for t in tables:
                t.zero_()
            out = model(tokens)
    finally:
        with torch.no_grad():
            for t, s in zip(tables, saved):
                t.copy_(s)
    assert (out - logits).abs().max() > 1e-3


def test_engram_hashes_are_ngram_functions_within_their_tables(model):
    cfg = model.cfg
    hasher = model.hasher
    row = torch.tensor([[5, 6, 7, 8, 9, 6, 7, 8, 9, 4]])
    for i, layer in enumerate(cfg.engram_layer_ids):
        ids = hasher.hash_ids(row, layer)[0]  # [S, cols]
        assert ids.shape == (10, (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads)
        assert ids.min() >= 0 and ids.max() < cfg.engram_rows(layer)
        assert torch.equal(ids[4], ids[8])  # same 4-gram (6 7 8 9) ending at both positions
        assert not torch.equal(ids[3], ids[7])  # 5 6 7 8 vs 9 6 7 8: the 4-gram columns differ
        primes = torch.tensor(engram_primes(cfg)[i])
        col = (ids[3] - hasher.offsets[i])
        assert (col >= 0).all() and (col < primes).all()


def test_engram_primes_reproduce_the_v41_flash_table_sizes():
    cfg = ModelConfig.from_file(model_config_path("deepseek-v4.1-flash.json"))
    primes = engram_primes(cfg)
    assert [sum(columns) for columns in primes] == [384006168, 384016682]
    assert primes[0][:3] == [16000057, 16000079, 16000081]


def test_compressed_token_map_merges_normalised_spellings():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"Hello": 0, "hello": 1, "HÉLLO": 2, " the": 3, "the": 4, "cat": 5, " ": 6}
    mapping, size = compressed_token_map(Tokenizer(WordLevel(vocab, unk_token="cat")))
    assert mapping[0] == mapping[1] == mapping[2]
    assert mapping[3] == mapping[4]
    assert len({int(mapping[i]) for i in (0, 3, 5, 6)}) == 4
    assert size == 4


def test_the_model_trains(checkpoint):
    """Differentiable end to end: random init, one backward pass, finite gradients everywhere used."""
    torch.manual_seed(0)
    model = DeepseekModel(checkpoint.config, token_map=None)
    init_parameters(model, seed=1)
    tokens = torch.randint(3, 4096, (2, 24))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name in ("layers.2.attn.compressor.wkv.weight", "layers.8.attn.wq_b.weight", "layers.1.engram.wkv.weight",
                 "layers.0.hc_attn_fn", "head.weight", "embed.weight", "layers.3.ffn.shared_experts.w2.weight"):
        assert grads[name] is not None and torch.isfinite(grads[name]).all() and grads[name].abs().sum() > 0, name
