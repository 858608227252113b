"""Training objectives behind one seam (``base.Objective``): ``grpo`` (PPO-clip on per-step log-probs),
``nft`` (DiffusionNFT), ``awm`` (Advantage-Weighted Matching) and ``vgrpo`` (V-GRPO) on final samples, ``neighbor``
(Neighbor GRPO) on the ODE paths of a neighbourhood of initial noises."""

from fluxgrpo.grpo.objectives.base import Metric, MetricTally, Objective, StepResult, UpdateWork

OBJECTIVES = ("grpo", "nft", "awm", "vgrpo", "neighbor")

__all__ = ["OBJECTIVES", "Metric", "MetricTally", "Objective", "StepResult", "UpdateWork"]
