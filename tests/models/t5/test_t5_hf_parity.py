"""HF t5 (v1), t5 v1.1 (FLAN-T5) and mt5 checkpoints load into our T5 models with transformers' logits, losses,
hidden states and attentions (fp32, within 1e-4), greedy and beam-search generation token-identical, and export
back to transformers' classes."""

import pytest
import torch
import transformers

import mindformers_py as mf
from support.t5_models import KINDS, VOCAB, batch, load_hf, save_tiny_hf

TOL = 1e-4


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    kind = request.param
    path = save_tiny_hf(kind, tmp_path_factory.mktemp(kind) / "hf")
    return kind, load_hf(path, kind), mf.AutoModelForSeq2SeqLM.from_pretrained(path), path


def test_config_and_classes(pair):
    kind, hf, ours, _ = pair
    assert isinstance(ours, mf.T5ForConditionalGeneration)
    assert ours.config.hf_architecture == ("mt5" if kind == "mt5" else "t5")
    assert ours.config.gated_mlp == (kind != "t5")
    assert ours.config.tie_word_embeddings == (kind == "t5")
    assert (ours.lm_head.weight is ours.model.shared.weight) == (kind == "t5")
    assert ours.config.scales_decoder_outputs == (kind == "t5")


def test_logits_and_loss_match(pair):
    kind, hf, ours, _ = pair
    ids, mask, labels = batch()
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask, labels=labels)
        b = hf(input_ids=ids, attention_mask=mask, labels=labels)
        assert (a.logits - b.logits).abs().max().item() <= TOL
        assert abs(a.loss.item() - b.loss.item()) <= TOL
        real = mask.bool()
        assert (a.encoder_last_hidden_state - b.encoder_last_hidden_state)[real].abs().max().item() <= TOL
        # num_items_in_batch: the summed loss over the step's items (transformers' Trainer contract)
        items = int((labels != -100).sum())
        summed = ours(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=2 * items).loss
        assert abs(summed.item() - b.loss.item() / 2) <= TOL


def test_decoder_inputs_and_decoder_mask_match(pair):
    kind, hf, ours, _ = pair
    ids, mask, labels = batch(1)
    dec = hf.prepare_decoder_input_ids_from_labels(labels)
    assert torch.equal(ours.prepare_decoder_input_ids_from_labels(labels), dec)
    dmask = torch.ones_like(dec)
    dmask[0, -5:] = 0
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dmask).logits
        b = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dmask).logits
    assert (a - b)[dmask.bool()].abs().max().item() <= TOL


def test_hidden_states_and_attentions_match(pair):
    kind, hf, ours, path = pair
    hf_eager = load_hf(path, kind)
    hf_eager.set_attn_implementation("eager")
    ours_eager = mf.AutoModelForSeq2SeqLM.from_pretrained(path, attn_implementation="eager")
    ids, mask, labels = batch(2)
    with torch.no_grad():
        a = ours_eager(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True, output_attentions=True)
        b = hf_eager(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True, output_attentions=True)
    for key in ("encoder_hidden_states", "decoder_hidden_states", "encoder_attentions", "decoder_attentions",
                "cross_attentions"):
        assert len(a[key]) == len(b[key]) > 0, key
        for x, y in zip(a[key], b[key]):
            if key == "encoder_hidden_states":
                x, y = x[mask.bool()], y[mask.bool()]
            assert (x - y).abs().max().item() <= TOL, key


def test_return_dict_false_gives_transformers_tuple(pair):
    kind, hf, ours, _ = pair
    ids, mask, labels = batch(3)
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False, use_cache=False)
        b = hf(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False, use_cache=False)
    assert len(a) == len(b)
    assert all((x - y).abs().max().item() <= TOL for x, y in zip(a[:2], b[:2]))


@pytest.mark.parametrize("options", [dict(do_sample=False), dict(num_beams=3, do_sample=False),
                                     dict(num_beams=2, num_return_sequences=2, length_penalty=0.5)])
def test_generation_token_identical(pair, options):
    kind, hf, ours, _ = pair
    ids, mask, _ = batch(4, rows=3, source=12)
    kw = dict(attention_mask=mask, max_new_tokens=18, **options)
    assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))


def test_generation_dict_outputs_identical(pair):
    kind, hf, ours, _ = pair
    ids, mask, _ = batch(5, rows=2, source=9)
    kw = dict(attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    a, b = ours.generate(ids, **kw), hf.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert max((x - y).abs().max().item() for x, y in zip(a.scores, b.scores)) <= TOL


def test_base_model_matches(tmp_path):
    path = save_tiny_hf("t5", tmp_path / "hf", head="base")
    hf = load_hf(path, "t5", head="base")
    ours = mf.AutoModel.from_pretrained(path)
    assert isinstance(ours, mf.T5Model)
    ids, mask, labels = batch(6)
    dec = ours._shift_right(labels)
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).last_hidden_state
        b = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).last_hidden_state
    assert (a - b).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", ["t5", "mt5"])
def test_encoder_model_matches(kind, tmp_path):
    """transformers' T5EncoderModel / MT5EncoderModel and ours on the same encoder checkpoint, and ours loading the
    encoder part of a full seq2seq checkpoint."""
    path = save_tiny_hf(kind, tmp_path / "enc", head="encoder")
    hf = load_hf(path, kind, head="encoder")
    ours = mf.AutoModelForTextEncoding.from_pretrained(path)
    assert isinstance(ours, mf.T5EncoderModel)
    ids, mask, _ = batch(7)
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        b = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    keep = mask.bool()
    assert (a.last_hidden_state - b.last_hidden_state)[keep].abs().max().item() <= TOL
    assert len(a.hidden_states) == len(b.hidden_states) == 3
    full = save_tiny_hf(kind, tmp_path / "full")
    encoder_of_full = mf.AutoModelForTextEncoding.from_pretrained(full)
    seq2seq = mf.AutoModelForSeq2SeqLM.from_pretrained(full)
    with torch.no_grad():
        assert torch.equal(encoder_of_full(input_ids=ids, attention_mask=mask).last_hidden_state,
                           seq2seq.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state)
    assert isinstance(transformers.AutoModelForTextEncoding.from_config(mf.T5Config(num_hidden_layers=1)), mf.T5EncoderModel)


@pytest.mark.parametrize("kind", KINDS)
def test_export_to_hf_roundtrip(kind, tmp_path):
    path = save_tiny_hf(kind, tmp_path / "hf")
    hf = load_hf(path, kind)
    mf.convert_checkpoint(path, tmp_path / "ours", to="mindformers")
    ours = mf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours")
    assert ours.config.model_type == "mindformers_t5"
    mf.convert_checkpoint(tmp_path / "ours", tmp_path / "back", to="hf")
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == type(hf).__name__
    ids, mask, labels = batch(8)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, labels=labels).logits
        assert (back(input_ids=ids, attention_mask=mask, labels=labels).logits - ref).abs().max().item() <= 1e-5
        assert (ours(input_ids=ids, attention_mask=mask, labels=labels).logits - ref).abs().max().item() <= TOL


def test_transformers_auto_loads_our_checkpoint(tmp_path):
    model = mf.AutoModelForSeq2SeqLM.from_pretrained("t5_tiny", vocab_size=VOCAB, num_hidden_layers=1)
    model.save_pretrained(tmp_path / "m")
    loaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "m").eval()
    assert isinstance(loaded, mf.T5ForConditionalGeneration)
    ids, mask, labels = batch(9)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, labels=labels).logits, model(input_ids=ids, labels=labels).logits)


def test_deeper_decoder_generates_with_cache():
    """transformers sizes its generation cache by the encoder's depth and fails when the decoder is deeper; our
    config's decoder view counts the decoder's layers, so cached greedy decoding equals recomputing every step."""
    config = mf.T5Config(vocab_size=VOCAB, hidden_size=32, head_dim=8, intermediate_size=48, num_hidden_layers=1,
                         num_decoder_layers=3, num_attention_heads=4, dropout_rate=0.0)
    model = mf.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(2, VOCAB, (2, 7))
    out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, fast_generate=False)
    dec = out[:, :1]
    with torch.no_grad():
        for _ in range(6):
            nxt = model(input_ids=ids, decoder_input_ids=dec, use_cache=False).logits[:, -1].argmax(-1)
            dec = torch.cat([dec, nxt[:, None]], dim=1)
    assert torch.equal(out, dec)


def test_errors_are_one_line():
    config = mf.T5Config(vocab_size=VOCAB, hidden_size=32, head_dim=8, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=16, decoder_start_token_id=None)
    model = mf.T5ForConditionalGeneration(config).eval()
    with pytest.raises(mf.ConfigError, match="decoder_start_token_id"):
        model(input_ids=torch.randint(2, VOCAB, (1, 5)), labels=torch.randint(2, VOCAB, (1, 4)))
    # relative positions have no end: a source past n_positions runs, as in transformers
    assert model(input_ids=torch.randint(2, VOCAB, (1, 20)), decoder_input_ids=torch.zeros(1, 1, dtype=torch.long)
                 ).logits.shape == (1, 1, VOCAB)
    with pytest.raises(mf.ConfigError, match="feed_forward_proj='gated-swish' is not valid"):
        mf.T5Config(feed_forward_proj="gated-swish")
    with pytest.raises(mf.ConfigError, match="model_type='bart'"):
        from mindformers_py.models.t5.convert_t5 import config_from_hf
        config_from_hf({"model_type": "bart"})
    with pytest.raises(mf.ConfigError, match="attention_dropout=0.2 cannot be set on T5Config.*set dropout_rate"):
        mf.T5Config(attention_dropout=0.2)


def test_pad_labels_are_scored_as_transformers_with_a_warning(caplog):
    """Labels holding the pad id (not -100) are scored as tokens, as in transformers, and a warning says so."""
    import mindformers_py.models.t5.modeling_t5 as modeling

    modeling._pad_label_warned = False
    config = mf.T5Config(vocab_size=VOCAB, hidden_size=32, head_dim=8, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4)
    labels = torch.tensor([[5, 6, 1, 0, 0]])
    with caplog.at_level("WARNING"):
        loss = mf.T5ForConditionalGeneration(config).eval()(input_ids=torch.tensor([[7, 8, 1]]), labels=labels).loss
    assert "labels contain the pad id 0" in caplog.text and torch.isfinite(loss)


@pytest.mark.parametrize("preset, kind", [("t5_small", "t5"), ("flan_t5_small", "t5"), ("mt5_small", "mt5")])
def test_presets_have_transformers_parameter_counts(preset, kind):
    """The presets are the published shapes: the same parameter count as transformers' model of that config."""
    ours_config = mf.AutoConfig.from_pretrained(preset)
    hf_config = mf.models.t5.convert_t5.config_to_hf(ours_config)
    with torch.device("meta"):
        ours = mf.T5ForConditionalGeneration(ours_config)
        hf = transformers.AutoModelForSeq2SeqLM.from_config(hf_config)
        if not ours_config.tie_word_embeddings:  # transformers 5 ties a fresh model's head regardless
            hf.lm_head.weight = torch.nn.Parameter(torch.empty_like(hf.lm_head.weight))
    # The stacks' embed_tokens are copies of shared in transformers' checkpoints (and in ours, one module).
    count = lambda m: sum(p.numel() for n, p in m.named_parameters() if "embed_tokens" not in n)  # noqa: E731
    assert count(ours) == count(hf), (count(ours), count(hf))
