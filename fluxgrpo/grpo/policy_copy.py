"""A second set of the trainable weights that lives where the weights live: DiffusionNFT's old policy θ_old and
AWM's EMA policy, soft-updated towards θ once per iteration.

For a LoRA run the copy holds the adapters only (the authors' named adapter "old" / "ema"); for full fine-tuning it
is a second copy of this rank's parameter shards (DTensors under FSDP2), in the parameters' own dtype, so swapping
it into the model and back is exact. Swapping goes tensor by tensor, so it needs one tensor's worth of scratch, not
a third copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from fluxgrpo.grpo.ema import ShardedEMA, _local
from fluxgrpo.runtime.dist import reshard_sharded_modules


class PolicyCopy(ShardedEMA):
    """θ_c, initialised to θ; ``blend`` sets θ_c ← d·θ_c + (1−d)·θ; ``swapped_in`` runs the model with θ_c."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, decay=0.0)
        with torch.no_grad():  # the parameters' own dtype (fp32 master weights): a swap is a pure exchange
            pairs = self._matched(model)
            for name, (_, parameter) in zip(list(self._shadow), pairs, strict=True):
                self._shadow[name] = parameter.detach().clone()

    @torch.no_grad()
    def blend(self, model: nn.Module, decay: float) -> None:
        """θ_c ← decay·θ_c + (1−decay)·θ (decay 0: θ_c = θ exactly)."""
        for shadow, parameter in self._matched(model):
            local_shadow, local_parameter = _local(shadow), _local(parameter)
            if decay == 0:
                local_shadow.copy_(local_parameter)
            else:
                local_shadow.mul_(decay).add_(local_parameter.to(local_shadow.dtype), alpha=1.0 - decay)

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[nn.Module]:
        """Run ``model`` with θ_c; θ comes back exactly on exit (the two sets are exchanged, then exchanged back)."""
        self._exchange(model)
        try:
            yield model
        finally:
            reshard_sharded_modules(model)
            self._exchange(model)

    @torch.no_grad()
    def _exchange(self, model: nn.Module) -> None:
        for shadow, parameter in self._matched(model):
            local_shadow, local_parameter = _local(shadow), _local(parameter)
            scratch = local_parameter.clone()
            local_parameter.copy_(local_shadow)
            local_shadow.copy_(scratch)
