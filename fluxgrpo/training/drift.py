"""Drift signals measured every iteration, cheap enough to log always: the velocity-norm ratio of the policy to the
reference on the steps the update is about to train.

RL fine-tuning of flow models inflates the predicted velocity's norm (5–15 % is typical; above 1.05 is a published
alarm threshold), long before the images look wrong. Each iteration, after the rollout and before the update, the
probe takes this rank's first ``train_micro_batch_size`` trajectories at exactly the σ-steps the update will train
them on (the update's timestep draw, replayed from a copy of its generator, so training draws nothing more) and
runs the policy on them without gradients: the weights that made this rollout (after k − 1 updates at iteration k).

``velocity_norm_ratio`` = mean over the probed σ-steps of  Σ‖v_policy‖ / Σ‖v_reference‖  (sums over the probed
samples of that step and every rank; ‖·‖ the L2 norm over a sample's latent elements, in float32). The reference:

- ``paired`` — a LoRA run (the policy with its adapters disabled, no second copy) or a full fine-tune with
  ``--kl-beta`` (the KL's frozen base copy): the reference's velocity at the same inputs. One more forward per
  probed step.
- ``iteration-1`` — a full fine-tune without ``--kl-beta`` holds no base weights, and a second copy of the
  transformer only for a log line is not cheap. The reference is then the base model's own mean ‖v‖ per σ-step,
  recorded by this probe at the run's first iteration (the policy *is* the base model then) and kept in the
  checkpoint. Later iterations compare their ‖v‖ to it on different prompts and noise, so the value carries
  sampling noise that the paired ratio does not; a σ-step the first iteration did not probe is left out.

Both are exactly 1.0 at the run's first iteration (each step's ratio is x / x; paired: the reference forward is the
same computation on the same weights — on CPU bit for bit; on accelerators a full fine-tune's bf16 base copy can
differ from the fp32 master weights by bf16 rounding). Nothing here touches a training RNG or the weights, so
training numbers are the same with and without it. Its time counts in the iteration's ``seconds_rollout``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from fluxgrpo.grpo.objectives.grpo.loss import draw_train_timesteps
from fluxgrpo.grpo.rollout import predict_velocity
from fluxgrpo.grpo.schedule import model_timesteps
from fluxgrpo.grpo.weight_copies import AdapterDisabledReference
from fluxgrpo.lora import is_lora_model
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.dist import reshard_sharded_modules

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig
    from fluxgrpo.grpo.types import Conditioning
    from fluxgrpo.grpo.weight_copies import ReferenceModel
    from fluxgrpo.training.parts import TrainingParts

PAIRED, FIRST_ITERATION = "paired", "iteration-1"


class DriftProbe:
    """The per-iteration velocity-norm probe of one rank (a collective: call it on every rank)."""

    def __init__(self, cfg: TrainConfig, parts: TrainingParts, state: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.parts = parts
        if parts.reference is not None:
            self.reference: ReferenceModel | None = parts.reference
        elif is_lora_model(parts.transformer):
            self.reference = AdapterDisabledReference(parts.transformer)
        else:
            self.reference = None
        self.mode = PAIRED if self.reference is not None else FIRST_ITERATION
        # iteration-1 mode: σ-step index (as a string, JSON keys) → the base model's mean ‖v‖ there
        self.base_norms: dict[str, float] = dict((state or {}).get("base_norms", {}))

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "base_norms": dict(self.base_norms)}

    @torch.no_grad()
    def measure(self, iteration: int, rollout: Any, cond: Conditioning, timestep_generator: torch.Generator) -> dict:
        """``{"velocity_norm_ratio": r}`` at ``iteration`` (NaN when nothing comparable was probed, and for the
        objectives that keep no trajectory to probe: ``--objective nft/awm``)."""
        if not hasattr(rollout, "latents"):  # FinalSamples: the final latents only
            return {"velocity_norm_ratio": math.nan}

        ctx, transformer = self.parts.ctx, self.parts.transformer
        replay = torch.Generator().manual_seed(0)
        replay.set_state(timestep_generator.get_state())  # the update's own draw, without consuming it
        indices = draw_train_timesteps(
            rollout.num_trajectories, rollout.trainable, self.cfg.train_timesteps, replay
        )  # [B, T]
        rows = min(self.cfg.train_micro_batch_size, rollout.num_trajectories)
        device = cond.prompt_embeds.device
        steps = rollout.num_steps
        policy_sum = torch.zeros(steps, dtype=torch.float32, device=device)
        reference_sum = torch.zeros(steps, dtype=torch.float32, device=device)
        counts = torch.zeros(steps, dtype=torch.float32, device=device)
        sigmas = rollout.sigmas.to(device=device, dtype=torch.float32)
        fed_table = model_timesteps(sigmas)
        probe_cond = cond.rows(0, rows)
        guidance = torch.full((rows,), rollout.guidance, dtype=torch.float32, device=device)
        row_index = torch.arange(rows, device=device)
        was_training = transformer.training
        transformer.eval()
        try:
            for k in range(indices.shape[1]):
                step = indices[:rows, k].to(device)
                latents = rollout.latents[row_index, step].to(device)
                fed = fed_table[step]
                velocity = predict_velocity(
                    transformer, latents, probe_cond, fed, guidance, rollout.img_ids.to(device), ctx.device_type
                )
                reshard_sharded_modules(transformer)
                policy_sum.index_add_(0, step, _norms(velocity))
                counts.index_add_(0, step, torch.ones(rows, dtype=torch.float32, device=device))
                if self.reference is not None:
                    reference_velocity = self.reference.reference_prediction(
                        latents, probe_cond, fed, guidance, rollout.img_ids.to(device), ctx.device_type
                    )
                    reference_sum.index_add_(0, step, _norms(reference_velocity))
        finally:
            transformer.train(was_training)
        packed = torch.stack([policy_sum, reference_sum, counts])
        rt_dist.all_reduce_sum(ctx, packed)
        policy, reference, count = packed.tolist()
        return {"velocity_norm_ratio": self._ratio(iteration, policy, reference, count)}

    def _ratio(self, iteration: int, policy: list[float], reference: list[float], count: list[float]) -> float:
        recording = self.mode == FIRST_ITERATION and iteration == 1  # the policy is still the base model
        ratios = []
        for step, (pol, ref, n) in enumerate(zip(policy, reference, count, strict=True)):
            if not n:
                continue
            if self.mode == PAIRED:
                ratios.append(pol / ref if ref else math.nan)
                continue
            mean, key = pol / n, str(step)
            if recording:
                self.base_norms[key] = mean
            if key in self.base_norms:
                base = self.base_norms[key]
                ratios.append(mean / base if base else math.nan)
        return math.fsum(ratios) / len(ratios) if ratios else math.nan


def _norms(velocity: torch.Tensor) -> torch.Tensor:
    """[b] L2 norm of each sample's velocity over its latent elements, float32."""
    return velocity.float().flatten(1).norm(dim=1)
