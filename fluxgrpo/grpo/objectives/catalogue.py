"""The catalogue of training objectives (``--objective``): everything the run's config, settings, memory model and
guards know of an objective, without importing torch (validation runs before any worker starts).

Adding an objective is two files: its module (``grpo/objectives/<name>.py``: a class with ``from_config`` whose
work computes a loss from the tensors the update driver hands it, ``base.py``) and its entry here
(``register_objective``). Flags of its own are fields of ``TrainConfig`` (named ``<name>_…``) checked by its
``option_problems``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig

OLD_POLICY, EMA_POLICY = "old_policy", "ema_policy"  # the names policy copies are saved under
NFT_DECAY_TYPES = (0, 1, 2)
AWM_WEIGHTINGS = ("uniform", "t", "t2", "ghuber", "huber")
AWM_TIME_FRACTION = 0.9  # AWM trains at the sampler-grid indices lo … int(0.9·N)−1
AWM_TIME_TYPES = {"discrete": 0, "discrete_wo_init": 1}  # the authors' time_type → lo (0 includes σ = 1)
# The (t, ε) draws of the objectives that train on forward-noised final samples (``draws.py``): who shares a draw,
# how the timesteps are chosen; ``auto`` is each objective's authors' rule (``ObjectiveEntry.draws``).
FM_DRAWS = ("auto", "sample", "group")
FM_TIMESTEP_RULES = ("auto", "random", "stratified")
FM_OPTIONS = ("fm_draws", "fm_timestep_rule")
# Guard rules measured on the SDE trajectory's trained steps: an objective that keeps no trajectory cannot have them.
TRAJECTORY_GUARDS = ("velocity_norm_ratio",)
# The SDE rollout's settings (its sampler and noise, MixGRPO's window and ODE tail, the group's shared noise, which
# latent is decoded) and GRPO's per-step ratio: an objective that keeps no trajectory rolls out with the ODE, which
# reads none of them (it ends at σ = 0, where --decode-sample's two latents agree).
TRAJECTORY_SETTINGS = (
    "sampler",
    "eta",
    "sde_window",
    "sde_window_policy",
    "sde_window_shift_every",
    "sde_window_stride",
    "sde_window_wrap",
    "ode_solver",
    "ode_compress_ratio",
    "init_same_noise",
    "decode_sample",
    "ratio_normalization",
)


def _no_problems(cfg: TrainConfig) -> list[str]:
    return []


def _no_copies(cfg: TrainConfig) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class ObjectiveEntry:
    """One objective as the run's plumbing sees it. ``cfg`` below is a ``TrainConfig`` (imported for type checking only)."""

    name: str
    # The class to train with: "module:Class" (imported when a run builds it) or the class itself; its
    # ``from_config(cfg, policy_copies)`` returns a ``base.Objective``.
    builder: str | Callable[..., Any]
    # True: the rollout is the SDE with per-step log-probs (``Rollout``); False: the ODE's final samples only.
    keeps_trajectory: bool
    # cfg → the timesteps a sample may train on (T_train = int(this·fraction)).
    trainable_timesteps: Callable[[TrainConfig], int]
    # The copies of the trainable weights it keeps (saved with checkpoints, counted by the memory model).
    policy_copies: Callable[[TrainConfig], tuple[str, ...]] = _no_copies
    # Its own flags' problems, checked whichever objective is chosen (a wrong value is wrong anyway).
    option_problems: Callable[[TrainConfig], list[str]] = _no_problems
    # Problems of a run with this objective (settings it cannot train with).
    run_problems: Callable[[TrainConfig], list[str]] = _no_problems
    # The flags (``TrainConfig`` fields) only the objectives naming them read: one left off its default is refused,
    # naming it, with an objective that does not.
    options: tuple[str, ...] = ()
    # cfg → T_train, when it is not int(trainable·fraction) (or ``--fm-timesteps`` where ``options`` has it).
    train_timesteps: Callable[[TrainConfig], int] | None = None
    # (sharing, timestep rule) of ``--fm-draws auto`` / ``--fm-timestep-rule auto``: the authors'.
    draws: tuple[str, str] = ("sample", "stratified")
    # cfg → the samples one rank's update trains (micro-batches cut these): every trajectory by default.
    trained_samples: Callable[[TrainConfig], int] | None = None
    # cfg → latent rows one trained sample puts through a training forward (V-GRPO's N_MC pairs: one batch).
    rows_per_forward: Callable[[TrainConfig], int] | None = None
    # cfg → the update's kept latents when they are not the final-sample formula of ``update_latents``.
    kept_latents: Callable[[TrainConfig], int] | None = None
    # Settings every objective has that this one does not read (``TRAJECTORY_SETTINGS`` aside): the report leaves
    # them out of the run's config table.
    ignores: tuple[str, ...] = ()

    @property
    def refused_guards(self) -> tuple[str, ...]:
        """The guard rules it cannot be checked by (their probe would only report NaN)."""
        return () if self.keeps_trajectory else TRAJECTORY_GUARDS

    def update_latents(self, cfg: TrainConfig) -> int:
        """[trajectories × T_train] latents its update keeps besides the rollout's: the fresh noise and each policy
        copy's velocity per trained slot (the final-sample objectives); none for the trajectory objectives."""
        if self.kept_latents is not None:
            return self.kept_latents(cfg)
        if self.keeps_trajectory:
            return 0
        return cfg.trajectories_per_rank * cfg.train_timesteps * (1 + len(self.policy_copies(cfg)))


# The objectives' weights and scales past which no update is finite (#50: 1e30 passed and every update was skipped).
NFT_BETA_MAX = 10.0  # β of the implicit policies (1 ± β)·v: the loss divides by β
AWM_GHUBER_POWER_MAX = 2.0  # p of (mse + 1e-10)^p: 1 is the squared error itself
PULL_WEIGHT_MAX = 1e4  # --awm-ema-beta, as --kl-beta's bound
SOFT_CLIP_MAX = 100.0  # η of η·tanh(A/η): past --adv-clip-max it leaves A as is
TEMPERATURE_MAX = 1e4  # τ of softmax(−d²/τ): the README measured 10-1000


def _nft_option_problems(cfg: TrainConfig) -> list[str]:
    out = []
    if not 0 < cfg.nft_beta <= NFT_BETA_MAX:
        out.append(f"--nft-beta {cfg.nft_beta} must be in (0, {NFT_BETA_MAX:g}] (the authors: 1)")
    if cfg.nft_decay_type not in NFT_DECAY_TYPES:
        out.append(f"--nft-decay-type {cfg.nft_decay_type}: use one of {', '.join(map(str, NFT_DECAY_TYPES))}")
    return out


def _draw_option_problems(cfg: TrainConfig) -> list[str]:
    """``--fm-draws``, ``--fm-timestep-rule``, ``--fm-timesteps``: shared by nft, awm and vgrpo, checked once here."""
    out = []
    for flag, value, allowed in (
        ("--fm-draws", cfg.fm_draws, FM_DRAWS),
        ("--fm-timestep-rule", cfg.fm_timestep_rule, FM_TIMESTEP_RULES),
    ):
        if value not in allowed:
            out.append(f"{flag} {value!r}: use one of {', '.join(allowed)}")
    if cfg.fm_timesteps < 0:
        out.append(f"--fm-timesteps {cfg.fm_timesteps} cannot be negative (0: from --timestep-fraction)")
    return out


def _fm_timesteps_run_problems(cfg: TrainConfig) -> list[str]:
    if cfg.fm_timesteps > cfg.trainable_timesteps:
        return [
            f"--fm-timesteps {cfg.fm_timesteps}: --objective {cfg.objective} has only {cfg.trainable_timesteps} "
            f"timesteps to train with --sampling-steps {cfg.sampling_steps}"
        ]
    return []


def _awm_option_problems(cfg: TrainConfig) -> list[str]:
    out = []
    if cfg.awm_time_type not in AWM_TIME_TYPES:
        out.append(f"--awm-time-type {cfg.awm_time_type!r}: use one of {', '.join(AWM_TIME_TYPES)}")
    if cfg.awm_weighting not in AWM_WEIGHTINGS:
        out.append(f"--awm-weighting {cfg.awm_weighting!r}: use one of {', '.join(AWM_WEIGHTINGS)}")
    if not 0 < cfg.awm_ghuber_power <= AWM_GHUBER_POWER_MAX:
        out.append(
            f"--awm-ghuber-power {cfg.awm_ghuber_power} must be in (0, {AWM_GHUBER_POWER_MAX:g}] (1: the squared "
            "error; the authors: 0.25)"
        )
    if not 0 <= cfg.awm_ema_beta <= PULL_WEIGHT_MAX:
        out.append(f"--awm-ema-beta {cfg.awm_ema_beta} must be in [0, {PULL_WEIGHT_MAX:g}] (0 turns the EMA term off)")
    return out


def _awm_run_problems(cfg: TrainConfig) -> list[str]:
    if cfg.sampling_steps >= 1 and cfg.trainable_timesteps < 1:
        return [
            f"--objective awm trains at grid indices {AWM_TIME_TYPES.get(cfg.awm_time_type, 1)} … int(0.9·N)−1, "
            f"none with --sampling-steps {cfg.sampling_steps}: use at least 3"
        ]
    return _fm_timesteps_run_problems(cfg)


def _awm_trainable(cfg: TrainConfig) -> int:
    return max(int(cfg.sampling_steps * AWM_TIME_FRACTION) - AWM_TIME_TYPES.get(cfg.awm_time_type, 1), 0)


def _vgrpo_option_problems(cfg: TrainConfig) -> list[str]:
    out = []
    if cfg.vgrpo_mc_samples < 1:
        out.append(f"--vgrpo-mc-samples {cfg.vgrpo_mc_samples} must be at least 1 (the authors' N_MC: 4)")
    if not 0 <= cfg.vgrpo_adv_soft_clip <= SOFT_CLIP_MAX:
        out.append(
            f"--vgrpo-adv-soft-clip {cfg.vgrpo_adv_soft_clip} must be in [0, {SOFT_CLIP_MAX:g}] (0: off; the "
            "authors' SD3.5: 3)"
        )
    return out


def _vgrpo_run_problems(cfg: TrainConfig) -> list[str]:
    if cfg.vgrpo_mc_samples > cfg.sampling_steps >= 1:
        return [
            f"--vgrpo-mc-samples {cfg.vgrpo_mc_samples}: one pair per stratum of the {cfg.sampling_steps} "
            "--sampling-steps timesteps at most"
        ]
    return []


def _neighbor_option_problems(cfg: TrainConfig) -> list[str]:
    out = []
    if not 0 < cfg.neighbor_sigma <= 1:
        out.append(f"--neighbor-sigma {cfg.neighbor_sigma} must be in (0, 1] (the authors: 0.3)")
    if not 0 < cfg.neighbor_quasi_norm_p <= 2:
        out.append(f"--neighbor-quasi-norm-p {cfg.neighbor_quasi_norm_p} must be in (0, 2] (the authors: 0.8)")
    if not 0 < cfg.neighbor_temperature <= TEMPERATURE_MAX:
        out.append(
            f"--neighbor-temperature {cfg.neighbor_temperature} must be in (0, {TEMPERATURE_MAX:g}] (the authors: 1)"
        )
    if cfg.neighbor_anchors < 1:
        out.append(f"--neighbor-anchors {cfg.neighbor_anchors} must be at least 1 (the authors: 4 of 12)")
    return out


def _neighbor_anchors(cfg: TrainConfig) -> int:
    """The anchors one rank's update trains: B of each group's G candidates."""
    return cfg.train_batch_size * min(cfg.neighbor_anchors, cfg.num_generations)


def _neighbor_run_problems(cfg: TrainConfig) -> list[str]:
    if cfg.neighbor_anchors > cfg.num_generations >= 1:
        return [
            f"--neighbor-anchors {cfg.neighbor_anchors} must be at most --num-generations {cfg.num_generations} "
            "(the anchors are candidates of the group; the authors: 4 of 12)"
        ]
    anchors = _neighbor_anchors(cfg)
    if cfg.train_micro_batch_size >= 1 and anchors % cfg.train_micro_batch_size:
        return [
            f"--train-micro-batch-size {cfg.train_micro_batch_size} does not divide the {anchors} anchors per rank "
            f"(--train-batch-size {cfg.train_batch_size} × --neighbor-anchors {cfg.neighbor_anchors}), which the "
            "neighbor update trains on"
        ]
    return []


CATALOGUE: dict[str, ObjectiveEntry] = {
    entry.name: entry
    for entry in (
        # The last transition cannot change the reward, so it never trains: the SDE window, or N−1.
        ObjectiveEntry(
            "grpo",
            "fluxgrpo.grpo.objectives.grpo:GrpoObjective",
            True,
            lambda cfg: cfg.sde_window or cfg.sampling_steps - 1,
        ),
        ObjectiveEntry(
            "nft",
            "fluxgrpo.grpo.objectives.nft:NftObjective",
            False,
            lambda cfg: cfg.sampling_steps,
            policy_copies=lambda cfg: (OLD_POLICY,),
            option_problems=lambda cfg: _nft_option_problems(cfg) + _draw_option_problems(cfg),
            run_problems=_fm_timesteps_run_problems,
            options=(*FM_OPTIONS, "fm_timesteps"),
            draws=("sample", "random"),
            ignores=("clip_range",),  # no probability ratio to clip: its loss is the implicit policies' regression
        ),
        ObjectiveEntry(
            "awm",
            "fluxgrpo.grpo.objectives.awm:AwmObjective",
            False,
            _awm_trainable,
            policy_copies=lambda cfg: (EMA_POLICY,) if cfg.awm_ema_beta > 0 else (),
            option_problems=_awm_option_problems,
            run_problems=_awm_run_problems,
            options=(*FM_OPTIONS, "fm_timesteps", "awm_time_type"),
        ),
        # V-GRPO: the N sampler timesteps σ_0 … σ_{N−1}, N_MC of them (one per stratum) per sample.
        ObjectiveEntry(
            "vgrpo",
            "fluxgrpo.grpo.objectives.vgrpo:VgrpoObjective",
            False,
            lambda cfg: cfg.sampling_steps,
            option_problems=_vgrpo_option_problems,
            run_problems=_vgrpo_run_problems,
            options=(*FM_OPTIONS, "vgrpo_mc_samples", "vgrpo_adv_soft_clip"),
            train_timesteps=lambda cfg: cfg.vgrpo_mc_samples,
            draws=("group", "stratified"),
            rows_per_forward=lambda cfg: cfg.vgrpo_mc_samples,
            ignores=("timestep_fraction",),  # its N_MC pairs are its T_train
        ),
        # Neighbor GRPO: no log-probs (an ODE rollout, its paths kept for the candidates); B anchors per group each
        # train K of the N−1 transitions. Its paths are the rollout's trajectory latents: no update latents.
        ObjectiveEntry(
            "neighbor",
            "fluxgrpo.grpo.objectives.neighbor:NeighborObjective",
            False,
            lambda cfg: cfg.sampling_steps - 1,
            option_problems=_neighbor_option_problems,
            run_problems=_neighbor_run_problems,
            options=("neighbor_sigma", "neighbor_anchors", "neighbor_quasi_norm_p", "neighbor_temperature"),
            trained_samples=_neighbor_anchors,
            kept_latents=lambda cfg: 0,
        ),
    )
}


def objective_names() -> tuple[str, ...]:
    return tuple(CATALOGUE)


def objective_entry(name: str) -> ObjectiveEntry:
    """The entry of ``--objective name``; KeyError for a name not in the catalogue (the config reports it)."""
    return CATALOGUE[name]


def settings_not_read(name: str, settings: dict[str, Any]) -> list[str]:
    """The keys of ``settings`` (a run's resolved config) that ``--objective name`` does not read: the other
    objectives' own flags (their ``options`` and their ``<name>_…`` fields), the SDE rollout's without a trajectory,
    the entry's ``ignores``, and --timestep-fraction where --fm-timesteps replaces it; none for a name not here."""
    entry = CATALOGUE.get(name)
    if entry is None:
        return []
    others = [other for other in CATALOGUE.values() if other.name != name]
    unread: set[str] = {option for other in others for option in other.options} - set(entry.options)
    unread |= set(entry.ignores)
    if not entry.keeps_trajectory:
        unread |= set(TRAJECTORY_SETTINGS)
    if "fm_timesteps" in entry.options and settings.get("fm_timesteps"):
        unread.add("timestep_fraction")
    prefixes = tuple(f"{other.name}_" for other in others)
    return [key for key in settings if key in unread or key.startswith(prefixes)]


def register_objective(entry: ObjectiveEntry) -> None:
    """Add (or replace) an objective: ``--objective entry.name`` validates, sizes, guards and trains with it."""
    CATALOGUE[entry.name] = entry
