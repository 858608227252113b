"""Training objectives behind one seam (``base.Objective``): ``grpo`` (PPO-clip on per-step log-probs),
``nft`` (DiffusionNFT) and ``awm`` (Advantage-Weighted Matching) on final samples."""

from fluxgrpo.grpo.objectives.base import Metric, MetricTally, Objective, StepResult, UpdateWork

OBJECTIVES = ("grpo", "nft", "awm")

__all__ = ["OBJECTIVES", "Metric", "MetricTally", "Objective", "StepResult", "UpdateWork"]
