"""Learning efficiency: what each training algorithm buys per second of training, trained for real, side by side.

``fluxgrpo bench --algorithms dance,dance-t2 --iterations 30 --repeats 3`` trains each named algorithm ``--repeats``
times with the real loop (``training.loop.train``), in this process, from the same start: the same tiny weights
(written once, seeded by ``--seed``), the same prompt embeddings (the bundled prompts, encoded once by the tiny text
encoders), the same training config (``--config``, tiny-cpu by default: its reward, resolution, steps and batch
sizes) and so the same prompts and initial noise at every iteration. An algorithm is a name for a set of
``TrainConfig`` overrides (``ALGORITHMS``); ``dance`` overrides nothing and is the baseline every ratio is taken
against.

The runs go in interleaved rounds: each round trains every algorithm once, in the given order on rounds 1, 3, …
and in the reverse order on rounds 2, 4, … (``training_rounds``). A machine that slowly gets busier or quieter
then weighs on every algorithm alike: over any two consecutive rounds each algorithm's mean place in the queue is the
same, where running one algorithm's repeats back to back would hand the whole drift to whichever ran last.

For each algorithm:

- **seconds per iteration**: per run, the median over the iterations of rollout + decode/reward + update, as the
  trainer's own phase clock measured them (the median keeps the first iteration's one-time costs and a busy
  machine's spikes out); then the median over the repeats of those, with their **spread** (min–max over the
  repeats) so the noise is on the page. An algorithm whose spread overlaps ``dance``'s is **within noise** of it
  in time, whatever its ratio says (``time_verdict``); with one repeat there is no spread to judge by;
- **reward gain**: the rise of the least-squares line through the iterations' mean rewards over the run,
  slope × (iterations − 1). Each algorithm's rewards are of its own rollouts, so a sampler that starts higher or
  lower does not count as learning; the fit uses every iteration instead of two noisy ends;
- **reward gain per second**: the gain over the training time, median seconds per iteration × iterations;

and each as a ratio to ``dance``'s (None where ``dance``'s value is not positive: a ratio to nothing is no ratio).
With ``--vary-seed`` repeat k trains with ``--seed`` + k − 1 (other prompts, noise, timesteps), so the gain's spread
over the repeats is measured as well (``reward_gain_spread``) and the gain is the repeats' median.
The rewards come from seeded generators only, so every repeat of an algorithm must reproduce them bitwise; the
bench checks that, and where a repeat differs (training not deterministic on this device) it says so in the row,
the log and the table, listing every repeat's gain and showing their median, instead of quietly averaging.

``--baseline-from earlier.json`` takes the baseline's row from an earlier comparison of the same settings instead of
training the baseline again (``bench/reused_baseline.py``).
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

from fluxgrpo.config import build_config
from fluxgrpo.data.benchmarks import SHIPPED_SETS, WEIGHTED_SETS, prompts_path, shipped_set_path
from fluxgrpo.errors import UsageError
from fluxgrpo.rewards.reward_set import eval_reward_names

if TYPE_CHECKING:
    from fluxgrpo.bench.heldout import WorkCounter
    from fluxgrpo.config import TrainConfig

BASELINE = "dance"
DEFAULT_CONFIG = "tiny-cpu"
# The loop's phase clock (``training.stats.PhaseClock``): their sum is one iteration's training time.
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


# The authors' settings of the final-sample objectives, shared by their rows and the practitioners' variants.
AUTHORS_NFT = {"objective": "nft", "sampling_steps": 10, "timestep_fraction": 0.99, "nft_beta": 1.0}
AUTHORS_AWM = {
    "objective": "awm",
    "sampling_steps": 14,
    "timestep_fraction": 0.55,
    "awm_weighting": "ghuber",
    "awm_ema_beta": 1.0,
    "clip_range": 1.0,
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
        Algorithm(
            "dance-retain",
            "dance with --retain-rollout-graphs: the update back-propagates through the rollout's kept forwards "
            "(the same math, no recomputed forward; the config must take one optimizer step per rollout)",
            lambda base: {"retain_rollout_graphs": True},
        ),
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
        # The final-sample objectives at their authors' settings: the DPM-Solver++(2M) ODE at their own step counts.
        Algorithm(
            "nft",
            "DiffusionNFT: old-policy ODE rollouts of 10 steps, 9 of them trained per image, β 1, decay type 1",
            lambda base: dict(AUTHORS_NFT),
        ),
        Algorithm(
            "awm",
            "AWM: ODE rollouts of 14 steps, 6 stratified timesteps trained, ghuber 0.25, EMA-policy term 1, clip 1",
            lambda base: dict(AUTHORS_AWM),
        ),
        # As practitioners run them (Flow-Factory's FLUX configs): far fewer trained timesteps per image.
        Algorithm(
            "nft-t2",
            "nft with 2 trained timesteps per image (Flow-Factory's FLUX NFT)",
            lambda base: {**AUTHORS_NFT, "fm_timesteps": 2},
        ),
        Algorithm(
            "awm-t4",
            "awm with 4 stratified timesteps per image (Flow-Factory's FLUX AWM)",
            lambda base: {**AUTHORS_AWM, "fm_timesteps": 4},
        ),
        Algorithm(
            "vgrpo",
            "V-GRPO: ODE rollouts of 16 steps, 4 group-shared stratified (t, ε) pairs, self-normalised x-prediction "
            "surrogate, ratio clip 6e-3",
            lambda base: {"objective": "vgrpo", "sampling_steps": 16, "vgrpo_mc_samples": 4, "clip_range": 6e-3},
        ),
        Algorithm(
            "vgrpo-own-steps",
            "V-GRPO at --config's own step count and N_MC (shapes-balanced's recipe: 10-step rollouts, N_MC 4), "
            "ratio clip 6e-3",
            lambda base: {"objective": "vgrpo", "clip_range": 6e-3},
        ),
        Algorithm(
            "neighbor",
            "Neighbor GRPO: 8-step ODE rollouts from a σ 0.3 noise neighbourhood, 4 anchors per group at 4 of the 7 "
            "transitions, quasi-norm p 0.8",
            lambda base: {
                "objective": "neighbor",
                "sampling_steps": 8,
                "timestep_fraction": 0.6,
                "neighbor_sigma": 0.3,
                "neighbor_anchors": min(4, base.num_generations),
                "neighbor_quasi_norm_p": 0.8,
            },
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
    # Training runs per algorithm, in interleaved rounds. 3: the fewest whose median outvotes one disturbed run
    # (and whose min–max shows it), at 3× the time of one; the phase bench's --repeats default is 3 as well.
    repeats: int = 3
    # Repeat k trains with --seed + k − 1 (other prompts, noise and timesteps), so the spread of the reward gain is
    # measured too; off, every repeat reproduces the first's rewards and only the time varies.
    vary_seed: bool = False
    # The training prompts: a shipped set's name or a file; None: the world's shapes-train for a config scored by the
    # world's checker, else the bundled prompts. A weighted set (shapes-train-balanced) keeps its repeated lines.
    prompts: str | None = None
    # An earlier `bench --algorithms ... --json` document of the same settings whose baseline row stands in for
    # training the baseline again (its runs are deterministic, so a rerun would give the same gains): a campaign adds
    # options block by block at the cost of the options alone. Its times are that run's (same machine, other hour).
    baseline_from: str | None = None
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
        if self.repeats < 1:
            out.append(f"--repeats {self.repeats}: at least 1 (training runs per algorithm)")
        if self.prompts is not None and not prompts_path(self.prompts).is_file():
            out.append(f"--prompts {self.prompts}: no such file and not a shipped set ({', '.join(SHIPPED_SETS)})")
        if self.baseline_from is not None and not Path(self.baseline_from).is_file():
            out.append(
                f"--baseline-from {self.baseline_from}: no such file (an earlier `bench --algorithms --json` output)"
            )
        if self.baseline_from is not None and not self.trained:
            out.append(f"--baseline-from brings {BASELINE}'s row: name an algorithm to compare with it in --algorithms")
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

    @property
    def trained(self) -> tuple[str, ...]:
        """The algorithms this bench trains: ``runs`` less the baseline when ``baseline_from`` brings its row."""
        return tuple(name for name in self.runs if self.baseline_from is None or name != BASELINE)

    @property
    def rounds(self) -> tuple[tuple[str, ...], ...]:
        return training_rounds(self.trained, self.repeats)


def training_rounds(runs: tuple[str, ...], repeats: int) -> tuple[tuple[str, ...], ...]:
    """``repeats`` rounds of every algorithm once: ``runs`` in order, then reversed, then in order again, …

    Reversing (rather than rotating) balances a steady drift after every second round whatever the number of
    algorithms: the places i and n − 1 − i average to (n − 1)/2 for every algorithm. A rotation balances only after n
    rounds, and with fewer it can keep one algorithm at the end of every round."""
    return tuple(runs if index % 2 == 0 else runs[::-1] for index in range(repeats))


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


def training_prompts(config: str, overrides: dict[str, Any], prompts: str | None = None) -> Path:
    """The prompts every algorithm trains on: ``prompts`` (a shipped set's name or a file) when given, else the
    shapes world's training captions when ``config`` scores with the world's checker (``shapes``, trained or
    evaluated), else the bundled prompts."""
    from fluxgrpo.data.prompts import bundled_prompts_path

    if prompts is not None:
        return prompts_path(prompts)
    if trains_in_the_world(config, overrides):
        return shipped_set_path("shapes-train")
    return bundled_prompts_path()


def trains_in_the_world(config: str, overrides: dict[str, Any]) -> bool:
    """Whether ``config`` is scored by the shapes world's checker, and so trains on the world's weights with its
    held-out evaluation kept."""
    from fluxgrpo.bench.heldout import WORLD_REWARD

    settings = build_config(config, overrides)
    return WORLD_REWARD in eval_reward_names(settings.reward, settings.eval_rewards)


def prepare_workspace(
    root: Path,
    seed: int,
    text_tokens: int,
    log: Callable[[str], None],
    prompts: Path | None = None,
    world: bool = False,
    keep_repeats: bool = False,
) -> Workspace:
    """Write the weights and encode ``prompts`` (the bundled ones by default) with their text encoders, under
    ``root``. With ``world`` the weights are the shapes world's pretrained ones (``fetch-weights --source shapes``):
    a held-out checker gain means something only for a model that draws the world; else the tiny random weights
    (seeded by ``seed``). ``keep_repeats``: a prompt on k lines is drawn k times as often (``preprocess``)."""
    from fluxgrpo.data.prompts import bundled_prompts_path
    from fluxgrpo.preprocess import preprocess
    from fluxgrpo.rewards.tiny_weights import write_tiny_weights
    from fluxgrpo.shapes.shipped import write_shapes_weights

    prompts = prompts or bundled_prompts_path()
    flux_dir, hps_dir = root / "flux", root / "hps_ckpt"
    if world:
        log(f"writing the shapes world's weights and encoding {prompts.name} ({text_tokens} T5 tokens)")
        write_shapes_weights(flux_dir, hps_dir)
    else:
        log(f"writing the tiny weights (seed {seed}) and encoding {prompts.name} ({text_tokens} T5 tokens)")
        write_tiny_weights(flux_dir, hps_dir, seed=seed)
    summary = preprocess(
        prompts, flux_dir, root / "rl_embeddings", text_tokens, device="cpu", keep_repeats=keep_repeats
    )
    return Workspace(flux_dir, hps_dir, Path(summary.index_path), root / "runs")


def base_training_config(cfg: EfficiencyConfig, workspace: Workspace, evaluate: bool = False) -> TrainConfig:
    """``--config`` with the workspace's inputs and the run's length: what every algorithm shares.

    The config's held-out evaluation is kept only when ``evaluate`` (a config scored by the world's checker, whose
    held-out gain is the comparison); the clock never counts it (``run_seconds`` sums the training phases)."""

    return build_config(
        cfg.config,
        {
            **({} if evaluate else {"eval_every": 0}),
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


def algorithm_config(base: TrainConfig, name: str, repeat: int = 1, vary_seed: bool = False) -> TrainConfig:
    """The base config with the algorithm's overrides, in a run folder of its own (one per repeat, so no run sees
    another's checkpoint or metrics); with ``vary_seed`` repeat k trains with the base seed + k − 1; validated."""
    overrides = ALGORITHMS[name].overrides(base)
    output_dir = Path(base.output_dir, name, f"repeat-{repeat}")
    seed = base.seed + repeat - 1 if vary_seed else base.seed
    return dataclasses.replace(base, output_dir=str(output_dir), seed=seed, **overrides).validate()


# Where the runs' inputs and outputs were: a temporary folder, gone when the bench ends.
WORKSPACE_FIELDS = ("model", "hps_dir", "data_json_path", "output_dir")


def reward_gain(rewards: list[float]) -> float:
    """The least-squares line's rise over the run: slope × (n − 1), with the iterations as x (n ≥ 2)."""
    count = len(rewards)
    x_mean, y_mean = (count - 1) / 2, statistics.fmean(rewards)
    covariance = sum((x - x_mean) * (y - y_mean) for x, y in enumerate(rewards))
    variance = sum((x - x_mean) ** 2 for x in range(count))
    return covariance / variance * (count - 1)


def iteration_seconds(record: dict[str, Any]) -> float:
    """One iteration's training time: the sum of its phases' seconds."""
    return sum(float(record[key]) for key in PHASE_SECONDS)


def run_seconds(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's clock: the median over its iterations of the iteration's seconds and of each phase's."""
    return {
        "seconds_per_iteration": statistics.median(iteration_seconds(record) for record in records),
        "phase_seconds": {
            key.removeprefix("seconds_"): statistics.median(float(r[key]) for r in records) for key in PHASE_SECONDS
        },
    }


def summarize_algorithm(
    name: str,
    overrides: dict[str, Any],
    train_cfg: TrainConfig,
    runs: list[list[dict[str, Any]]],
    vary_seed: bool = False,
) -> dict[str, Any]:
    """One algorithm's row (before ratios) from its config and every repeat's metrics records, in round order.

    Times: the median over the repeats of each run's median, and their spread. Rewards: the first run's, which every
    repeat must reproduce (``rewards_identical``); where one does not, ``reward_gain`` is the median of the
    repeats' gains, each of them in ``reward_gain_runs``. With ``vary_seed`` the repeats differ by design: the gain
    is their median and ``reward_gain_spread`` their min–max."""
    clocks = [run_seconds(records) for records in runs]
    per_run = [clock["seconds_per_iteration"] for clock in clocks]
    per_iteration = statistics.median(per_run)
    rewards = [[float(record["reward_mean"]) for record in records] for records in runs]
    gains = [reward_gain(run_rewards) for run_rewards in rewards]
    identical = vary_seed or all(run_rewards == rewards[0] for run_rewards in rewards)
    gain = statistics.median(gains) if vary_seed or not identical else gains[0]
    iterations = len(runs[0])
    return {
        "algorithm": name,
        "overrides": overrides,
        "iterations": iterations,
        "trained_timesteps": train_cfg.train_timesteps,
        "rollout_model_calls": train_cfg.rollout_model_calls,
        "repeats": len(runs),
        "seconds_per_iteration": per_iteration,
        "seconds_per_iteration_runs": per_run,
        "seconds_per_iteration_spread": [min(per_run), max(per_run)],
        "phase_seconds": {
            phase: statistics.median(clock["phase_seconds"][phase] for clock in clocks)
            for phase in clocks[0]["phase_seconds"]
        },
        "reward_first": rewards[0][0],
        "reward_last": rewards[0][-1],
        "reward_gain": gain,
        "reward_gain_runs": gains,
        "reward_gain_spread": [min(gains), max(gains)],
        "rewards_identical": identical,
        "reward_gain_per_second": gain / (per_iteration * iterations),
        "rewards": rewards[0],
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


def time_verdict(row: dict[str, Any], baseline: dict[str, Any]) -> str | None:
    """How the row's time compares with the baseline's: faster or slower where the two spreads of seconds per
    iteration do not overlap (every run beat, or lost to, every run of the baseline), within noise where they do;
    None for the baseline itself and for single runs (no spread to judge by)."""
    if row["algorithm"] == baseline["algorithm"] or min(row["repeats"], baseline["repeats"]) < 2:
        return None
    low, high = row["seconds_per_iteration_spread"]
    baseline_low, baseline_high = baseline["seconds_per_iteration_spread"]
    if high < baseline_low:
        return "faster"
    if low > baseline_high:
        return "slower"
    return "within noise"


def with_time_verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    baseline = next(row for row in rows if row["algorithm"] == BASELINE)
    return [{**row, "time_verdict": time_verdict(row, baseline)} for row in rows]


def compare(
    cfg: EfficiencyConfig,
    base: TrainConfig,
    train: Callable[[TrainConfig], list[dict[str, Any]]],
    log: Callable[[str], None],
    counter: WorkCounter | None = None,
    baseline_row: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Train the algorithms of ``cfg`` round by round with ``train`` (the real loop, or a stand-in in tests);
    returns their rows with ratios and time verdicts, in ``cfg.runs`` order. With ``counter`` (active around each
    run, ``bench.heldout.counted``) each row also has its work per iteration; with evaluation on, its held-out gain
    (``bench/heldout.py``). ``baseline_row`` (an earlier comparison's, ``--baseline-from``) stands in for training
    the baseline."""
    from fluxgrpo.bench.heldout import (
        gain_per_kilo_forward_equivalent,
        heldout_gain,
        heldout_reward,
        heldout_scores,
        heldout_summary,
        work_per_iteration,
    )
    from fluxgrpo.training.eval import eval_prompt_list

    reward = heldout_reward(base)
    eval_prompts = len(eval_prompt_list(base)) if reward else 0
    heldout: dict[str, list[list[tuple[int, float]]]] = {name: [] for name in cfg.trained}
    work: dict[str, list[dict[str, float]]] = {name: [] for name in cfg.trained}
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in cfg.trained}
    for index, order in enumerate(cfg.rounds, start=1):
        if cfg.repeats > 1:
            log(f"round {index} of {cfg.repeats}: {', '.join(order)}")
        for name in order:
            what = ALGORITHMS[name].description if index == 1 else f"repeat {index}"
            log(f"training {name} for {cfg.iterations} iterations: {what}")
            run_cfg = algorithm_config(base, name, repeat=index, vary_seed=cfg.vary_seed)
            records = train(run_cfg)
            clock = run_seconds(records)
            gain = reward_gain([float(record["reward_mean"]) for record in records])
            scores = heldout_scores(run_cfg.output_dir, reward) if reward else []
            gained = heldout_gain(scores)
            told = "" if gained is None else f", held-out {reward} gain {gained:.4g}"
            log(f"  {name}: {clock['seconds_per_iteration']:.3g} s per iteration, reward gain {gain:.4g}{told}")
            runs[name].append(records)
            heldout[name].append(scores)
            if counter is not None:
                work[name].append(work_per_iteration(counter.reset(), records, run_cfg, len(scores), eval_prompts))
    rows = []
    for name in cfg.runs:
        if name not in cfg.trained:
            assert baseline_row is not None, "an untrained baseline needs its row"
            rows.append(baseline_row)
            continue
        overrides = ALGORITHMS[name].overrides(base)
        row = summarize_algorithm(name, overrides, algorithm_config(base, name), runs[name], cfg.vary_seed)
        row.update(heldout_summary(reward, heldout[name], row["seconds_per_iteration"], row["iterations"]))
        # The same every repeat (the plan and the batch sizes fix it): the first's, with every repeat's kept.
        row["work_per_iteration"] = work[name][0] if work[name] else None
        row["work_per_iteration_runs"] = work[name]
        row["heldout_gain_per_kilo_forward_equivalent"] = gain_per_kilo_forward_equivalent(row)
        if not row["rewards_identical"]:
            gains = ", ".join(f"{gain:.6g}" for gain in row["reward_gain_runs"])
            log(
                f"warning: {name}'s rewards differ between its repeats (gains {gains}): training is not "
                "deterministic on this machine, so its gain is their median (the JSON lists each); its times stand"
            )
        rows.append(row)
    return with_heldout_verdicts(with_time_verdicts(with_ratios(rows)))


def with_heldout_verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its held-out verdict against the baseline and when it reached the baseline's final score."""
    from fluxgrpo.bench.heldout import heldout_verdict, time_to_baseline_final

    baseline = next(row for row in rows if row["algorithm"] == BASELINE)
    return [
        {**row, "heldout_verdict": heldout_verdict(row, baseline), **time_to_baseline_final(row, baseline)}
        for row in rows
    ]


def run_efficiency(
    cfg: EfficiencyConfig,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> dict[str, Any]:
    """Train every algorithm of ``cfg`` ``cfg.repeats`` times in interleaved rounds and compare them; returns one
    JSON-ready document: ``{"config": ..., "algorithms": [row, ...]}`` with the rows in ``cfg.runs`` order."""
    from fluxgrpo.bench.baseline_probe import PROBE_ITERATIONS, run_probe, speed_note
    from fluxgrpo.bench.heldout import WorkCounter, counted
    from fluxgrpo.bench.reused_baseline import load_baseline
    from fluxgrpo.training.loop import train

    cfg.validate()
    reused = None if cfg.baseline_from is None else load_baseline(cfg, BASELINE)
    prompts = training_prompts(cfg.config, cfg.base_overrides, cfg.prompts)
    world = trains_in_the_world(cfg.config, cfg.base_overrides)
    keep_repeats = cfg.prompts in WEIGHTED_SETS
    counter = WorkCounter()
    probe = None
    with tempfile.TemporaryDirectory(prefix="fluxgrpo-bench-efficiency-") as folder:
        workspace = prepare_workspace(Path(folder), cfg.seed, cfg.text_tokens, log, prompts, world, keep_repeats)
        base = base_training_config(cfg, workspace, evaluate=world)
        shared = {key: value for key, value in base.to_dict().items() if key not in WORKSPACE_FIELDS}
        if reused is not None:
            reused.check_training(shared)
            log(f"{BASELINE}: its row from {reused.path} (same settings; its times were measured then)")
            # Its seconds are that machine's: a few of its iterations here say how this one compares.
            probed = min(PROBE_ITERATIONS, cfg.iterations)
            log(f"probing {BASELINE}'s speed here: {probed} of its iterations, outside the comparison")
            baseline_cfg = algorithm_config(base, BASELINE)
            probe = run_probe(baseline_cfg, float(reused.row["seconds_per_iteration"]), train, iteration_seconds)
            log(f"  {BASELINE}: {speed_note(probe)}")
        rows = compare(cfg, base, counted(train, counter), log, counter, None if reused is None else reused.as_row())
    return {
        "config": {
            **dataclasses.asdict(cfg),
            "runs": list(cfg.runs),
            "rounds": [list(order) for order in cfg.rounds],
            "training": shared,
            # With --baseline-from: the baseline's iterations timed here against the reused row's
            # (bench/baseline_probe.py); None when this run trained the baseline itself.
            "baseline_probe": probe,
        },
        "algorithms": rows,
    }
