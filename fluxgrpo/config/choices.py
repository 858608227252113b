"""The values a training option may take and the bounds it must stay within: what the schema's help texts name
and the checks enforce (fluxgrpo/grpo implements each algorithm choice; they are listed here so validation needs no
torch)."""

from __future__ import annotations

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
MAX_SEED = 2**32 - 1  # numpy's seed range; each rank seeds with --seed + rank, reduced modulo 2**32 for numpy
WANDB_MODES = ("online", "offline", "disabled")
MAX_IMAGE_SIDE = 8192  # 4× FLUX.1-dev's largest trained side; the activations of a larger one fit no device
# Upper bounds far past any published setting, below the values that make every update non-finite and the run
# "succeed" with the base weights (an η of 1e9, say).
SETTING_BOUNDS = {
    "eta": 10.0,
    "learning_rate": 1.0,
    "weight_decay": 10.0,
    "kl_beta": 1e4,
    "guidance": 100.0,
    "shift": 100.0,
}
# The algorithm options' choices.
SAMPLERS = ("dance", "flow-grpo", "cps")
WINDOW_POLICIES = ("sliding", "random", "random-early")
DECODE_SAMPLES = ("x0", "final")
ODE_SOLVERS = ("euler", "dpm2")
RATIO_NORMALIZATIONS = ("none", "grpo-guard")
AGGREGATIONS = ("sum-rewards", "sum-advantages")  # --advantage-aggregation: grpo/advantages.py
# The objectives (--objective), their own choices and what each needs: grpo/objectives/catalogue.py (torch-free).


def flag(name: str) -> str:
    """The command-line flag of a config field, without its dashes: ``num_generations`` → ``num-generations``."""
    return name.replace("_", "-")
