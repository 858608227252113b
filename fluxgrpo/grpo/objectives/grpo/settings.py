"""``--objective grpo``'s catalogue entry (torch-free): the SDE trajectory with its log-probs; no flags of its own
(its sampler, window and ratio are the run's rollout settings)."""

from __future__ import annotations

from fluxgrpo.grpo.objectives.entry import ObjectiveEntry

# The last transition cannot change the reward, so it never trains: the SDE window, or N−1.
ENTRY = ObjectiveEntry(
    "grpo",
    "fluxgrpo.grpo.objectives.grpo.loss:GrpoObjective",
    keeps_trajectory=True,
    trainable_timesteps=lambda cfg: cfg.sde_window or cfg.sampling_steps - 1,
    summary="PPO-clip on the SDE's per-step log-probs",
)
