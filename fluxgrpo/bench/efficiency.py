"""Learning efficiency: what each training algorithm buys per second of training, trained for real, side by side.

``fluxgrpo bench --algorithms dance,dance-t2 --iterations 30`` trains each named algorithm in turn with the real
loop (``grpo.trainer.train``), in this process, from the same start: the same tiny weights (written once, seeded by
``--seed``), the same prompt embeddings (the bundled prompts, encoded once by the tiny text encoders), the same
training config (``--config``, tiny-cpu by default: its reward, resolution, steps and batch sizes) and so the same
prompts and initial noise at every iteration. An algorithm is a name for a set of ``TrainConfig`` overrides
(``ALGORITHMS``); ``dance`` overrides nothing and is the baseline every ratio is taken against.

For each algorithm:

- **seconds per iteration**: the median over the iterations of rollout + decode/reward + update, as the trainer's
  own phase clock measured them (the median keeps the first iteration's one-time costs and a busy machine's
  spikes out);
- **reward gain**: the rise of the least-squares line through the iterations' mean rewards over the run,
  slope × (iterations − 1). Each algorithm's rewards are of its own rollouts, so a sampler that starts higher or
  lower does not count as learning; the fit uses every iteration instead of two noisy ends;
- **reward gain per second**: the gain over the training time, median seconds per iteration × iterations;

and each as a ratio to ``dance``'s (None where ``dance``'s value is not positive: a ratio to nothing is no ratio).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.errors import UsageError

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig

BASELINE = "dance"
DEFAULT_CONFIG = "tiny-cpu"
# The loop's phase clock (``trainer.PhaseClock``): their sum is one iteration's training time.
PHASE_SECONDS = ("seconds_rollout", "seconds_decode_reward", "seconds_update")


def _trained_transitions(count: int) -> Callable[[TrainConfig], dict[str, Any]]:
    """Overrides that train exactly ``count`` of the N − 1 transitions per trajectory, whatever N is: the update
    cost of a ``count``-step SDE window, with DanceGRPO's random choice of which transitions."""

    def overrides(base: TrainConfig) -> dict[str, Any]:
        # int((N − 1)·f) is exactly count for f = (count + ½)/(N − 1), whatever the float rounding.
        return {"timestep_fraction": min(1.0, (count + 0.5) / (base.sampling_steps - 1))}

    return overrides


# MixGRPO's window (Flow-GRPO's SDE at η 0.7 on 4 consecutive steps, all trained, moving by 1 step towards the data).
MIXGRPO_WINDOW = {
    "sampler": "flow-grpo",
    "eta": 0.7,
    "sde_window": 4,
    "sde_window_policy": "sliding",
    "sde_window_stride": 1,
    "timestep_fraction": 1.0,
}


@dataclass(frozen=True)
class Algorithm:
    """A training algorithm as the bench knows it: ``TrainConfig`` overrides, given the base config."""

    name: str
    description: str
    overrides: Callable[[TrainConfig], dict[str, Any]] = field(default=lambda base: {})


ALGORITHMS: dict[str, Algorithm] = {
    algorithm.name: algorithm
    for algorithm in (
        Algorithm(BASELINE, "DanceGRPO as configured: SDE at every step, --timestep-fraction of them trained"),
        Algorithm("dance-t2", "dance, 2 trained transitions per trajectory", _trained_transitions(2)),
        Algorithm("dance-t4", "dance, 4 trained transitions per trajectory", _trained_transitions(4)),
        # The peers' methods with their authors' FLUX settings (as the a3-16die-* presets): every window step
        # trains, ODE outside the window. Their noise level comes with the sampler; the rest is --config's.
        Algorithm(
            "mixgrpo",
            "MixGRPO: Flow-GRPO's SDE (η 0.7) on a 4-step window sliding every 25 iterations, Euler ODE elsewhere",
            lambda base: {**MIXGRPO_WINDOW, "sde_window_shift_every": 25, "ode_solver": "euler"},
        ),
        Algorithm(
            "mixgrpo-flash",
            "MixGRPO-Flash: mixgrpo's window sliding every 20 iterations, DPM-Solver++ 2M on 40 % of the steps after it",
            lambda base: {
                **MIXGRPO_WINDOW,
                "sde_window_shift_every": 20,
                "ode_solver": "dpm2",
                "ode_compress_ratio": 0.4,
            },
        ),
        Algorithm(
            "mixgrpo-flash-w2",
            "mixgrpo-flash with a 2-step window that stays at the start: the fewest model calls",
            lambda base: {
                **MIXGRPO_WINDOW,
                "sde_window": 2,
                "sde_window_shift_every": 0,
                "ode_solver": "dpm2",
                "ode_compress_ratio": 0.4,
            },
        ),
        Algorithm(
            "flow-grpo-fast",
            "Flow-GRPO-Fast: the CPS SDE (η 0.8) on the first 3 steps only, Euler ODE after them",
            lambda base: {
                "sampler": "cps",
                "eta": 0.8,
                "sde_window": 3,
                "sde_window_policy": "sliding",
                "sde_window_shift_every": 0,
                "timestep_fraction": 1.0,
            },
        ),
        Algorithm(
            "cps",
            "dance with the coefficients-preserving SDE (η 0.8) at every step",
            lambda base: {"sampler": "cps", "eta": 0.8},
        ),
    )
}


@dataclass(frozen=True)
class EfficiencyConfig:
    """What to compare. ``base_overrides`` change the base training config for every algorithm alike."""

    algorithms: tuple[str, ...] = (BASELINE,)
    iterations: int = 30
    config: str = DEFAULT_CONFIG  # a shipped config name or a YAML file: the training settings
    text_tokens: int = 512  # T5 tokens per prompt, as `fluxgrpo preprocess` pads to by default
    seed: int = 0  # of the tiny weights (`fetch-weights --source tiny` uses 0)
    device: str | None = None  # None: the config's
    base_overrides: dict[str, Any] = field(default_factory=dict)

    def problems(self) -> list[str]:
        out = []
        unknown = [name for name in self.algorithms if name not in ALGORITHMS]
        if unknown:
            out.append(f"--algorithms: unknown {', '.join(map(repr, unknown))}; known: {', '.join(ALGORITHMS)}")
        if len(set(self.algorithms)) != len(self.algorithms):
            out.append(f"--algorithms {','.join(self.algorithms)} names one algorithm twice")
        if self.iterations < 2:
            out.append(f"--iterations {self.iterations}: at least 2 (a reward gain needs two iterations)")
        if self.text_tokens < 1:
            out.append(f"--text-tokens {self.text_tokens} must be at least 1")
        return out

    def validate(self) -> EfficiencyConfig:
        problems = self.problems()
        if problems:
            raise UsageError("invalid bench settings:\n  - " + "\n  - ".join(problems))
        return self

    @property
    def runs(self) -> tuple[str, ...]:
        """The algorithms in the order they train: the baseline first (added when not asked for)."""
        return (BASELINE, *(name for name in self.algorithms if name != BASELINE))


def parse_algorithms(text: str) -> tuple[str, ...]:
    """'dance, dance-t2' → ('dance', 'dance-t2'), in the given order."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise UsageError(f"--algorithms {text!r}: name at least one of {', '.join(ALGORITHMS)}")
    return names


# --------------------------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Workspace:
    """What every algorithm trains from: tiny weights and the bundled prompts' embeddings."""

    flux_dir: Path
    hps_dir: Path
    index_path: Path
    runs_dir: Path


def prepare_workspace(root: Path, seed: int, text_tokens: int, log: Callable[[str], None]) -> Workspace:
    """Write the tiny weights (seeded) and encode the bundled prompts with the tiny text encoders, under ``root``."""
    from fluxgrpo.data.prompts import bundled_prompts_path
    from fluxgrpo.models.tiny_weights import write_tiny_weights
    from fluxgrpo.preprocess import preprocess

    flux_dir, hps_dir = root / "flux", root / "hps_ckpt"
    log(f"writing the tiny weights (seed {seed}) and encoding the bundled prompts ({text_tokens} T5 tokens)")
    write_tiny_weights(flux_dir, hps_dir, seed=seed)
    summary = preprocess(bundled_prompts_path(), flux_dir, root / "rl_embeddings", text_tokens, device="cpu")
    return Workspace(flux_dir, hps_dir, Path(summary.index_path), root / "runs")


def base_training_config(cfg: EfficiencyConfig, workspace: Workspace) -> TrainConfig:
    """``--config`` with the workspace's inputs and the run's length: what every algorithm shares."""
    from fluxgrpo.config import build_config

    return build_config(
        cfg.config,
        {
            **cfg.base_overrides,
            "model": str(workspace.flux_dir),
            "hps_dir": str(workspace.hps_dir),
            "data_json_path": str(workspace.index_path),
            "output_dir": str(workspace.runs_dir),
            "max_train_steps": cfg.iterations,
            "checkpointing_steps": cfg.iterations,  # one checkpoint, after the last iteration (outside the clock)
            "save_images_every": 0,
            "tensorboard": False,
            "wandb": False,
            "device": cfg.device,
        },
    )


def algorithm_config(base: TrainConfig, name: str) -> TrainConfig:
    """The base config with the algorithm's overrides, in a run folder of its own; validated."""
    overrides = ALGORITHMS[name].overrides(base)
    return dataclasses.replace(base, output_dir=str(Path(base.output_dir, name)), **overrides).validate()


# Where the runs' inputs and outputs were: a temporary folder, gone when the bench ends.
WORKSPACE_FIELDS = ("model", "hps_dir", "data_json_path", "output_dir")


def reward_gain(rewards: list[float]) -> float:
    """The least-squares line's rise over the run: slope × (n − 1), with the iterations as x (n ≥ 2)."""
    count = len(rewards)
    x_mean, y_mean = (count - 1) / 2, statistics.fmean(rewards)
    covariance = sum((x - x_mean) * (y - y_mean) for x, y in enumerate(rewards))
    variance = sum((x - x_mean) ** 2 for x in range(count))
    return covariance / variance * (count - 1)


def summarize_run(
    name: str, overrides: dict[str, Any], train_cfg: TrainConfig, records: list[dict[str, Any]]
) -> dict[str, Any]:
    """One algorithm's row (before ratios) from its config and its metrics records."""
    rewards = [float(record["reward_mean"]) for record in records]
    seconds = [sum(float(record[key]) for key in PHASE_SECONDS) for record in records]
    per_iteration = statistics.median(seconds)
    gain = reward_gain(rewards)
    return {
        "algorithm": name,
        "overrides": overrides,
        "iterations": len(records),
        "trained_timesteps": train_cfg.train_timesteps,
        "rollout_model_calls": train_cfg.rollout_model_calls,
        "seconds_per_iteration": per_iteration,
        "phase_seconds": {
            key.removeprefix("seconds_"): statistics.median(r[key] for r in records) for key in PHASE_SECONDS
        },
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "reward_gain": gain,
        "reward_gain_per_second": gain / (per_iteration * len(records)),
        "rewards": rewards,
    }


RATIO_KEYS = ("seconds_per_iteration", "reward_gain", "reward_gain_per_second")


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with ``<key>_ratio`` for the ``RATIO_KEYS``: its value over the baseline row's (None when the
    baseline's is not positive)."""
    baseline = next(row for row in rows if row["algorithm"] == BASELINE)
    out = []
    for row in rows:
        ratios = {}
        for key in RATIO_KEYS:
            reference = baseline[key]
            ratios[f"{key}_ratio"] = row[key] / reference if reference > 0 else None
        out.append({**row, **ratios})
    return out


def run_efficiency(
    cfg: EfficiencyConfig,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> dict[str, Any]:
    """Train every algorithm of ``cfg`` in turn (baseline first) and compare them; returns one JSON-ready document:
    ``{"config": ..., "algorithms": [row, ...]}`` with the rows in training order."""
    from fluxgrpo.grpo.trainer import train

    cfg.validate()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fluxgrpo-bench-efficiency-") as folder:
        workspace = prepare_workspace(Path(folder), cfg.seed, cfg.text_tokens, log)
        base = base_training_config(cfg, workspace)
        for name in cfg.runs:
            train_cfg = algorithm_config(base, name)
            log(f"training {name} for {cfg.iterations} iterations: {ALGORITHMS[name].description}")
            row = summarize_run(name, ALGORITHMS[name].overrides(base), train_cfg, train(train_cfg))
            log(f"  {name}: {row['seconds_per_iteration']:.3g} s per iteration, reward gain {row['reward_gain']:.4g}")
            rows.append(row)
    shared = {key: value for key, value in base.to_dict().items() if key not in WORKSPACE_FIELDS}
    return {
        "config": {**dataclasses.asdict(cfg), "runs": list(cfg.runs), "training": shared},
        "algorithms": with_ratios(rows),
    }
