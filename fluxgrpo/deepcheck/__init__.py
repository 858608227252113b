"""``fluxgrpo env-check --deep``: short, real checks on the selected device that training will be right and fit.

Six checks, each with a pass/fail rule and a measured figure, skipped (never passed) where the machine lacks what
one needs; every module's docstring states its rule and tolerance:

1. ``kernels``: the kernels the runtime swaps in on an accelerator vs the plain PyTorch ops (``runtime/kernel_check``);
2. ``iteration``: one GRPO iteration at learning rate 0 per sampler, |log ρ| of the first micro-batch;
3. ``iteration``: the same iteration's measured peak vs ``training.memory``'s estimate;
4. ``workers``: all-reduce / all-gather bandwidth across the dies and the process-group start-up;
5. ``workers``: the trainer's meta-device build and per-rank reads of the FLUX weights;
6. ``rewards``: every reward with weights on two drawn reference images, fp32 vs ``--reward-dtype``.

``run.run_deep_check`` runs them in that order and writes ``env-check-deep.json`` (``result.DeepReport``).
"""
