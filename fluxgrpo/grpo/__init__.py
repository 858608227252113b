"""The GRPO algorithm for FLUX (DanceGRPO's math) and its peers, as pure stage functions the training loop calls.

    sigma_schedule → generate_rollout → (decode, reward) → group_advantages → policy_update → ShardedEMA.update

``objectives/`` holds what an update trains on behind one seam (``--objective grpo|nft|awm|vgrpo|neighbor``);
``update.run_update`` drives any of them. Nothing here imports the run's packages (config, training, checkpoint, metrics, models).

Every function is generic over a module with FluxTransformer2DModel's forward, plain or FSDP2-sharded.
"""

from fluxgrpo.grpo.advantages import GroupAdvantages, group_advantages
from fluxgrpo.grpo.ema import ShardedEMA
from fluxgrpo.grpo.latents import LatentShape, image_ids, latent_shape, pack_latents, unpack_latents
from fluxgrpo.grpo.loss import LossStats, clipped_policy_loss
from fluxgrpo.grpo.rollout import generate_rollout, predict_velocity
from fluxgrpo.grpo.schedule import model_timesteps, sigma_schedule
from fluxgrpo.grpo.sde import SdeStep, sde_step
from fluxgrpo.grpo.types import Conditioning, Rollout, UpdateStats
from fluxgrpo.grpo.update import UpdateSettings, draw_train_timesteps, optimizer_step, policy_update

__all__ = [
    "Conditioning",
    "GroupAdvantages",
    "LatentShape",
    "LossStats",
    "Rollout",
    "SdeStep",
    "ShardedEMA",
    "UpdateSettings",
    "UpdateStats",
    "clipped_policy_loss",
    "draw_train_timesteps",
    "generate_rollout",
    "group_advantages",
    "image_ids",
    "latent_shape",
    "model_timesteps",
    "optimizer_step",
    "pack_latents",
    "policy_update",
    "predict_velocity",
    "sde_step",
    "sigma_schedule",
    "unpack_latents",
]
