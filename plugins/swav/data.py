"""SwAV's data: multi-crop views of images from an ImageNet-style folder or of synthetic images.

A batch is a list with one `[B, 3, H, W]` float tensor per crop (the large crops first), normalised
with ImageNet's mean and std. Which image each sample shows and how it is augmented are fixed by
the peer's `seed`, the split and the sample's position in the stream, so an iterator rebuilt with
the same seed yields the same batches (whatever `data_workers` is).

Without `data_dir`, images are generated at run time: coloured shapes (circle, square, triangle,
stripes) with textures (flat, checker, waves, noise) at random positions, sizes, rotations and
colours, on a textured background. The palette, and every image of a given index, are fixed by
`data_seed` (the task, the same on every peer); the peer's `seed` picks which images it sees.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SHAPES = ("circle", "square", "triangle", "stripes")
TEXTURES = ("flat", "checker", "waves", "noise")
PALETTE_SIZE = 12


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any tuple of ints and strings (a hash: no collisions by arithmetic)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# --- multi-crop ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultiCrop:
    """How many crops of each size, and the area range (fraction of the image) of each group."""

    counts: tuple[int, ...]
    sizes: tuple[int, ...]
    min_scales: tuple[float, ...]
    max_scales: tuple[float, ...]

    @property
    def total(self) -> int:
        return sum(self.counts)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MultiCrop:
        """Parse `crops`, `crop_sizes`, `crop_min_scales`, `crop_max_scales` (comma-separated)."""
        counts = _numbers(config, "crops", int)
        sizes = _numbers(config, "crop_sizes", int)
        lows = _numbers(config, "crop_min_scales", float)
        highs = _numbers(config, "crop_max_scales", float)
        if not len(counts) == len(sizes) == len(lows) == len(highs):
            raise ValueError("crops, crop_sizes, crop_min_scales and crop_max_scales must list as many "
                             f"groups each, got {len(counts)}, {len(sizes)}, {len(lows)}, {len(highs)}")
        if any(count < 1 for count in counts) or sum(counts) < 2:
            raise ValueError(f"crops must be positive counts adding up to 2 or more, got {counts}")
        if any(not 8 <= size <= 1024 for size in sizes):
            raise ValueError(f"crop_sizes must be between 8 and 1024 pixels, got {sizes}")
        if any(not 0.0 < lo <= hi <= 1.0 for lo, hi in zip(lows, highs, strict=True)):
            raise ValueError("each crop group needs 0 < crop_min_scales <= crop_max_scales <= 1, got "
                             f"{lows} and {highs}")
        if config["assign_crops"] > sum(counts):
            raise ValueError(f"assign_crops ({config['assign_crops']}) is more than the {sum(counts)} crops")
        return cls(tuple(counts), tuple(sizes), tuple(lows), tuple(highs))

    def transforms(self, config: dict[str, Any]) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """One torchvision.transforms.v2 pipeline per crop (uint8 [3, H, W] image in, float out)."""
        from torchvision.transforms import v2  # heavy: imported when data is built

        strength = config["color_jitter"]
        found: list[Callable[[torch.Tensor], torch.Tensor]] = []
        for count, size, lo, hi in zip(self.counts, self.sizes, self.min_scales, self.max_scales,
                                       strict=True):
            kernel = max(3, int(0.1 * size) // 2 * 2 + 1)  # odd, about a tenth of the crop
            steps: list[Any] = [
                v2.RandomResizedCrop(size, scale=(lo, hi), antialias=True),
                v2.RandomHorizontalFlip(),
                v2.ToDtype(torch.float32, scale=True),
                v2.RandomApply([v2.ColorJitter(0.8 * strength, 0.8 * strength, 0.8 * strength,
                                               0.2 * strength)], p=0.8),
                v2.RandomGrayscale(p=0.2),
                v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=config["blur_prob"]),
            ]
            if config["solarize_prob"] > 0:
                steps.append(v2.RandomSolarize(threshold=0.5, p=config["solarize_prob"]))
            steps.append(v2.Normalize(IMAGENET_MEAN, IMAGENET_STD))
            found += [v2.Compose(steps)] * count
        return found


def _numbers(config: dict[str, Any], key: str, kind: type) -> list[Any]:
    try:
        return [kind(part) for part in str(config[key]).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{key} must be a comma-separated list of {kind.__name__}s, "
                         f"got {config[key]!r}") from None


# --- images -------------------------------------------------------------------------------------


class Images(Protocol):
    def __len__(self) -> int: ...

    def load(self, index: int) -> torch.Tensor:
        """Image `index` as a uint8 [3, H, W] tensor."""
        ...


class SyntheticImages:
    """`count` generated images of `size` pixels (see `synthetic_image`); eval's are other images."""

    def __init__(self, data_seed: int, split: str, count: int, size: int) -> None:
        self.data_seed, self.split, self.count, self.size = data_seed, split, count, size
        self.palette = synthetic_palette(data_seed)

    def __len__(self) -> int:
        return self.count

    def load(self, index: int) -> torch.Tensor:
        return synthetic_image(self.data_seed, self.split, index, self.size, self.palette)


class FolderImages:
    """The images of an ImageFolder layout (root/<class>/<image>); the labels are ignored."""

    def __init__(self, root: Path) -> None:
        from torchvision.datasets import ImageFolder

        self.paths = [path for path, _ in ImageFolder(str(root)).samples]

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, index: int) -> torch.Tensor:
        from PIL import Image  # torchvision's own decoders are deprecated since 0.29
        from torchvision.transforms.v2.functional import pil_to_tensor

        with Image.open(self.paths[index]) as image:
            return pil_to_tensor(image.convert("RGB"))


def folder_for(data_dir: str, split: str) -> Path:
    """`data_dir/train` or `data_dir/val` when `data_dir` has a train/ folder, else `data_dir`."""
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"data_dir {data_dir!r} is not a directory")
    if (root / "train").is_dir():
        if split == "eval" and (root / "val").is_dir():
            return root / "val"
        return root / "train"
    return root


def _hsv_to_rgb(hsv: torch.Tensor) -> torch.Tensor:
    """[..., 3] HSV in [0, 1] to RGB in [0, 1]."""
    h, s, v = hsv.unbind(-1)
    k = torch.stack([(5 + h * 6) % 6, (3 + h * 6) % 6, (1 + h * 6) % 6], dim=-1)
    return v[..., None] - v[..., None] * s[..., None] * (torch.minimum(k, 4 - k).clamp(0, 1))


def synthetic_palette(data_seed: int) -> torch.Tensor:
    """The task's colours ([PALETTE_SIZE, 3] RGB): hues spread around the wheel, fixed by data_seed."""
    generator = torch.Generator().manual_seed(derive_seed("palette", data_seed))
    hue = (torch.arange(PALETTE_SIZE) + torch.rand(PALETTE_SIZE, generator=generator)) / PALETTE_SIZE
    saturation = 0.6 + 0.4 * torch.rand(PALETTE_SIZE, generator=generator)
    value = 0.6 + 0.4 * torch.rand(PALETTE_SIZE, generator=generator)
    return _hsv_to_rgb(torch.stack([hue, saturation, value], dim=-1))


def synthetic_image(data_seed: int, split: str, index: int, size: int,
                    palette: torch.Tensor | None = None) -> torch.Tensor:
    """Image `index` of `split` of the synthetic set of `data_seed`: uint8 [3, size, size].

    A two-colour gradient background with low-frequency noise, then 1 to 3 shapes (the first the
    largest), each a kind of SHAPES in a palette colour, with a texture of TEXTURES, rotated, at a
    random position and size, drawn with anti-aliased edges.
    """
    if palette is None:
        palette = synthetic_palette(data_seed)
    generator = torch.Generator().manual_seed(derive_seed("image", data_seed, split, index))

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=generator)

    def pick(n: int) -> int:
        return int(torch.randint(n, (), generator=generator))

    axis = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    yy, xx = torch.meshgrid(axis, axis, indexing="ij")

    # Background: two muted colours blended along a random direction, with soft blotches.
    muted = 0.5 * rand(2, 3) + 0.25
    angle = float(rand(1)) * 2 * math.pi
    blend = ((xx - 0.5) * math.cos(angle) + (yy - 0.5) * math.sin(angle) + 0.5).clamp(0, 1)
    image = muted[0, :, None, None] * (1 - blend) + muted[1, :, None, None] * blend
    image = image + 0.15 * (_noise(generator, 6, size) - 0.5)

    for number in range(1 + pick(3)):
        radius = float(0.22 + 0.16 * rand(1)) if number == 0 else float(0.08 + 0.12 * rand(1))
        cx, cy = (0.15 + 0.7 * rand(2)).tolist()
        turn = float(rand(1)) * 2 * math.pi
        u = (xx - cx) * math.cos(turn) + (yy - cy) * math.sin(turn)
        v = -(xx - cx) * math.sin(turn) + (yy - cy) * math.cos(turn)
        kind = SHAPES[pick(len(SHAPES))]
        colour = (palette[pick(len(palette))] * (0.85 + 0.3 * rand(1))).clamp(0, 1)
        if kind == "circle":
            inside = radius - torch.sqrt(u * u + v * v)
        elif kind == "triangle":
            inside = torch.stack([0.6 * radius - (u * math.cos(turn_k) + v * math.sin(turn_k))
                                  for turn_k in (0.0, 2 * math.pi / 3, 4 * math.pi / 3)]).amin(dim=0)
        else:  # square and stripes: a square of about the circle's area
            inside = 0.88 * radius - torch.maximum(u.abs(), v.abs())
        mask = (inside * size).clamp(0, 1)
        fill = colour[:, None, None].expand(3, size, size)
        if kind == "stripes":
            frequency = (3 + 3 * float(rand(1))) / radius
            bands = (torch.sin(2 * math.pi * frequency * u) > 0).float()
            fill = fill * (0.25 + 0.75 * bands)
        fill = fill * _texture(TEXTURES[pick(len(TEXTURES))], u, v, radius, generator, size)
        image = image * (1 - mask) + fill * mask
    image = image + 0.03 * (torch.rand(image.shape, generator=generator) - 0.5)
    return (image.clamp(0, 1) * 255).round().to(torch.uint8)


def _noise(generator: torch.Generator, cells: int, size: int) -> torch.Tensor:
    """Smooth noise in [0, 1]: a cells x cells grid upsampled bilinearly to [size, size]."""
    grid = torch.rand((1, 1, cells, cells), generator=generator)
    return F.interpolate(grid, size=(size, size), mode="bilinear", align_corners=False)[0, 0]


def _texture(kind: str, u: torch.Tensor, v: torch.Tensor, radius: float, generator: torch.Generator,
             size: int) -> torch.Tensor:
    """A brightness factor around 1 over the shape's own (rotated) coordinates."""
    if kind == "flat":
        return torch.ones_like(u)
    period = radius / (2 + 2 * float(torch.rand((), generator=generator)))
    if kind == "checker":
        return 1 + 0.25 * torch.sign(torch.sin(math.pi * u / period) * torch.sin(math.pi * v / period))
    if kind == "waves":
        return 1 + 0.25 * torch.sin(2 * math.pi * (u + v) / period)
    return 0.7 + 0.6 * _noise(generator, 12, size)


# --- the stream of multi-crop samples -----------------------------------------------------------


class MultiCropSamples(torch.utils.data.Dataset):
    """Sample (position, image index) -> that image's crops, augmented with a seed of the position."""

    def __init__(self, images: Images, transforms: list[Callable[[torch.Tensor], torch.Tensor]],
                 seed: int, split: str) -> None:
        self.images, self.transforms, self.seed, self.split = images, transforms, seed, split

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: tuple[int, int]) -> list[torch.Tensor]:
        position, index = key
        image = self.images.load(index)
        with torch.random.fork_rng(devices=[]):  # v2 transforms draw from torch's global RNG
            torch.manual_seed(derive_seed("augment", self.seed, self.split, position))
            return [transform(image) for transform in self.transforms]


class EpochOrder(torch.utils.data.Sampler):
    """Endless (position, image index) keys: each epoch a fresh permutation of the images, drawn
    from (seed, split, epoch)."""

    def __init__(self, count: int, seed: int, split: str) -> None:
        self.count, self.seed, self.split = count, seed, split

    def __iter__(self) -> Iterator[tuple[int, int]]:
        position = 0
        epoch = 0
        while True:
            generator = torch.Generator().manual_seed(derive_seed("order", self.seed, self.split, epoch))
            for chunk in torch.randperm(self.count, generator=generator).split(4096):
                for index in chunk.tolist():
                    yield position, index
                    position += 1
            epoch += 1


def multicrop_batches(config: dict[str, Any], seed: int, split: str) -> Iterator[list[torch.Tensor]]:
    """The endless iterator of multi-crop batches of the workload's `build_data`."""
    crops = MultiCrop.from_config(config)
    images: Images
    if config["data_dir"]:
        images = FolderImages(folder_for(config["data_dir"], split))
        if len(images) == 0:
            raise ValueError(f"no images under {config['data_dir']!r}")
    else:
        images = SyntheticImages(config["data_seed"], split, config["synthetic_images"],
                                 config["synthetic_size"])
    samples = MultiCropSamples(images, crops.transforms(config), seed, split)
    workers = config["data_workers"]
    loader = torch.utils.data.DataLoader(
        samples, batch_size=config["batch_size"], sampler=EpochOrder(len(images), seed, split),
        num_workers=workers, persistent_workers=workers > 0, prefetch_factor=4 if workers else None)
    yield from loader
