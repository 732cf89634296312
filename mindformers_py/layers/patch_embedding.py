"""Image patch embeddings (ViT): patches projected to vectors, a learned class token in front, learned positions added.

``pixel_values`` (B, C, H, W) are cut into ``patch_size`` x ``patch_size`` patches by a strided convolution (one
matrix product per patch, the same weights as transformers' ``ViTPatchEmbeddings.projection``), flattened row by
row into a sequence, preceded by the class token, and the learned position of each slot is added. Images of
another size than the positions were learned for take positions interpolated bicubically over the patch grid
(``interpolate_pos_encoding``, transformers' rule, from DINO).

Nothing here is sharded by tensor parallelism: the projection is small and the sequence leaves this module whole
(sequence parallelism cuts it afterwards, at the model's embedding dropout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MindFormersError


def _pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (tuple, list)) else (int(value), int(value))


class PatchEmbedding(nn.Module):
    """``pixel_values`` (B, C, H, W) -> class token + patch vectors with positions, (B, 1 + patches, hidden).

    Args:
        image_size: the (height, width), or one side of square images, the positions are learned for.
        patch_size: side of a square patch (or its (height, width)).
        num_channels: channels of the images (3 for RGB). Single-channel (grayscale) pixel values given to a
            three-channel model are repeated over the channels, as converting a grayscale image to RGB does; other
            channel counts are refused.
        hidden_size: size of each patch vector.
        use_mask_token: learn a ``mask_token`` that replaces the patches ``bool_masked_pos`` marks (masked image
            modelling, SimMIM).

    Parameters (named as transformers' ``ViTEmbeddings``): ``projection`` (the patch convolution), ``cls_token``
    (1, 1, hidden), ``position_embeddings`` (1, 1 + patches, hidden) and, with ``use_mask_token``, ``mask_token``
    (1, 1, hidden).
    """

    def __init__(self, image_size: int | tuple[int, int], patch_size: int | tuple[int, int], num_channels: int,
                 hidden_size: int, use_mask_token: bool = False) -> None:
        super().__init__()
        self.image_size = _pair(image_size)
        self.patch_size = _pair(patch_size)
        self.num_channels = num_channels
        self.grid = (self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1])
        self.num_patches = self.grid[0] * self.grid[1]
        self.projection = nn.Conv2d(num_channels, hidden_size, kernel_size=self.patch_size, stride=self.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden_size))
        self.position_embeddings = nn.Parameter(torch.zeros(1, self.num_patches + 1, hidden_size))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, hidden_size)) if use_mask_token else None

    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False,
                bool_masked_pos: torch.Tensor | None = None) -> torch.Tensor:
        """(B, C, H, W) -> (B, 1 + patches, hidden). Without ``interpolate_pos_encoding`` the images must have the
        size the positions were learned for; with it, any size of at least one patch (a remainder smaller than a
        patch is dropped, as the strided convolution does). ``bool_masked_pos`` (B, patches) replaces the patches it
        marks by the ``mask_token``."""
        pixel_values = self._checked(pixel_values, interpolate_pos_encoding)
        height, width = pixel_values.shape[-2:]
        patches = self.projection(pixel_values.to(self.projection.weight.dtype)).flatten(2).transpose(1, 2)  # (B, N, C)
        if bool_masked_pos is not None:
            if self.mask_token is None:
                raise MindFormersError("bool_masked_pos needs a mask token: this model has none (use_mask_token=False); "
                                       "use ViTForMaskedImageModeling")
            mask = bool_masked_pos.unsqueeze(-1).to(patches.dtype)
            patches = patches * (1.0 - mask) + self.mask_token * mask
        cls = self.cls_token.expand(patches.shape[0], -1, -1)
        embeddings = torch.cat((cls, patches), dim=1)
        positions = self.interpolated_positions(height, width) if interpolate_pos_encoding else self.position_embeddings
        return embeddings + positions

    def interpolated_positions(self, height: int, width: int) -> torch.Tensor:
        """Positions for an image of ``height`` x ``width`` pixels: the learned patch-grid positions resized bicubically
        to that image's grid (the class token's position is kept). As transformers does, the learned table is returned
        as is only for a square image with as many patches as it has positions."""
        learned = self.position_embeddings.shape[1] - 1
        rows, cols = height // self.patch_size[0], width // self.patch_size[1]
        if rows * cols == learned and height == width:
            return self.position_embeddings
        dim = self.position_embeddings.shape[-1]
        side = int(learned**0.5)  # the learned grid is square, as transformers assumes
        grid = self.position_embeddings[:, 1:].reshape(1, side, side, dim).permute(0, 3, 1, 2)  # (1, C, side, side)
        grid = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
        return torch.cat((self.position_embeddings[:, :1], grid.permute(0, 2, 3, 1).reshape(1, -1, dim)), dim=1)

    def _checked(self, pixel_values: torch.Tensor, interpolate: bool) -> torch.Tensor:
        """The pixel values as the projection takes them, or a one-line error naming what does not fit."""
        if pixel_values.dim() != 4:
            raise MindFormersError(f"pixel_values of shape {tuple(pixel_values.shape)} are not a batch of images; "
                                   "expected (batch, channels, height, width), as the image processor returns")
        channels, height, width = pixel_values.shape[1:]
        if channels != self.num_channels:
            if channels == 1 and self.num_channels == 3:  # grayscale to an RGB model: the image's RGB conversion
                pixel_values = pixel_values.expand(-1, 3, -1, -1)
            else:
                raise MindFormersError(
                    f"pixel_values have {channels} channels but the model takes num_channels={self.num_channels}; "
                    "convert the images (e.g. PIL's image.convert('RGB')) before the image processor")
        if interpolate:
            if height < self.patch_size[0] or width < self.patch_size[1]:
                raise MindFormersError(f"an image of {height}x{width} pixels is smaller than one patch "
                                       f"({self.patch_size[0]}x{self.patch_size[1]})")
        elif (height, width) != self.image_size:
            raise MindFormersError(
                f"images of {height}x{width} pixels do not fit the model's patch grid, learned for image_size "
                f"{self.image_size[0]}x{self.image_size[1]}; resize them (the image processor does) or pass "
                "interpolate_pos_encoding=True")
        return pixel_values
