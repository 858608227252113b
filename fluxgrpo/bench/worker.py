"""``fluxgrpo bench --dies N``: N torchrun workers, each running the phase bench on its rank; rank 0's records come
back through a JSON-lines file."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fluxgrpo.bench.config import BenchConfig
from fluxgrpo.errors import UsageError

WORKER_MODULE = "fluxgrpo.bench.worker"


def launch_workers(
    cfg: BenchConfig, emit: Callable[[dict[str, Any]], None], log: Callable[[str], None]
) -> list[dict[str, Any]]:
    import json
    import tempfile

    from fluxgrpo.runtime import device as rt_device
    from fluxgrpo.runtime.launch import (
        LaunchSpec,
        build_torchrun_argv,
        run_torchrun,
        worker_env_defaults,
    )

    device_type = rt_device.resolve_device_type(cfg.device)
    if device_type != "cpu" and cfg.dies > rt_device.device_count(device_type):
        raise UsageError(
            f"--dies {cfg.dies} but only {rt_device.device_count(device_type)} {device_type} device(s) are visible"
        )
    with tempfile.TemporaryDirectory(prefix="fluxgrpo-bench-") as folder:
        config_path, records_path = Path(folder, "config.json"), Path(folder, "records.jsonl")
        config_path.write_text(json.dumps({**asdict(cfg), "resolutions": [f"{h}x{w}" for h, w in cfg.resolutions]}))
        argv = build_torchrun_argv(
            WORKER_MODULE,
            ["--config", str(config_path), "--records", str(records_path)],
            LaunchSpec(nproc_per_node=cfg.dies),
            python=sys.executable,
        )
        log("launching: " + " ".join(argv))
        run_torchrun(argv, env=worker_env_defaults(device_type))
        records = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
    for record in records:
        emit(record)
    return records


def _worker(config_path: Path, records_path: Path) -> None:
    import json

    import torch

    from fluxgrpo.bench.harness import bench_on_rank
    from fluxgrpo.runtime import dist as rt_dist

    cfg = BenchConfig.from_dict(json.loads(config_path.read_text())).validate()
    ctx = rt_dist.init_distributed(cfg.device)
    try:
        if ctx.device_type == "cpu" and ctx.distributed:
            torch.set_num_threads(1)  # the workers share the host's cores
        with records_path.open("a") as out:

            def emit(record: dict[str, Any]) -> None:
                if ctx.is_main:
                    out.write(json.dumps(record, default=str) + "\n")
                    out.flush()

            bench_on_rank(cfg, ctx, emit, lambda line: rt_dist.rank0_print(ctx, line))
    finally:
        rt_dist.teardown()


def main(argv: list[str] | None = None) -> None:
    """Worker entry point under torchrun: ``python -m fluxgrpo.bench.worker --config CONFIG.json --records OUT.jsonl``."""
    import argparse

    from fluxgrpo.runtime.launch import worker_errors

    parser = argparse.ArgumentParser(description="fluxgrpo bench worker (started by `fluxgrpo bench --dies N`)")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--records", required=True, type=Path)
    args = parser.parse_args(argv)
    worker_errors(_worker)(args.config, args.records)


if __name__ == "__main__":
    main()
