"""Before ``fluxgrpo train`` starts the loop: check everything a worker would trip over, save the resolved config,
then launch the workers (the loop itself is ``fluxgrpo/training/loop.py``).

Nothing heavy starts before the checks pass: weights and embeddings exist and agree with each other, the batch
arithmetic is consistent, and the output directory is writable. ``runtime.launch.run_workers`` then runs
``fluxgrpo.training.loop.worker_entry`` in this process (``--dies 1`` on one node) or on torchrun workers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxgrpo.checkpoint.layout import read_checkpoint_info, resolve_resume
from fluxgrpo.config import TrainConfig, save_resolved
from fluxgrpo.data.embeddings import EmbeddingDataset
from fluxgrpo.envcheck import embeddings_status
from fluxgrpo.errors import FluxgrpoError, UsageError, not_usable
from fluxgrpo.metrics import read_metrics
from fluxgrpo.paths import ensure_writable_dir
from fluxgrpo.rewards import reward_weights_status
from fluxgrpo.rewards.registry import reward_record
from fluxgrpo.rewards.reward_set import eval_reward_names, reward_spec_names, run_reward_names
from fluxgrpo.run_folder import (
    CONFIG_FILE,
    EVAL_DIR,
    INDEX_FILE,
    LOGS_DIR,
    check_not_in_use,
    check_run_files,
    foreign_run_files,
    lock_run_folder,
    move_previous_run,
    previous_run,
)
from fluxgrpo.runtime import device as rt_device
from fluxgrpo.runtime.adapt import compile_backend
from fluxgrpo.runtime.dist import CollectiveTimeout
from fluxgrpo.runtime.launch import (
    DEFAULT_PORT,
    LaunchSpec,
    check_dies_fit,
    run_id_for,
    run_workers,
    worker_env_defaults,
)
from fluxgrpo.runtime.nodes import slurm_job
from fluxgrpo.training.eval import eval_prompt_list
from fluxgrpo.training.memory import plan_memory
from fluxgrpo.training.resume_state import read_training_state
from fluxgrpo.weights.layout import check_flux_dir

if TYPE_CHECKING:
    from fluxgrpo.training.memory import MemoryEstimate

WORKER_MODULE = "fluxgrpo.training.loop"


@dataclass
class TrainPlan:
    cfg: TrainConfig
    spec: LaunchSpec
    device_type: str
    derived: dict[str, Any]
    worker_env: dict[str, str]
    resolved_path: Path
    resume_checkpoint: str | None  # the exact checkpoint folder, resolved once here so every rank agrees
    memory: MemoryEstimate  # per die
    overwrite: bool = False  # move an earlier run in the output directory aside (``run_folder.move_previous_run``)
    skipped_checks: list[str] = field(default_factory=list)  # --dry-run for a device not here


def preflight(cfg: TrainConfig, absent_ok: bool = False) -> list[str]:
    """Weights and embeddings are in place and match the transformer; raise with the fixing command if not.

    With ``absent_ok`` (a dry run: its plan needs no weights) a folder that does not exist at all is not checked,
    and the returned lines say so; whatever is there is checked as always (a damaged file still fails).
    """

    absent = []
    if absent_ok and not Path(cfg.model).exists():
        absent.append(f"FLUX weights ({cfg.model} does not exist: `fluxgrpo fetch-weights` puts them there)")
    else:
        flux = check_flux_dir(cfg.model)
        if not flux.complete:
            raise not_usable(f"FLUX weights in {cfg.model}", flux.problems, flux.fix)
    if absent_ok and not Path(cfg.hps_dir).exists():
        absent.append(f"reward weights ({cfg.hps_dir} does not exist: `fluxgrpo fetch-weights` puts them there)")
    else:
        for reward in run_reward_names(cfg.reward, cfg.eval_rewards, cfg.eval_every):
            for part in reward_weights_status(reward, cfg.hps_dir):
                if not part.complete:
                    raise not_usable(f"{part.name} weights for --reward {reward}", part.problems, part.fix)
    emb_dir = Path(cfg.data_json_path).parent
    if absent_ok and not emb_dir.exists():
        return [*absent, f"embeddings ({emb_dir} does not exist: `fluxgrpo preprocess` writes them)"]
    emb = embeddings_status(emb_dir)
    if not emb["complete"]:
        raise not_usable(
            f"embeddings in {emb_dir}",
            emb["problems"],
            f"run `fluxgrpo preprocess --model {cfg.model} --out {emb_dir}`, or point --data-json-path at them",
        )
    if not absent:
        _check_embeddings_match_model(cfg)
    if cfg.eval_every > 0:
        eval_prompt_list(cfg)  # an empty, blank or binary --eval-prompts file, refused before any run file exists
    if not absent:
        _check_rewards_read_their_prompts(cfg)
    return absent


def _check_rewards_read_their_prompts(cfg: TrainConfig) -> None:
    """A reward that reads only some prompts (shapes: its world's captions) checks the training captions, and with
    evaluation on the held-out prompts, before any worker starts."""

    evaluated = eval_reward_names(cfg.reward, cfg.eval_rewards) if cfg.eval_every > 0 else []
    checks = [
        (name, reward_record(name).prompt_problems)
        for name in dict.fromkeys([*reward_spec_names(cfg.reward), *evaluated])
    ]
    if not any(check for _, check in checks):
        return

    training = EmbeddingDataset(cfg.data_json_path).captions
    held_out = eval_prompt_list(cfg) if evaluated else []
    for name, check in checks:
        if check is None:
            continue
        prompts = [
            *(training if name in reward_spec_names(cfg.reward) else []),
            *(held_out if name in evaluated else []),
        ]
        problems = check(prompts)
        if problems:
            raise UsageError(problems[0])


def _check_embeddings_match_model(cfg: TrainConfig) -> None:
    """Every embedding file is a tensor file of the right shape for this transformer, checked now rather than when
    its prompt is first drawn hours into the run (headers only: the files are memory-mapped, not read)."""

    EmbeddingDataset(cfg.data_json_path).validate(cfg.model)


# Settings a resumed run may change without breaking exactness: where things are, how long to go, what to log.
RESUME_FREE_FIELDS = frozenset(
    {
        "model",
        "hps_dir",
        "data_json_path",
        "output_dir",
        "model_family",  # sizes the dry-run plan only
        "dies",  # the world size is checked on its own (check_resume_compatible)
        "device",
        "max_train_steps",
        "checkpointing_steps",
        "keep_last",
        "save_images_every",
        "images_per_save",
        "tensorboard",
        "wandb",
        "wandb_project",
        "wandb_name",
        "wandb_mode",
        "eval_every",
        "eval_prompts",
        "eval_images_per_prompt",
        "eval_steps",
        "eval_rewards",
        "guard",  # guards and the best checkpoint only read metrics (training/guards.py)
        "guard_action",
        "keep_best",
    }
)


def check_output_dir(output_dir: Path, create: bool) -> None:
    """The output directory can be written (created when ``create``; a dry run only checks its nearest parent)."""

    if create:
        ensure_writable_dir(output_dir, "checkpoints", "--output-dir")
        return
    existing = output_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise FluxgrpoError(
            f"cannot write to --output-dir {output_dir} ({existing} is not a writable folder): choose another"
        )


def check_resume_compatible(cfg: TrainConfig, checkpoint: Path, world_size: int) -> None:
    """A resume is exact only with the same world size and the same algorithm settings; say which differ."""

    info = read_checkpoint_info(checkpoint)
    problems = []
    if int(info["world_size"]) != world_size:
        problems.append(
            f"it was written by {info['world_size']} worker(s), this run has {world_size}: "
            f"use --dies {info['world_size']} (with the same --nnodes)"
        )
    if cfg.use_ema and not info.get("has_ema", False):
        problems.append("it has no EMA state but --use-ema is on: drop --use-ema")
    saved = read_training_state(checkpoint)["config"]  # shape-checked: a hand-edited state is one line, here
    now = cfg.to_dict()
    for key in sorted(now):
        if key in RESUME_FREE_FIELDS or key not in saved or saved[key] == now[key]:
            continue
        problems.append(f"--{key.replace('_', '-')} was {saved[key]!r}, now {now[key]!r}")
    if problems:
        raise UsageError(
            f"cannot resume exactly from {checkpoint}:\n  - "
            + "\n  - ".join(problems)
            + "\n(start a new run with another --output-dir to change these)"
        )


def check_eval_prompts_unchanged(cfg: TrainConfig, output_dir: Path) -> None:
    """A resumed run evaluates the prompts its earlier evaluations did: one eval curve, one prompt set."""
    if cfg.eval_every <= 0:
        return

    earlier = sorted((output_dir / EVAL_DIR).glob(f"iteration-*/{INDEX_FILE}"), key=lambda p: p.stat().st_mtime)
    for index in reversed(earlier):
        try:
            prompts = json.loads(index.read_text(encoding="utf-8"))["prompts"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged evaluation says nothing about the prompt set; the report leaves it out
        now = eval_prompt_list(cfg)
        if prompts != now:
            source = cfg.eval_prompts or "the shipped held-out prompts"
            raise UsageError(
                f"--eval-prompts: {source} holds other prompts than this run's earlier evaluations "
                f"({index.parent.name}: {len(prompts)} prompts, now {len(now)}), so the eval curve would mix two "
                "prompt sets: pass the --eval-prompts the run started with, or start a new run with another "
                "--output-dir"
            )
        return


def check_previous_run(output_dir: Path, resume: str | None, overwrite: bool) -> None:
    """A new run never writes over an earlier one: without --resume a folder holding a run needs --overwrite."""
    if resume is not None and overwrite:
        raise UsageError("--overwrite starts the run over and --resume continues it: pass one of them")
    foreign = foreign_run_files(output_dir)
    if foreign and not overwrite:
        raise UsageError(
            f"--output-dir {output_dir} holds {' and '.join(foreign)} that fluxgrpo did not write (a run's own "
            f"{CONFIG_FILE} begins with its resolved-config header), and the run would replace it: move it away, "
            f"choose another --output-dir, or pass --overwrite to move it to {output_dir.name}.replaced-<UTC time>"
        )
    found = previous_run(output_dir)
    if found and resume is None and not overwrite:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise UsageError(
            f"--output-dir {output_dir} already holds a run ({shown}): continue it with --resume, or start over "
            f"with another --output-dir, or with --overwrite (which moves the old run's files to "
            f"{output_dir.name}.replaced-<UTC time>, beside it)"
        )


def check_resume_not_done(cfg: TrainConfig, checkpoint: Path) -> None:
    """A resume must have iterations left to run; one already at --max-train-steps would silently do nothing."""

    done = int(read_checkpoint_info(checkpoint)["iteration"])
    if done >= cfg.max_train_steps:
        raise UsageError(
            f"{checkpoint} has already run {done} iterations and --max-train-steps is {cfg.max_train_steps}: "
            f"nothing to resume; raise --max-train-steps above {done} to train further"
        )


def plan_training(
    cfg: TrainConfig, spec: LaunchSpec, resume: str | None = None, *, dry_run: bool = False, overwrite: bool = False
) -> TrainPlan:
    """Validate and decide everything about the launch without starting it: config, devices, weights,
    embeddings, output directory (not in use by a live run, not holding an earlier run unless resumed or
    overwritten), logging back-ends and the checkpoint to resume from."""

    cfg.validate()
    spec.validate()
    if cfg.cpu_offload and spec.world_size == 1:
        raise UsageError(
            "--cpu-offload moves FSDP shards to host memory and needs more than one worker: "
            "use --dies 2 or more, or drop --cpu-offload"
        )
    skipped: list[str] = []
    try:
        device_type = rt_device.resolve_device_type(cfg.device)
        check_dies_fit(device_type, spec.nproc_per_node)
    except FluxgrpoError as exc:
        if not dry_run or cfg.device == "auto":
            raise
        # Planning for a machine this is not (a laptop for the cluster): estimate for the configured device and
        # die count, and say what could not be checked here.
        device_type = cfg.device
        skipped.append(f"{cfg.device} × {spec.nproc_per_node} on this machine ({exc})")
    if cfg.compile and not skipped:
        compile_backend(device_type)  # refuses --compile where it is not supported, before any worker starts
    for flag, module, extra in (("tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb")):
        if getattr(cfg, flag) and importlib.util.find_spec(module) is None:
            raise UsageError(f"--{flag} needs the {module} package: pip install 'fluxgrpo[{extra}]'")
    worker_env = worker_env_defaults(device_type)  # shown in the resolved config
    output_dir = Path(cfg.output_dir)
    check_output_dir(output_dir, create=not dry_run)
    if spec.node_rank == 0:  # node 0 owns the folder; the other nodes of a shared one find node 0's run there
        check_run_files(output_dir)
        check_not_in_use(output_dir)
        check_previous_run(output_dir, resume, overwrite)
    skipped += preflight(cfg, absent_ok=dry_run)  # a plan needs no weights: it is sized from the config's model
    memory = plan_memory(cfg, spec.world_size, device_type, dry_run=dry_run)
    if skipped:
        skipped.append(f"the estimate against the {device_type} devices' memory (none visible here)")
    checkpoint = resolve_resume(output_dir, resume) if resume is not None else None
    if checkpoint is not None:
        check_resume_compatible(cfg, checkpoint, spec.world_size)
        check_eval_prompts_unchanged(cfg, output_dir)
        check_resume_not_done(cfg, checkpoint)
    derived = cfg.derived(spec.world_size)
    return TrainPlan(
        cfg,
        spec,
        device_type,
        derived,
        worker_env,
        output_dir / CONFIG_FILE,
        None if checkpoint is None else str(checkpoint),
        memory,
        overwrite,
        skipped,
    )


def launch_spec(
    cfg: TrainConfig,
    *,
    dies: int,
    nnodes: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    collective_timeout: CollectiveTimeout | None = None,
    log=print,
) -> LaunchSpec:
    """The launch that ``fluxgrpo train``'s flags describe; under Slurm (``srun``, one task per node) the job's
    node count, this node's index and node 0's host fill in what the flags leave out. The elastic rendezvous
    is named after the output folder, so two runs never meet."""

    job = slurm_job() if nnodes is None and node_rank is None and not (master_addr or rdzv_endpoint) else None
    if job is not None:
        nnodes, node_rank = job.nnodes, job.node_rank
        if max_restarts:  # restarts need the elastic rendezvous, at node 0's host
            rdzv_endpoint = f"{job.first_host}:{master_port or DEFAULT_PORT}"
        else:
            master_addr = job.first_host
        log(f"Slurm: node {node_rank} of {nnodes}, node 0 is {job.first_host}")
    return LaunchSpec(
        nproc_per_node=dies,
        nnodes=1 if nnodes is None else nnodes,
        node_rank=0 if node_rank is None else node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_endpoint=rdzv_endpoint,
        run_id=run_id_for(cfg.output_dir),
        max_restarts=max_restarts,
        collective_timeout=collective_timeout,
    )


def launch_training(plan: TrainPlan, log=print) -> list[dict[str, Any]]:
    """Save the resolved config and run the workers, holding the output directory's lock (node 0) for the
    run's life; returns the run's metrics records (metrics.jsonl)."""

    output_dir = Path(plan.cfg.output_dir)
    owner = plan.spec.node_rank == 0
    held: contextlib.AbstractContextManager[dict[str, Any]] = (
        lock_run_folder(output_dir) if owner else contextlib.nullcontext({})
    )
    with held as stale:
        if stale.get("pid"):
            log(f"took over the lock of a run that is no longer running (pid {stale['pid']} on {stale.get('host')})")
        if owner and plan.overwrite and previous_run(output_dir):
            log(f"moved the previous run to {move_previous_run(output_dir)}")
        extra = {"device_type": plan.device_type, **{f"env {k}": v for k, v in plan.worker_env.items()}}
        if plan.resume_checkpoint:
            extra["resumed_from"] = plan.resume_checkpoint
        save_resolved(plan.cfg, plan.resolved_path, plan.derived, extra)
        for key, value in plan.derived.items():
            log(f"  {key.replace('_', ' ')}: {value}")
        log(f"resolved config saved to {plan.resolved_path}")
        payload: dict[str, Any] = {"config": plan.cfg.to_dict(), "resume": plan.resume_checkpoint}
        if plan.spec.max_restarts:  # restarted workers tell a restart from a first start by this token
            payload["launch_token"] = uuid.uuid4().hex
        run_workers(WORKER_MODULE, payload, plan.spec, plan.device_type, log_dir=output_dir / LOGS_DIR, log=log)
    return read_metrics(output_dir)
