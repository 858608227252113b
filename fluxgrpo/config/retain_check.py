"""When ``--retain-rollout-graphs`` (``grpo/retain.py``) is the same math as the recomputing update, and when it is
refused: each problem one line naming the flag."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from fluxgrpo.grpo.objectives.catalogue import CATALOGUE

if TYPE_CHECKING:
    from fluxgrpo.config.schema import TrainConfig

FLAG = "--retain-rollout-graphs"


def retain_problems(cfg: TrainConfig) -> list[str]:
    """Empty when the flag is off, or on where it is exact and supported."""
    if not cfg.retain_rollout_graphs:
        return []
    entry = CATALOGUE.get(cfg.objective)
    if entry is None or not entry.keeps_trajectory:
        return [
            f"{FLAG} keeps the SDE rollout's forwards of the trained steps: --objective {cfg.objective} rolls out with "
            "the ODE and trains at fresh inputs, so there is nothing to keep; use --objective grpo or drop the flag"
        ]
    out = []
    micro_batches = math.ceil(cfg.trained_samples_per_rank / max(cfg.train_micro_batch_size, 1))
    steps = math.ceil(micro_batches / max(cfg.gradient_accumulation_steps, 1))
    if steps > 1:
        out.append(
            f"{FLAG} needs one optimizer step per rollout (after a step the kept forwards hold the old weights): this "
            f"config takes {steps} ({micro_batches} micro-batches, --gradient-accumulation-steps "
            f"{cfg.gradient_accumulation_steps}); set --gradient-accumulation-steps {micro_batches} or drop the flag"
        )
    if cfg.lora_rank > 0 and cfg.lora_dropout > 0:
        out.append(
            f"{FLAG} with --lora-dropout {cfg.lora_dropout}: the rollout samples without dropout, the update's forward "
            "drops, so the kept forward is not the update's; use --lora-dropout 0 or drop the flag"
        )
    if cfg.cpu_offload:
        out.append(
            f"{FLAG} with --cpu-offload: kept forwards of offloaded shards are not tested, and offloading is for a run "
            "short of memory, which the kept activations make shorter; drop one of the two flags"
        )
    return out
