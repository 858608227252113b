"""FLUX latent geometry: 2×2 packing of VAE latents into tokens, and the image position ids.

A [B, 16, h, w] VAE latent (h = height/8) becomes [B, (h/2)·(w/2), 64] tokens. Token (r, c) holds the
2×2 patch at latent rows 2r…2r+1, columns 2c…2c+1, and its channel index is ``c·4 + dy·2 + dx``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VAE_SCALE_FACTOR = 8  # the FLUX VAE downsamples by 8
LATENT_CHANNELS = 16
PATCH = 2  # 2×2 packing, so pixels must be a multiple of 8·2 = 16


@dataclass(frozen=True)
class LatentShape:
    """Sizes derived from an image size."""

    channels: int  # 16 VAE latent channels
    latent_height: int  # height / 8
    latent_width: int  # width / 8
    num_tokens: int  # L = (height/16)·(width/16)
    token_dim: int  # C = 16·4 = 64

    @property
    def unpacked(self) -> tuple[int, int, int]:
        """(16, h, w): one VAE latent without the batch axis."""
        return (self.channels, self.latent_height, self.latent_width)

    @property
    def packed(self) -> tuple[int, int]:
        """(L, C): one packed latent without the batch axis."""
        return (self.num_tokens, self.token_dim)


def image_size_problem(height: int, width: int) -> str | None:
    """Why ``height``×``width`` pixels cannot be a FLUX image, or None when they can (positive multiples of 16).

    The text names no flag: a command adds how to fix it in its own terms."""
    multiple = VAE_SCALE_FACTOR * PATCH
    if height <= 0 or width <= 0 or height % multiple or width % multiple:
        return (
            f"image size {height}×{width} is not a positive multiple of {multiple} (the VAE's 8× downsampling "
            f"times FLUX's 2×2 packing)"
        )
    return None


def latent_shape(height: int, width: int) -> LatentShape:
    """Latent and token sizes for an image of ``height``×``width`` pixels (multiples of 16).

    Raises:
        ValueError: the size is not a positive multiple of 16 (``image_size_problem``).
    """
    problem = image_size_problem(height, width)
    if problem is not None:
        raise ValueError(problem)
    latent_height, latent_width = height // VAE_SCALE_FACTOR, width // VAE_SCALE_FACTOR
    return LatentShape(
        channels=LATENT_CHANNELS,
        latent_height=latent_height,
        latent_width=latent_width,
        num_tokens=(latent_height // PATCH) * (latent_width // PATCH),
        token_dim=LATENT_CHANNELS * PATCH * PATCH,
    )


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, c, h, w] → [B, (h/2)·(w/2), 4c], tokens row-major over the (h/2)×(w/2) grid."""
    batch, channels, height, width = latents.shape
    if height % PATCH or width % PATCH:
        raise ValueError(f"latent height and width must be even to pack 2×2, got {height}×{width}")
    patches = latents.reshape(batch, channels, height // PATCH, PATCH, width // PATCH, PATCH)
    patches = patches.permute(0, 2, 4, 1, 3, 5)  # B, rows, cols, c, dy, dx
    return patches.reshape(batch, (height // PATCH) * (width // PATCH), channels * PATCH * PATCH)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Exact inverse of ``pack_latents`` for an image of ``height``×``width`` pixels: [B, L, 4c] → [B, c, h, w]."""
    shape = latent_shape(height, width)
    batch, num_tokens, token_dim = tokens.shape
    if num_tokens != shape.num_tokens:
        raise ValueError(f"{num_tokens} tokens do not make a {height}×{width} image ({shape.num_tokens} expected)")
    rows, cols = shape.latent_height // PATCH, shape.latent_width // PATCH
    channels = token_dim // (PATCH * PATCH)
    patches = tokens.reshape(batch, rows, cols, channels, PATCH, PATCH)
    patches = patches.permute(0, 3, 1, 4, 2, 5)  # B, c, rows, dy, cols, dx
    return patches.reshape(batch, channels, shape.latent_height, shape.latent_width)


def image_ids(
    height: int, width: int, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[L, 3] position ids: token (r, c) of the (height/16)×(width/16) grid gets [0, r, c], row-major.

    The order matches ``pack_latents``. Values are small integers, exact in bf16 too.
    """
    shape = latent_shape(height, width)
    rows, cols = shape.latent_height // PATCH, shape.latent_width // PATCH
    ids = torch.zeros(rows, cols, 3, dtype=torch.float32)
    ids[..., 1] = torch.arange(rows, dtype=torch.float32)[:, None]
    ids[..., 2] = torch.arange(cols, dtype=torch.float32)[None, :]
    return ids.reshape(rows * cols, 3).to(device=device, dtype=dtype)
