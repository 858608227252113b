"""A tiny training run that SIGKILLs itself at one chosen point, for tests/checkpoint/test_hostile_resume.py.

    python tests/_kill_worker.py CONFIG_JSON SITE CALL

``SITE`` is ``module:attribute`` (a function the run calls, e.g. ``fluxgrpo.checkpoint:_write_durably``); on its
``CALL``-th call the process sends itself SIGKILL before the call runs: no handler, no cleanup, no flush, exactly
as the OOM killer or a preempted node would stop it (mid-file of a checkpoint save included).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import signal
import sys
from pathlib import Path


def arm(site: str, call: int) -> None:
    module_name, attribute = site.split(":")
    owner: object = importlib.import_module(module_name)
    *parents, name = attribute.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original = getattr(owner, name)
    calls = 0

    @functools.wraps(original)
    def killing(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == call:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(owner, name, killing)


def main() -> None:
    from fluxgrpo.config import TrainConfig
    from fluxgrpo.runtime.launch import LaunchSpec
    from fluxgrpo.training.launch_plan import launch_training, plan_training

    config, site, call = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = TrainConfig(**json.loads(Path(config).read_text())).validate()
    arm(site, call)
    launch_training(plan_training(cfg, LaunchSpec(nproc_per_node=1)), log=lambda _: None)


if __name__ == "__main__":
    main()
