"""What an objective declares to the run, without torch: its catalogue entry (``ObjectiveEntry``: its settings
class, what its rollout needs, its sizes and checks) and what its loss reads of the run (``ObjectiveRun``). Each
objective's folder builds its entry in ``<name>/settings.py``; ``catalogue.py`` registers them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fluxgrpo.grpo.objectives.options import Options, OptionSet, option_fields

if TYPE_CHECKING:
    from fluxgrpo.config import TrainConfig

SettingsT = TypeVar("SettingsT", bound=Options)

OLD_POLICY, EMA_POLICY = "old_policy", "ema_policy"  # the names policy copies are saved under
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
    """One objective as the run's plumbing sees it. ``cfg`` below is a ``TrainConfig`` (imported for type checking
    only); the objective's own values are ``cfg.settings_of(<its settings class>)``."""

    name: str
    # The class to train with: "module:Class" (imported when a run builds it) or the class itself; its
    # ``from_config(run, policy_copies)`` gets an ``ObjectiveRun`` and returns a ``base.Objective``.
    builder: str | Callable[..., Any]
    # True: the rollout is the SDE with per-step log-probs (``Rollout``); False: the ODE's final samples only.
    keeps_trajectory: bool
    # cfg → the timesteps a sample may train on (T_train = int(this·fraction)).
    trainable_timesteps: Callable[[TrainConfig], int]
    # The copies of the trainable weights it keeps (saved with checkpoints, counted by the memory model).
    policy_copies: Callable[[TrainConfig], tuple[str, ...]] = _no_copies
    # Problems of a run with this objective (settings it cannot train with; its settings' own problems are theirs).
    run_problems: Callable[[TrainConfig], list[str]] = _no_problems
    # Its settings class (its flags, their help and checks), and the settings classes it shares with others: their
    # flags are generated from them; ``options`` below says which of them it reads.
    settings: type[Options] | None = None
    shared: tuple[type[Options], ...] = ()
    # cfg → T_train, when it is not int(trainable·fraction).
    train_timesteps: Callable[[TrainConfig], int] | None = None
    # (sharing, timestep rule) of ``--fm-draws auto`` / ``--fm-timestep-rule auto``: the authors'.
    draws: tuple[str, str] = ("sample", "stratified")
    # cfg → the samples one rank's update trains (micro-batches cut these): every trajectory by default.
    trained_samples: Callable[[TrainConfig], int] | None = None
    # cfg → latent rows one trained sample puts through a training forward (V-GRPO's N_MC pairs: one batch).
    rows_per_forward: Callable[[TrainConfig], int] | None = None
    # cfg → the update's kept latents when they are not the final-sample formula of ``update_latents``.
    kept_latents: Callable[[TrainConfig], int] | None = None
    # Settings it does not read (``TRAJECTORY_SETTINGS`` aside; a shared class's flags among them): the report leaves
    # them out of the run's config table, and a shared flag here is refused off its default.
    ignores: tuple[str, ...] = ()
    # The initial noises of its rollout when it draws them itself: "module:function" (or the function) called as
    # ``f(settings, num_prompts, group_size, latent_size (C, h, w), generator, device)`` → packed [P·G, L, C]
    # (None: Gaussian noise, group-shared with ``TrainConfig.shares_group_noise``). What the rollout keeps is the
    # objective's to say (``base.Objective``: the trajectory, the step means, the ODE path).
    initial_noise: str | Callable[..., Any] | None = None
    # A few words on what it is, shown after its name in --objective's help: "grpo (PPO-clip on …)".
    summary: str = ""

    @property
    def groups(self) -> tuple[type[Options], ...]:
        """The settings classes it reads from: its own, then the shared ones."""
        return ((self.settings,) if self.settings is not None else ()) + self.shared

    @property
    def options(self) -> tuple[str, ...]:
        """The exclusive flags (config keys) it reads: one left off its default is refused, naming it, with an
        objective that does not read it."""
        return tuple(
            f.key for group in self.groups for f in option_fields(group) if f.exclusive and f.key not in self.ignores
        )

    @property
    def reads(self) -> tuple[str, ...]:
        """Every flag of its settings classes it reads."""
        return tuple(f.key for group in self.groups for f in option_fields(group) if f.key not in self.ignores)

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


@dataclass(frozen=True)
class ObjectiveRun:
    """What an objective's loss reads of the run (``training/settings.py`` builds it from the config; the loss never
    sees the config): its own settings, the settings it shares, and the general values every objective may read."""

    settings: Options | None  # its settings class's values (None for an objective without one)
    shared: OptionSet  # the run's settings classes (``of(cls)``: one's values)
    train_timesteps: int  # T_train
    group_size: int  # --num-generations G
    clip_range: float
    kl_beta: float
    adv_clip_max: float
    ratio_normalization: str
    draws: tuple[str, str]  # (sharing, timestep rule) of the (t, ε) draws, ``auto`` resolved

    def own(self, cls: type[SettingsT]) -> SettingsT:
        """Its settings as ``cls`` (the type its loss expects)."""
        if not isinstance(self.settings, cls):
            raise TypeError(f"settings {type(self.settings).__name__}, not {cls.__name__}")
        return self.settings
