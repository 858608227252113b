"""The structure smoke-test reward (no weights): similarity to a fixed target image under a fixed random feature map."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fluxgrpo.rewards.base import check_batch
from fluxgrpo.rewards.registry import RewardRecord

if TYPE_CHECKING:
    import torch

SIZE, FEATURES, SEED = 64, 32, 0


class StructureReward:
    """SMOKE TEST ONLY, not a measure of quality: the cosine similarity, in [−1, 1], between an image's features and a
    fixed target's, the features being a fixed random map (8×8 convolution, stride 4, ReLU, 4×4 average pool).

    Unlike ``brightness`` it needs spatial structure: the target is a smooth two-colour blob pattern (seed 0) that no
    uniform change of the image can reach, so early (layout) and late (detail) denoising steps matter differently.
    Deterministic: the target and the map come from a fixed seed; images are resized to 64² first.
    """

    name = "structure"

    def __init__(self) -> None:
        import torch

        generator = torch.Generator().manual_seed(SEED)
        self.filters = torch.randn(FEATURES, 3, 8, 8, generator=generator) / 8.0
        # a few Gaussian blobs of random colours on a grey background: low-frequency layout, no fine texture
        grid = torch.linspace(-1, 1, SIZE)
        y, x = torch.meshgrid(grid, grid, indexing="ij")
        target = torch.full((3, SIZE, SIZE), 0.5)
        for _ in range(4):
            centre = torch.rand(2, generator=generator) * 1.6 - 0.8
            colour = torch.rand(3, 1, 1, generator=generator) - 0.5
            blob = torch.exp(-((x - centre[0]) ** 2 + (y - centre[1]) ** 2) / 0.08)
            target = target + colour * blob
        self.target_image = target.clamp(0, 1)  # [3, 64, 64] in [0, 1]
        self.target_features = self._features(self.target_image[None])

    def _features(self, images: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        resized = F.interpolate(images.float(), size=(SIZE, SIZE), mode="bilinear", align_corners=False)
        maps = F.relu(F.conv2d(resized - 0.5, self.filters.to(resized.device), stride=4))
        return F.adaptive_avg_pool2d(maps, 4).flatten(1)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        import torch.nn.functional as F

        check_batch(images, prompts)
        features = self._features(images)
        return F.cosine_similarity(features, self.target_features.to(features.device), dim=1)


def _load(hps_dir: Path, device: torch.device | str, dtype: torch.dtype) -> StructureReward:
    return StructureReward()


RECORD = RewardRecord("structure", _load)  # no weights
