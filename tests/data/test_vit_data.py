"""Images for image classification: the bundled digits, the imagefolder loader, the image processor as the transform,
augmentation seeded by (seed, epoch, index) whatever the reading order, label checks, and the Trainer counting
images (loss items and throughput)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mindformers_py as mf
from mindformers_py.data.images import (
    ImageClassificationDataset,
    RandomAffine,
    default_image_processor,
    digits_dataset,
    imagefolder_dataset,
    label_names,
)
from mindformers_py.errors import ConfigError, MindFormersError
from mindformers_py.task_registry import get_task
from support.vit_models import random_images

CONFIG = mf.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_labels=10)


@pytest.fixture(scope="module")
def digits():
    return digits_dataset()


def test_digits_are_bundled_split_and_stratified(digits):
    train, val = digits["train"], digits["validation"]
    assert (len(train), len(val)) == (1437, 360)
    assert label_names(train) == [str(d) for d in range(10)]
    assert train[0]["image"].size == (8, 8) and train[0]["image"].mode == "L"
    counts = np.bincount(val["label"], minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # every class held out in proportion
    assert digits_dataset()["validation"]["label"] == val["label"]  # the same split every time


def test_imagefolder_reads_class_folders(tmp_path):
    for name, seed in (("cat", 0), ("dog", 1)):
        (tmp_path / name).mkdir()
        for i, image in enumerate(random_images(3, size=10, seed=seed)):
            image.save(tmp_path / name / f"{i}.png")
    ds = imagefolder_dataset(tmp_path)
    assert len(ds) == 6 and label_names(ds) == ["cat", "dog"]
    items = ImageClassificationDataset(ds, default_image_processor(CONFIG), num_labels=2)
    assert items[0]["pixel_values"].shape == (3, 16, 16)
    with pytest.raises(ConfigError, match="does not exist"):
        imagefolder_dataset(tmp_path / "missing")


def test_image_processor_is_the_transform(digits):
    processor = default_image_processor(CONFIG)
    items = ImageClassificationDataset(digits["validation"], processor, num_channels=3, num_labels=10)
    row = digits["validation"][5]
    want = processor(images=row["image"].convert("RGB"), return_tensors="pt")["pixel_values"][0]
    got = items[5]
    assert torch.equal(got["pixel_values"], want) and got["labels"] == row["label"]
    assert items[5]["pixel_values"].min() >= -1 and items[5]["pixel_values"].max() <= 1


def test_augmentation_depends_on_seed_epoch_and_index_only(digits):
    processor = default_image_processor(CONFIG)
    make = lambda seed=0: ImageClassificationDataset(digits["train"], processor, num_labels=10,  # noqa: E731
                                                     augmentation=RandomAffine(), seed=seed)
    a, b = make(), make()
    first = a[7]["pixel_values"]
    _ = [b[i] for i in (3, 9, 1)]  # another reading order and history
    assert torch.equal(b[7]["pixel_values"], first)
    assert not torch.equal(first, ImageClassificationDataset(digits["train"], processor, num_labels=10)[7]["pixel_values"])
    b.set_epoch(1)
    assert not torch.equal(b[7]["pixel_values"], first)
    assert not torch.equal(make(seed=1)[7]["pixel_values"], first)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    _ = a[2]
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is untouched (dropout streams stay put)


def test_labels_outside_num_labels_are_refused(digits):
    with pytest.raises(MindFormersError, match="outside num_labels=5"):
        ImageClassificationDataset(digits["validation"], default_image_processor(CONFIG), num_labels=5)
    with pytest.raises(ConfigError, match="data.image_column='picture'"):
        ImageClassificationDataset(digits["validation"], default_image_processor(CONFIG), image_column="picture")


def test_trainer_counts_images_and_tells_the_dataset_the_epoch(digits, tmp_path):
    spec = get_task("image_classification")
    batch = {"pixel_values": torch.zeros(4, 3, 16, 16), "labels": torch.tensor([1, -100, 2, 3])}
    assert spec.count_throughput(batch) == 4 and spec.count_items(batch) == 3

    seen = []

    class Recording(ImageClassificationDataset):
        def set_epoch(self, epoch):
            seen.append(epoch)
            super().set_epoch(epoch)

    small = digits["validation"].select(range(16))
    train = Recording(small, default_image_processor(CONFIG), num_labels=10, augmentation=RandomAffine())
    args = mf.TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_train_epochs=2,
                                save_strategy="no", report_to=[], disable_tqdm=True, plot_loss_curve=False, use_cpu=True,
                                logging_steps=1)
    trainer = mf.Trainer(model=mf.ViTForImageClassification(CONFIG), args=args, train_dataset=train)
    trainer.train()
    assert seen == [0, 1]
    assert trainer.state.num_input_tokens_seen == 32  # images, not tokens
    # Throughput is named by the item counted: images/s in the logs and the bar, no tokens figure at the end.
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all("images_per_second" in h and "tokens_per_second" not in h for h in logs)
    assert logs[-1]["num_input_images_seen"] == 32
    final = trainer.state.log_history[-1]
    assert "train_samples_per_second" in final and "train_tokens_per_second" not in final
