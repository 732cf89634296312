"""The ViT family against transformers' ViT on the same weights (fp32, max |Δ| ≤ 1e-4): logits and loss, the base
model with its pooler, interpolated positions, hidden states and attentions, tuple outputs, export back to HF,
transformers' Auto classes on our checkpoints, presets' sizes, peft, and one-line errors for bad input."""

from __future__ import annotations

import pytest
import torch
import transformers

import mindformers_py as mf
from mindformers_py.errors import CheckpointError, MindFormersError
from mindformers_py.models.vit import convert_vit
from support.vit_models import IMAGE, LABELS, save_hf_vit, tiny_hf_vit

TOL = 1e-4


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_vit")
    save_hf_vit(folder)
    return folder


@pytest.fixture(scope="module")
def pixels():
    return torch.randn(4, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))


def test_classifier_logits_and_loss_match_transformers(hf_folder, pixels):
    hf = transformers.ViTForImageClassification.from_pretrained(hf_folder).eval()
    ours = mf.AutoModelForImageClassification.from_pretrained(hf_folder)
    assert type(ours) is mf.ViTForImageClassification and ours.config.id2label[2] == "class_2"
    labels = torch.tensor([0, 2, 1, -100])
    with torch.no_grad():
        want, got = hf(pixels, labels=labels), ours(pixels, labels=labels)
    assert max_diff(got.logits, want.logits) <= TOL
    assert abs(got.loss.item() - want.loss.item()) <= TOL


def test_base_model_and_pooler_match_transformers(tmp_path, pixels):
    save_hf_vit(tmp_path, head="base")
    hf = transformers.ViTModel.from_pretrained(tmp_path).eval()
    ours = mf.AutoModel.from_pretrained(tmp_path)
    assert type(ours) is mf.ViTModel
    with torch.no_grad():
        want, got = hf(pixels), ours(pixels)
    assert max_diff(got.last_hidden_state, want.last_hidden_state) <= TOL
    assert max_diff(got.pooler_output, want.pooler_output) <= TOL


@pytest.mark.parametrize("size", [(24, 24), (20, 28), (8, 12)])
def test_interpolated_positions_match_transformers(hf_folder, size):
    hf = transformers.ViTForImageClassification.from_pretrained(hf_folder).eval()
    ours = mf.AutoModelForImageClassification.from_pretrained(hf_folder)
    images = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(images, interpolate_pos_encoding=True).logits
        got = ours(images, interpolate_pos_encoding=True).logits
    assert max_diff(got, want) <= TOL


def test_hidden_states_attentions_and_tuples_match_transformers(hf_folder, pixels):
    hf = transformers.ViTForImageClassification.from_pretrained(hf_folder, attn_implementation="eager").eval()
    ours = mf.AutoModelForImageClassification.from_pretrained(hf_folder, attn_implementation="eager")
    with torch.no_grad():
        want = hf(pixels, output_hidden_states=True, output_attentions=True)
        got = ours(pixels, output_hidden_states=True, output_attentions=True)
        want_tuple, got_tuple = hf(pixels, return_dict=False), ours(pixels, return_dict=False)
    assert len(got.hidden_states) == len(want.hidden_states) == 3  # embeddings + each layer (before the final norm)
    assert max(max_diff(a, b) for a, b in zip(got.hidden_states, want.hidden_states)) <= TOL
    assert len(got.attentions) == len(want.attentions) == 2
    assert max(max_diff(a, b) for a, b in zip(got.attentions, want.attentions)) <= TOL
    assert isinstance(got_tuple, tuple) and max_diff(got_tuple[0], want_tuple[0]) <= TOL


def test_export_to_hf_and_transformers_auto_classes(hf_folder, tmp_path, pixels):
    hf = transformers.ViTForImageClassification.from_pretrained(hf_folder).eval()
    ours_dir, back_dir = tmp_path / "ours", tmp_path / "back"
    mf.convert_checkpoint(hf_folder, ours_dir, to="mindformers")
    assert (ours_dir / "preprocessor_config.json").is_file()  # the image processor travels with the weights
    # transformers' Auto classes know our model type and return our class.
    loaded = transformers.AutoModelForImageClassification.from_pretrained(ours_dir)
    assert type(loaded) is mf.ViTForImageClassification
    mf.convert_checkpoint(ours_dir, back_dir, to="hf")
    back = transformers.ViTForImageClassification.from_pretrained(back_dir).eval()
    assert back.config.model_type == "vit" and (back_dir / "preprocessor_config.json").is_file()
    with torch.no_grad():
        assert max_diff(back(pixels).logits, hf(pixels).logits) <= TOL
        assert max_diff(loaded(pixels).logits, hf(pixels).logits) <= TOL


def test_base_model_exports_to_hf_vit_model(tmp_path, pixels):
    hf = save_hf_vit(tmp_path / "hf", head="base")
    mf.convert_checkpoint(tmp_path / "hf", tmp_path / "back", to="hf")
    back = transformers.ViTModel.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert max_diff(back(pixels).pooler_output, hf(pixels).pooler_output) <= TOL


def test_transformers_module_names_convert_too(pixels):
    """transformers 5 names its ViT modules differently from its checkpoints (``layers.0.attention.q_proj``,
    ``mlp.fc1``): a state dict taken from a live model converts as well as a checkpoint file."""
    hf = tiny_hf_vit()
    assert any(".mlp.fc1." in k for k in hf.state_dict())
    ours = mf.ViTForImageClassification(convert_vit.config_from_hf(hf.config.to_dict())).eval()
    ours.load_state_dict(convert_vit.state_dict_from_hf(hf.state_dict(), ours.config))
    with torch.no_grad():
        assert max_diff(ours(pixels).logits, hf(pixels).logits) <= TOL


def test_presets_have_the_published_sizes():
    for preset, hf_config in (("vit_base_patch16_224", transformers.ViTConfig()),
                              ("vit_tiny", transformers.ViTConfig(hidden_size=192, num_attention_heads=3, intermediate_size=768))):
        with torch.device("meta"):
            ours = mf.AutoModel.from_config(mf.AutoConfig.from_pretrained(preset))
            theirs = transformers.ViTModel(hf_config)
        assert ours.num_parameters() == theirs.num_parameters(), preset
    assert mf.AutoConfig.from_pretrained("vit_base_patch16_224").num_patches == 196


def test_lora_with_peft_defaults(hf_folder, pixels):
    peft = pytest.importorskip("peft")
    model = mf.AutoModelForImageClassification.from_pretrained(hf_folder)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, modules_to_save=["classifier"]))
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert any("q_proj.lora_A" in n for n in trainable) and any("classifier" in n for n in trainable)
    loss = lora(pixel_values=pixels, labels=torch.tensor([0, 1, 2, 0])).loss
    loss.backward()


def test_grayscale_pixels_go_to_an_rgb_model_as_rgb(hf_folder):
    ours = mf.AutoModelForImageClassification.from_pretrained(hf_folder)
    gray = torch.randn(2, 1, IMAGE, IMAGE)
    with torch.no_grad():
        assert max_diff(ours(gray).logits, ours(gray.expand(-1, 3, -1, -1)).logits) == 0


@pytest.mark.parametrize("call, needle", [
    (lambda m: m(torch.randn(1, 2, IMAGE, IMAGE)), "2 channels"),
    (lambda m: m(torch.randn(1, 3, IMAGE + 4, IMAGE)), "interpolate_pos_encoding=True"),
    (lambda m: m(torch.randn(1, 3, 2, 2), interpolate_pos_encoding=True), "smaller than one patch"),
    (lambda m: m(torch.randn(2, 3, IMAGE, IMAGE), labels=torch.tensor([0, LABELS])), f"outside num_labels={LABELS}"),
    (lambda m: m(torch.randn(3, IMAGE, IMAGE)), "(batch, channels, height, width)"),
])
def test_bad_input_gives_one_line_errors(hf_folder, call, needle):
    ours = mf.AutoModelForImageClassification.from_pretrained(hf_folder)
    with pytest.raises(MindFormersError) as err:
        call(ours)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_config_errors_name_the_field():
    with pytest.raises(MindFormersError, match="patch_size=5"):
        mf.ViTConfig(image_size=16, patch_size=5)
    with pytest.raises(MindFormersError, match="num_attention_heads=5"):
        mf.ViTConfig(hidden_size=32, num_attention_heads=5)
    assert mf.ViTConfig(qkv_bias=False, layer_norm_eps=1e-6).attention_bias is False


def test_masked_image_modelling_checkpoints_load_as_in_transformers(tmp_path, pixels, caplog):
    # transformers loads a masked-image-modelling checkpoint into ViTModel, warning that mask_token is unused: so do we.
    model = transformers.ViTForMaskedImageModeling(tiny_hf_vit().config)
    model.save_pretrained(tmp_path)
    hf = transformers.ViTModel.from_pretrained(tmp_path).eval()
    with caplog.at_level("WARNING", logger="mindformers_py"):
        ours = mf.AutoModel.from_pretrained(tmp_path)
    assert "embeddings.mask_token" in caplog.text and "not used" in caplog.text
    with torch.no_grad():
        assert max_diff(ours(pixels).last_hidden_state, hf(pixels).last_hidden_state) <= TOL
