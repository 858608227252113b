"""Which prompts each rank trains on, deterministic from the seed, with a position that checkpoints save.

Each epoch is a fresh permutation of the dataset (seeded by ``seed + epoch``; DanceGRPO never advanced the
epoch, so it replayed one order forever). Ranks take interleaved slices of it; when the dataset does not
divide evenly the permutation wraps, as torch's DistributedSampler pads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0  # prompts this rank has consumed in the current epoch


class PromptSampler:
    """Draws ``batch_size`` dataset indices per call for one rank."""

    def __init__(self, num_prompts: int, *, rank: int, world_size: int, batch_size: int, seed: int) -> None:
        if num_prompts < 1:
            raise ValueError("no prompts to sample from")
        self.num_prompts = num_prompts
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.seed = seed
        self.state = SamplerState()
        self._shard: list[int] | None = None

    def _epoch_shard(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.num_prompts, generator=generator).tolist()
        per_rank = -(-self.num_prompts // self.world_size)  # ceil
        total = per_rank * self.world_size
        padded = (order * (total // len(order) + 1))[:total]
        return padded[self.rank :: self.world_size]

    def next_batch(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.batch_size:
            if self._shard is None:
                self._shard = self._epoch_shard(self.state.epoch)
            if self.state.position >= len(self._shard):
                self.state = SamplerState(self.state.epoch + 1, 0)
                self._shard = None
                continue
            out.append(self._shard[self.state.position])
            self.state.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = SamplerState(**state)
        self._shard = None
