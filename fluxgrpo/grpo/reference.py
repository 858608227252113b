"""What the KL option (``--kl-beta``) pulls the policy towards (each objective's KL is its own: GRPO's is
Flow-GRPO's, in ``objectives/grpo/loss.py``; NFT's and AWM's the mean squared velocity difference).

The reference is behind ``ReferenceModel.reference_prediction``: a LoRA run answers it with the adapter disabled
(the authors' way, no second copy of the weights), full fine-tuning with a frozen copy of the base weights.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from fluxgrpo.grpo.rollout import predict_velocity
from fluxgrpo.grpo.types import Conditioning
from fluxgrpo.runtime.dist import reshard_sharded_modules


class ReferenceModel(Protocol):
    def reference_prediction(
        self,
        latents: torch.Tensor,
        cond: Conditioning,
        timesteps: torch.Tensor,
        guidance: torch.Tensor,
        img_ids: torch.Tensor,
        device_type: str,
        compute_dtype: torch.dtype | None = None,
    ) -> torch.Tensor: ...


class FrozenReference:
    """The base weights, frozen (no gradients, eval mode), in a module of their own: plain or sharded like the
    policy (FSDP2), so it costs one more copy of this rank's shards."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module.requires_grad_(False).eval()

    @torch.no_grad()
    def reference_prediction(
        self,
        latents: torch.Tensor,
        cond: Conditioning,
        timesteps: torch.Tensor,
        guidance: torch.Tensor,
        img_ids: torch.Tensor,
        device_type: str,
        compute_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The reference velocity v_ref at (latents, σ), fed exactly as the policy is."""
        try:
            return predict_velocity(
                self.module, latents, cond, timesteps, guidance, img_ids, device_type, compute_dtype
            ).detach()
        finally:
            reshard_sharded_modules(self.module)


class AdapterDisabledReference:
    """The base model of a LoRA run: the policy itself with its adapters switched off for one forward (diffusers'
    peft integration, ``disable_adapters``/``enable_adapters``). Call it outside the policy's forward-backward (the
    update does, before the policy's forward), so no graph or FSDP2 gather of the policy is in flight."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @torch.no_grad()
    def reference_prediction(
        self,
        latents: torch.Tensor,
        cond: Conditioning,
        timesteps: torch.Tensor,
        guidance: torch.Tensor,
        img_ids: torch.Tensor,
        device_type: str,
        compute_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        was_training = self.module.training
        self.module.eval()  # no adapter dropout either
        self.module.disable_adapters()  # type: ignore[operator]  # a peft/diffusers method reached through nn.Module.__getattr__
        try:
            return predict_velocity(
                self.module, latents, cond, timesteps, guidance, img_ids, device_type, compute_dtype
            ).detach()
        finally:
            self.module.enable_adapters()  # type: ignore[operator]  # a peft/diffusers method reached through nn.Module.__getattr__
            self.module.train(was_training)
            reshard_sharded_modules(self.module)
