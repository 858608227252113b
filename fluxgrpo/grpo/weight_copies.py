"""The copies of the weights beside the policy's own: the EMA of the trainable weights (``ShardedEMA``), the policy
copies the objectives keep (``PolicyCopy``), and the reference the KL option pulls towards (``ReferenceModel``).

``ShardedEMA``: an exponential moving average of the trainable weights that lives where the weights live.

DanceGRPO gathered the full fp32 model to rank 0's host memory for every EMA update (about 95 GB of host
RAM for FLUX.1-dev). Here each rank keeps the EMA of its own parameter shards only: for an FSDP2
(``fully_shard``) model the EMA tensors are DTensors with the parameters' placements, updated locally with
no communication. Only ``full_state_dict`` (export) gathers, one tensor at a time, to rank 0.

``PolicyCopy``: a second set of the trainable weights that lives where the weights live: DiffusionNFT's old policy
θ_old and AWM's EMA policy, soft-updated towards θ once per iteration.

For a LoRA run the copy holds the adapters only (the authors' named adapter "old" / "ema"); for full fine-tuning it
is a second copy of this rank's parameter shards (DTensors under FSDP2), in the parameters' own dtype, so swapping
it into the model and back is exact. Swapping goes tensor by tensor, so it needs one tensor's worth of scratch, not
a third copy.

``ReferenceModel``: what the KL option (``--kl-beta``) pulls the policy towards (each objective's KL is its own:
GRPO's is Flow-GRPO's, in ``objectives/grpo/loss.py``; NFT's and AWM's the mean squared velocity difference).

The reference is behind ``ReferenceModel.reference_prediction``: a LoRA run answers it with the adapter disabled
(the authors' way, no second copy of the weights), full fine-tuning with a frozen copy of the base weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import distribute_tensor

from fluxgrpo.errors import FluxgrpoError
from fluxgrpo.grpo.rollout import predict_velocity
from fluxgrpo.grpo.types import Conditioning
from fluxgrpo.runtime.dist import reshard_sharded_modules

# Wrappers that insert a path segment into parameter names; EMA keys use the unwrapped (diffusers) names.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def _canonical_name(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a DTensor (a view: writing to it writes the DTensor), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    reshard_sharded_modules(model)
    return {_canonical_name(name): parameter for name, parameter in model.named_parameters() if parameter.requires_grad}


class ShardedEMA:
    """EMA ← decay·EMA + (1−decay)·θ for every trainable parameter, kept in fp32 beside each local shard.

    Works on plain modules and FSDP2 modules alike. ``update``, ``state_dict`` and ``swap_into`` are local
    (no collectives); ``full_state_dict`` is a collective under FSDP2.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        with torch.no_grad():
            self._shadow: dict[str, torch.Tensor] = {
                name: parameter.detach().to(torch.float32, copy=True)
                for name, parameter in _trainable_parameters(model).items()
            }

    def _matched(self, model: nn.Module) -> list[tuple[torch.Tensor, nn.Parameter]]:
        parameters = _trainable_parameters(model)
        if parameters.keys() != self._shadow.keys():
            missing = sorted(self._shadow.keys() - parameters.keys())[:3]
            extra = sorted(parameters.keys() - self._shadow.keys())[:3]
            raise FluxgrpoError(
                f"the model's trainable parameters no longer match the EMA's (missing {missing}, new {extra}): "
                "build the EMA from the model being trained"
            )
        return [(self._shadow[name], parameter) for name, parameter in parameters.items()]

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One EMA step towards the model's current weights (call after each optimizer step)."""
        pairs = self._matched(model)
        shadows = [_local(shadow) for shadow, _ in pairs]
        weights = [_local(parameter).to(torch.float32) for _, parameter in pairs]
        torch._foreach_lerp_(shadows, weights, 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameter name → EMA tensor (DTensor under FSDP2): the live tensors, ready for DCP."""
        return dict(self._shadow)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy saved EMA values in place. Accepts sharded (DTensor) values (local) or full plain tensors, which
        are distributed to the EMA's placements (a collective under FSDP2)."""
        if state.keys() != self._shadow.keys():
            missing = sorted(self._shadow.keys() - state.keys())[:3]
            extra = sorted(state.keys() - self._shadow.keys())[:3]
            raise FluxgrpoError(
                f"the EMA state does not match the model (missing {missing}, unexpected {extra}): resume with the "
                "model configuration the checkpoint was trained with"
            )
        for name, shadow in self._shadow.items():
            value = state[name]
            placements = getattr(shadow, "placements", None)
            if placements is not None and getattr(value, "placements", None) is None:
                value = distribute_tensor(value.to(shadow.device), shadow.device_mesh, placements)  # type: ignore[attr-defined]  # the shadow is a DTensor when placements are set
            _local(shadow).copy_(_local(value))

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """Parameter name → full fp32 CPU tensor, for export.

        Under FSDP2 this is a collective (call it on every rank). Tensors are gathered one at a time and, with
        ``rank0_only``, kept on rank 0 only (other ranks get ``{}``): a full copy per rank would cost
        ranks × 47.6 GB of host memory for FLUX.1-dev on one node.
        """

        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
        out = {}
        for name, shadow in self._shadow.items():
            full_tensor = getattr(shadow, "full_tensor", None)
            full = full_tensor() if callable(full_tensor) else shadow
            if keep:
                out[name] = full.detach().to("cpu", copy=True)
        return out

    @contextlib.contextmanager
    def swap_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """Temporarily load the EMA weights into ``model`` (e.g. to sample); the trained weights come back
        on exit, even on error. Costs one extra copy of this rank's shards while inside."""
        pairs = self._matched(model)
        with torch.no_grad():
            backups = [_local(parameter).clone() for _, parameter in pairs]
            for shadow, parameter in pairs:
                _local(parameter).copy_(_local(shadow))
        try:
            yield model
        finally:
            reshard_sharded_modules(model)
            with torch.no_grad():
                for backup, (_, parameter) in zip(backups, pairs, strict=True):
                    _local(parameter).copy_(backup)


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
