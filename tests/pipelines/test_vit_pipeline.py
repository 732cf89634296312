"""``pipeline("image-classification")`` on our ViT equals transformers' pipeline on transformers' ViT with the same
weights and image processor: PIL images, file paths, arrays, grayscale images, batches, ``top_k`` and
``function_to_apply``; arrays whose channels do not fit are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import transformers

import mindformers_py as mf
from mindformers_py.errors import MindFormersError
from support.vit_models import random_images, save_hf_vit


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vit")
    hf_model = save_hf_vit(folder)
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    theirs = transformers.pipeline("image-classification", model=hf_model, image_processor=processor)
    ours = mf.pipeline("image-classification", model=str(folder))  # model and image processor from the folder
    return ours, theirs, folder


def assert_same(got, want):
    if isinstance(want, list) and want and isinstance(want[0], list):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
        return
    assert [r["label"] for r in got] == [r["label"] for r in want]
    assert np.allclose([r["score"] for r in got], [r["score"] for r in want], atol=1e-5)


def test_pil_images_paths_and_batches_equal_transformers(pipes, tmp_path):
    ours, theirs, _ = pipes
    images = random_images(3, size=24)  # resized to the model's 16x16 by the processor
    assert_same(ours(images[0]), theirs(images[0]))
    assert_same(ours(images), theirs(images))
    path = tmp_path / "image.png"
    images[1].save(path)
    assert_same(ours(str(path)), theirs(str(path)))
    for kwargs in ({"top_k": 1}, {"top_k": 2, "function_to_apply": "sigmoid"}, {"function_to_apply": "none"}):
        assert_same(ours(images[2], **kwargs), theirs(images[2], **kwargs))
    assert len(ours(images[2], top_k=1)) == 1 and ours(images[2])[0]["label"].startswith("class_")


def test_arrays_and_grayscale_images(pipes):
    ours, theirs, _ = pipes
    rgb = np.asarray(random_images(1, size=20)[0])
    assert_same(ours(rgb), theirs(rgb))  # (H, W, 3) arrays go to the processor as in transformers
    gray = random_images(1, size=20, mode="L")[0]
    assert_same(ours(gray), theirs(gray))  # PIL images are converted to RGB by both
    as_rgb = np.asarray(gray.convert("RGB"))
    assert_same(ours(np.asarray(gray)), theirs(as_rgb))  # a grayscale array is converted for an RGB model
    assert_same(ours(np.asarray(gray)[None]), theirs(as_rgb))  # (1, H, W) too


def test_arrays_with_other_channel_counts_are_refused(pipes):
    ours = pipes[0]
    with pytest.raises(MindFormersError, match="4 channels"):
        ours(np.zeros((20, 20, 4), dtype=np.uint8))


def test_task_alias_and_model_object(pipes):
    _, theirs, folder = pipes
    model = mf.AutoModelForImageClassification.from_pretrained(folder)
    processor = mf.AutoImageProcessor.from_pretrained(folder)
    pipe = mf.pipeline("image_classification", model=model, image_processor=processor)
    image = random_images(1, seed=3)[0]
    assert_same(pipe(image), theirs(image))
