"""SwAV's data: multi-crop batches, synthetic images fixed by data_seed, ImageFolder trees."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from dedloc.plugins.swav.data import MultiCrop, SyntheticImages, synthetic_image
from dedloc.plugins.swav.workload import SWAV, build_data


def first(config: dict[str, Any], seed: int = 1, split: str = "train") -> list[torch.Tensor]:
    return next(build_data(config, seed, split))  # type: ignore[arg-type]


def test_a_batch_is_a_list_of_crops(tiny_config: dict[str, Any]) -> None:
    batch = first(tiny_config)
    assert [tuple(crop.shape) for crop in batch] == [(8, 3, 64, 64)] * 2 + [(8, 3, 32, 32)] * 2
    assert all(crop.dtype == torch.float32 for crop in batch)
    # Normalised with ImageNet's statistics: roughly centred, not in [0, 1].
    assert float(torch.cat([c.flatten() for c in batch]).min()) < -0.5
    # The two large crops of an image are different views.
    assert not torch.allclose(batch[0], batch[1])


def test_the_same_seed_gives_the_same_batches_another_seed_others(tiny_config: dict[str, Any]) -> None:
    a, b = first(tiny_config, seed=1), first(tiny_config, seed=1)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert not torch.allclose(first(tiny_config, seed=2)[0], a[0])
    assert not torch.allclose(first(tiny_config, seed=1, split="eval")[0], a[0])


def test_data_workers_change_nothing(tiny_config: dict[str, Any]) -> None:
    config = {**tiny_config, "batch_size": 4, "synthetic_size": 48}
    alone = first(config)
    helped = first({**config, "data_workers": 2})
    for x, y in zip(alone, helped, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_synthetic_images_are_fixed_by_data_seed() -> None:
    image = synthetic_image(0, "train", 5, 64)
    assert image.shape == (3, 64, 64) and image.dtype == torch.uint8
    torch.testing.assert_close(synthetic_image(0, "train", 5, 64), image, rtol=0, atol=0)
    assert not torch.equal(synthetic_image(1, "train", 5, 64), image)
    assert not torch.equal(synthetic_image(0, "train", 6, 64), image)
    assert not torch.equal(synthetic_image(0, "eval", 5, 64), image)
    # Not flat: shapes on a background.
    assert float(image.float().std()) > 10
    images = SyntheticImages(0, "train", 3, 32)
    assert len(images) == 3 and images.load(2).shape == (3, 32, 32)


def test_an_epoch_shows_every_image_once(tiny_config: dict[str, Any]) -> None:
    from dedloc.plugins.swav.data import EpochOrder

    keys = iter(EpochOrder(5, seed=3, split="train"))
    taken = [next(keys) for _ in range(10)]
    assert [position for position, _ in taken] == list(range(10))
    assert sorted(index for _, index in taken[:5]) == list(range(5))
    assert sorted(index for _, index in taken[5:]) == list(range(5))


@pytest.mark.parametrize("layout", ["flat", "train-val"])
def test_reads_an_image_folder(tmp_path: Path, tiny_config: dict[str, Any], layout: str) -> None:
    generator = torch.Generator().manual_seed(0)
    splits = {"flat": [tmp_path], "train-val": [tmp_path / "train", tmp_path / "val"]}[layout]
    for root in splits:
        for label in ("cats", "dogs"):
            (root / label).mkdir(parents=True)
            for number in range(3):
                pixels = torch.randint(0, 256, (40, 50, 3), dtype=torch.uint8, generator=generator)
                Image.fromarray(pixels.numpy()).save(root / label / f"{number}.png")
    config = {**tiny_config, "data_dir": str(tmp_path), "batch_size": 4}
    batch = first(config)
    assert [tuple(crop.shape) for crop in batch] == [(4, 3, 64, 64)] * 2 + [(4, 3, 32, 32)] * 2
    assert tuple(first(config, split="eval")[2].shape) == (4, 3, 32, 32)


def test_an_empty_or_missing_folder_fails_clearly(tmp_path: Path, tiny_config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        first({**tiny_config, "data_dir": str(tmp_path / "nowhere")})
    with pytest.raises(FileNotFoundError):  # torchvision's ImageFolder: no class folders
        first({**tiny_config, "data_dir": str(tmp_path)})


@pytest.mark.parametrize(("change", "message"), [
    ({"crops": "2,6", "crop_sizes": "224"}, "as many groups"),
    ({"crops": "1", "crop_sizes": "224", "crop_min_scales": "0.14", "crop_max_scales": "1"},
     "adding up to 2 or more"),
    ({"crop_min_scales": "0.5,0.05", "crop_max_scales": "0.4,0.14"}, "crop_min_scales <= crop_max_scales"),
    ({"crop_sizes": "224,x"}, "comma-separated list of ints"),
    ({"assign_crops": 9}, "more than the 8 crops"),
])
def test_bad_crop_settings_are_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MultiCrop.from_config(SWAV.resolve_config(change))


def test_default_multicrop_is_swavs() -> None:
    crops = MultiCrop.from_config(SWAV.resolve_config())
    assert crops == MultiCrop((2, 6), (224, 96), (0.14, 0.05), (1.0, 0.14))
    assert crops.total == 8
