"""Running the phase bench: ``run_bench`` starts ``worker_entry`` on ``--dies`` workers through the project's one
launch path (``runtime.launch.run_workers``: in this process for one worker, under torchrun for more), each rank
measuring with ``harness.bench_on_rank``. Rank 0 appends its records to a JSON-lines file as they are measured;
the launching process follows that file, so the records reach ``emit`` as they come in both cases."""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fluxgrpo.bench.config import BenchConfig
from fluxgrpo.bench.harness import bench_on_rank
from fluxgrpo.runtime import dist as rt_dist
from fluxgrpo.runtime.adapt import compile_backend
from fluxgrpo.runtime.device import resolve_device_type
from fluxgrpo.runtime.launch import LaunchSpec, run_workers
from fluxgrpo.runtime.worker import worker_session

POLL_SECONDS = 0.2


def worker_entry(payload: dict[str, Any]) -> None:
    """Every rank's part of the phase bench; rank 0 appends its records to ``payload["records"]``."""

    cfg = BenchConfig.from_dict(payload["config"]).validate()
    with worker_session(cfg.device) as ctx, Path(payload["records"]).open("a", encoding="utf-8") as out:

        def emit(record: dict[str, Any]) -> None:
            if ctx.is_main:
                out.write(json.dumps(record, default=str) + "\n")
                out.flush()

        bench_on_rank(cfg, ctx, emit, lambda line: rt_dist.rank0_print(ctx, line))


def run_bench(
    cfg: BenchConfig,
    emit: Callable[[dict[str, Any]], None] = lambda record: None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> list[dict[str, Any]]:
    """Run the phase bench on ``cfg.dies`` workers (rank 0 reports); returns rank 0's records (see
    ``harness.bench_on_rank``), each also passed to ``emit`` as soon as it is measured. ``log`` gets the launch
    line; the workers' progress goes to stderr."""

    cfg.validate()
    if cfg.compile:
        compile_backend(resolve_device_type(cfg.device))  # refused where unsupported, before any worker starts
    payload_config = {**asdict(cfg), "resolutions": [f"{h}x{w}" for h, w in cfg.resolutions]}
    with tempfile.TemporaryDirectory(prefix="fluxgrpo-bench-") as folder:
        records_path = Path(folder, "records.jsonl")
        records_path.touch()
        with follow_json_lines(records_path, emit) as records:
            run_workers(
                __name__,
                {"config": payload_config, "records": str(records_path)},
                LaunchSpec(nproc_per_node=cfg.dies),
                cfg.device,
                log=log,
            )
    return records


@contextlib.contextmanager
def follow_json_lines(path: Path, emit: Callable[[dict[str, Any]], None]) -> Iterator[list[dict[str, Any]]]:
    """While the block runs, a thread passes every complete line appended to ``path`` (parsed) to ``emit``; the
    lines still unread when it ends are passed then. Yields the list the parsed lines are collected in."""
    records: list[dict[str, Any]] = []
    done = threading.Event()

    def follow() -> None:
        with path.open(encoding="utf-8") as handle:
            pending = ""
            while True:
                finished = done.wait(POLL_SECONDS)  # read once more after the block: the lines written last
                *lines, pending = (pending + handle.read()).split("\n")
                for line in lines:
                    if line.strip():
                        records.append(json.loads(line))
                        emit(records[-1])
                if finished:
                    return

    follower = threading.Thread(target=follow, name="bench-records", daemon=True)
    follower.start()
    try:
        yield records
    finally:
        done.set()
        follower.join()
