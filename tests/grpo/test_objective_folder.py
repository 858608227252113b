"""An objective is one folder plus one line: a toy objective written here as its own package (``settings.py``: a
torch-free settings class with one flag and its catalogue entry, which declares the rollout's initial noise;
``loss.py``: the loss and that noise), registered with ``register_objective`` as the shipped ones are, gets its flag
and YAML key, its checks and its refusals, and trains on the tiny CPU world and resumes bit for bit, with no edit
anywhere else."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import run, tiny_config

from fluxgrpo.cli import train as train_command  # imported before the toy registers: other tests see the shipped flags
from fluxgrpo.errors import UsageError

SETTINGS = '''
"""--objective toyfold: its one flag and its catalogue entry, torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from fluxgrpo.grpo.objectives.entry import ObjectiveEntry
from fluxgrpo.grpo.objectives.options import Options, option


@dataclass(frozen=True)
class ToyfoldOptions(Options):
    prefix = "toyfold"
    noise_scale: float = option(1.0, "The toy's initial noise scale.", exclusive=True)

    def problems(self) -> list[str]:
        if not 0 < self.noise_scale <= 2:
            return [f"--toyfold-noise-scale {self.noise_scale} must be in (0, 2]"]
        return []


ENTRY = ObjectiveEntry(
    "toyfold",
    "toyfold_objective.loss:ToyfoldObjective",
    keeps_trajectory=False,
    trainable_timesteps=lambda cfg: cfg.sampling_steps,
    settings=ToyfoldOptions,
    initial_noise="toyfold_objective.loss:scaled_noise",
)
'''

LOSS = '''
"""--objective toyfold: advantage-weighted flow matching on the ODE's final samples from scaled initial noise."""

from __future__ import annotations

import torch

from fluxgrpo.grpo.latents import pack_latents
from fluxgrpo.grpo.objectives.base import Metric, ModelInput, ObjectiveBase, StepLoss, UpdateStep
from fluxgrpo.grpo.objectives.nft.loss import FlowMatchingBatch

from toyfold_objective.settings import ToyfoldOptions


def scaled_noise(settings, num_prompts, group_size, size, generator, device):
    noise = torch.randn((num_prompts * group_size, *size), generator=generator, device=device, dtype=torch.float32)
    return pack_latents(noise * settings.noise_scale)


class ToyfoldWork:
    wants_reference = False
    precomputed_forwards = ()

    def __init__(self, rollout, advantages, generator_cpu):
        self.slots = 2
        self.train_timestep_indices = torch.stack(
            [torch.randperm(rollout.num_steps, generator=generator_cpu)[: self.slots] for _ in advantages]
        )
        self.batch = FlowMatchingBatch(rollout, self.train_timestep_indices, generator_cpu, advantages.device)
        self.advantages = advantages

    def model_input(self, start, stop, slot) -> ModelInput:
        return self.batch.model_input(start, stop, slot)

    def loss(self, step: UpdateStep) -> StepLoss:
        _, _, noise = self.batch.noised(step.start, step.stop, step.slot)
        velocity = step.velocity.float()
        matching = ((velocity - (noise - self.batch.x0[step.start : step.stop])) ** 2).mean(dim=(1, 2))
        weighted = (1 - self.advantages[step.start : step.stop]) * matching
        return StepLoss((weighted.mean(),), {"toyfold_matching": matching.detach().sum()})


class ToyfoldObjective(ObjectiveBase):
    name = "toyfold"
    keeps_trajectory = False
    metrics = {"toyfold_matching": Metric("toyfold_matching", "mean")}
    progress = "matching {toyfold_matching:.4g}"

    def __init__(self, settings: ToyfoldOptions) -> None:
        self.settings = settings
        self.policy_copies = {}

    @classmethod
    def from_config(cls, run, policy_copies):
        return cls(run.own(ToyfoldOptions))

    def prepare(self, rollout, advantages, layout, generator_cpu):
        return ToyfoldWork(rollout, advantages, generator_cpu)
'''


@pytest.fixture
def toyfold(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """The toy's folder on the import path, and its one registration line."""
    from fluxgrpo.grpo.objectives.catalogue import CATALOGUE, register_objective

    root = tmp_path_factory.mktemp("objective_folder")
    package = root / "toyfold_objective"
    package.mkdir()
    (package / "__init__.py").write_text('"""--objective toyfold."""\n')
    (package / "settings.py").write_text(textwrap.dedent(SETTINGS))
    (package / "loss.py").write_text(textwrap.dedent(LOSS))
    monkeypatch.syspath_prepend(str(root))
    from toyfold_objective import settings  # type: ignore[import-not-found]

    register_objective(settings.ENTRY)
    yield settings
    CATALOGUE.pop("toyfold", None)
    for name in [name for name in sys.modules if name.startswith("toyfold_objective")]:
        del sys.modules[name]


def _env_with_path(folder: str) -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([folder, *filter(None, [os.environ.get("PYTHONPATH")])])}


def exported(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.rglob("*.safetensors")):
        out.update({f"{path.parent.name}/{key}": value for key, value in load_file(path).items()})
    return out


def test_its_settings_module_is_torch_free_and_its_flag_is_generated(toyfold, tmp_path):
    from fluxgrpo.config import TrainConfig, build_config, config_fields

    # registering it, building and checking a config with its flag: no torch (validation runs before any worker)
    code = (
        "import sys\n"
        "from fluxgrpo.grpo.objectives.catalogue import register_objective\n"
        "from toyfold_objective.settings import ENTRY\n"
        "register_objective(ENTRY)\n"
        "from fluxgrpo.config import build_config\n"
        "assert build_config(None, {'objective': 'toyfold', 'toyfold_noise_scale': 0.5}).toyfold_noise_scale == 0.5\n"
        "heavy = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    package_root = str(Path(toyfold.__file__).parent.parent)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=_env_with_path(package_root))
    assert "toyfold_noise_scale" in {f.name for f in config_fields()}
    assert "toyfold_noise_scale" in {parameter.name for parameter in train_command._hyperparameter_parameters()}
    # the YAML key and the flag set the toy's settings object; TrainConfig has no field for it
    path = tmp_path / "run.yaml"
    path.write_text("objective: toyfold\ntoyfold_noise_scale: 0.5\n")
    cfg = build_config(str(path), {})
    assert cfg.settings_of(toyfold.ToyfoldOptions).noise_scale == 0.5 == cfg.to_dict()["toyfold_noise_scale"]
    assert "toyfold_noise_scale" not in {f.name for f in TrainConfig.__dataclass_fields__.values()}
    assert build_config(None, {"objective": "toyfold", "toyfold_noise_scale": 1.5}).toyfold_noise_scale == 1.5
    # its checks name its flag, before any worker starts; another objective refuses it off its default
    with pytest.raises(UsageError, match=r"--toyfold-noise-scale 3\.0 must be in \(0, 2\]"):
        build_config(None, {"objective": "toyfold", "toyfold_noise_scale": 3.0})
    with pytest.raises(UsageError, match="--toyfold-noise-scale 0.5: --objective grpo ignores it"):
        build_config(None, {"toyfold_noise_scale": 0.5})


def test_its_name_is_in_the_objective_flags_help(toyfold):
    from fluxgrpo.config import config_fields

    text = next(f for f in config_fields() if f.name == "objective").metadata["help"]
    assert text.startswith("Training objective: grpo (PPO-clip on the SDE's per-step log-probs), nft (DiffusionNFT)")
    assert "neighbor (Neighbor GRPO: PPO-clip on a softmax-distance policy over ODE neighbours) or toyfold; " in text
    option = next(p for p in train_command._hyperparameter_parameters() if p.name == "objective")
    assert "toyfold" in option.default.help


def test_the_toy_folder_trains_with_its_own_noise_and_resumes_bit_for_bit(
    toyfold, tiny_weights, tiny_embeddings, tmp_path
):
    def config(folder: str, **overrides):
        values = {"objective": "toyfold", "toyfold_noise_scale": 0.5, **overrides}
        return tiny_config(tiny_weights, tiny_embeddings, tmp_path / folder, **values)

    straight = run(config("straight"))
    run(config("resumed", max_train_steps=2))
    resumed = run(config("resumed"), resume="latest")
    assert [record["iteration"] for record in straight] == [record["iteration"] for record in resumed] == [1, 2, 3, 4]
    assert all(record["optimizer_steps"] > 0 and record["toyfold_matching"] > 0 for record in straight)
    keys = ("reward_mean", "loss", "toyfold_matching", "grad_norm_mean")
    assert [[r[k] for k in keys] for r in straight] == [[r[k] for k in keys] for r in resumed]
    a, b = exported(tmp_path / "straight" / "checkpoint-4"), exported(tmp_path / "resumed" / "checkpoint-4")
    assert a and a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    # the declared initial noise is the rollout's: another scale, another run
    other = run(config("other", max_train_steps=1, toyfold_noise_scale=1.0))
    assert other[0]["toyfold_matching"] != straight[0]["toyfold_matching"]
