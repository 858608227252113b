"""``fluxgrpo train``: check everything a worker would trip over, save the resolved config, then launch.

Nothing heavy starts before the checks pass: weights and embeddings exist and agree with each other, the batch
arithmetic is consistent, and the output directory is writable. ``--dies 1`` on one node runs in this process;
otherwise we build the torchrun command (``runtime/launch.py``) and run ``fluxgrpo.grpo.trainer`` workers.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluxgrpo.config import TrainConfig, save_resolved
from fluxgrpo.errors import FluxgrpoError, UsageError
from fluxgrpo.runtime.launch import LaunchSpec, build_torchrun_argv, run_torchrun
from fluxgrpo.weights.layout import check_flux_dir, check_hps_dir, check_pickscore_dir, pickscore_dir

RESOLVED_CONFIG = "config.yaml"
WORKER_MODULE = "fluxgrpo.grpo.trainer"
REWARDS_NEEDING_HPS = ("hpsv2",)


@dataclass
class TrainPlan:
    cfg: TrainConfig
    spec: LaunchSpec
    device_type: str
    derived: dict[str, Any]
    worker_env: dict[str, str]
    resolved_path: Path
    resume: str | None


def preflight(cfg: TrainConfig) -> None:
    """Weights and embeddings are in place and match the transformer; raise with the fixing command if not."""
    from fluxgrpo.envcheck import embeddings_status

    flux = check_flux_dir(cfg.model)
    if not flux.complete:
        raise FluxgrpoError(f"FLUX weights in {cfg.model} are not usable ({'; '.join(flux.problems)}): {flux.fix}")
    if cfg.reward in REWARDS_NEEDING_HPS:
        for part in check_hps_dir(cfg.hps_dir):
            if not part.complete:
                raise FluxgrpoError(f"{part.name} weights are not usable ({'; '.join(part.problems)}): {part.fix}")
    if cfg.reward == "pickscore":
        status = check_pickscore_dir(pickscore_dir(cfg.hps_dir))
        if not status.complete:
            raise FluxgrpoError(f"PickScore weights are not usable ({'; '.join(status.problems)}): {status.fix}")
    emb_dir = Path(cfg.data_json_path).parent
    emb = embeddings_status(emb_dir)
    if not emb["complete"]:
        raise FluxgrpoError(
            f"embeddings in {emb_dir} are not usable ({'; '.join(emb['problems'])}): run "
            f"`fluxgrpo preprocess --model {cfg.model} --out {emb_dir}`, or point --data-json-path at them"
        )
    _check_embeddings_match_model(cfg)


def _check_embeddings_match_model(cfg: TrainConfig) -> None:
    import torch

    transformer_cfg = json.loads((Path(cfg.model) / "transformer" / "config.json").read_text())
    root = Path(cfg.data_json_path).parent
    first = json.loads(Path(cfg.data_json_path).read_text())[0]
    embed = torch.load(root / "prompt_embed" / first["prompt_embed_path"], map_location="cpu", weights_only=True)
    pooled = torch.load(root / "pooled_prompt_embeds" / first["pooled_prompt_embeds_path"], map_location="cpu",
                        weights_only=True)
    expected = (transformer_cfg["joint_attention_dim"], transformer_cfg["pooled_projection_dim"])
    found = (embed.shape[-1], pooled.shape[-1])
    if expected != found:
        raise FluxgrpoError(
            f"embeddings in {root} were made for another model (T5 width {found[0]}, CLIP width {found[1]}; "
            f"{cfg.model} expects {expected[0]} and {expected[1]}): re-run `fluxgrpo preprocess --model {cfg.model}`"
        )


def plan_training(cfg: TrainConfig, spec: LaunchSpec, resume: str | None = None) -> TrainPlan:
    """Validate and decide everything about the launch without starting it."""
    from fluxgrpo.runtime import device as rt_device
    from fluxgrpo.runtime.launch import worker_env_defaults

    cfg.validate()
    spec.validate()
    device_type = rt_device.resolve_device_type(cfg.device)
    if spec.world_size > 1 and device_type != "cpu":
        available = rt_device.device_count(device_type)
        if spec.nproc_per_node > available:
            raise UsageError(f"--dies {spec.nproc_per_node} but only {available} {device_type} device(s) are visible")
    worker_env = worker_env_defaults(device_type)  # shown in the resolved config; the user's own values win
    output_dir = Path(cfg.output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise FluxgrpoError(f"cannot write to --output-dir {output_dir} ({exc.strerror}): choose another") from None
    derived = cfg.derived(spec.world_size)
    return TrainPlan(cfg, spec, device_type, derived, worker_env, output_dir / RESOLVED_CONFIG, resume)


def launch_training(plan: TrainPlan, log=print) -> list[dict[str, Any]]:
    """Save the resolved config and run the workers; returns rank 0's metrics records."""
    from fluxgrpo.metrics import read_metrics

    preflight(plan.cfg)
    extra = {"device_type": plan.device_type, **{f"env {k}": v for k, v in plan.worker_env.items()}}
    save_resolved(plan.cfg, plan.resolved_path, plan.derived, extra)
    for key, value in plan.derived.items():
        log(f"  {key.replace('_', ' ')}: {value}")
    log(f"resolved config saved to {plan.resolved_path}")
    if plan.spec.world_size == 1:
        from fluxgrpo.grpo.trainer import train

        import os

        os.environ.update({k: v for k, v in plan.worker_env.items() if k not in os.environ})
        return train(plan.cfg, plan.resume)
    args = ["--config", str(plan.resolved_path)]
    if plan.resume is not None:
        args += ["--resume", plan.resume]
    argv = build_torchrun_argv(WORKER_MODULE, args, plan.spec, python=sys.executable,
                               log_dir=Path(plan.cfg.output_dir) / "logs")
    log("launching: " + " ".join(argv))
    run_torchrun(argv, env=plan.worker_env)
    return read_metrics(Path(plan.cfg.output_dir))
