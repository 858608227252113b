"""Retain (LeanGRPO's recompute-free on-policy update, ``--retain-rollout-graphs``): the rollout keeps the autograd
graph of every trained step's forward, and the update back-propagates through it instead of running that forward
again.

Why it is the same math. On-policy (one optimizer step per rollout, which the config checks), the update's forward
at a trained (trajectory, step) sees the same weights, the same input z_k, the same timestep, conditioning and
guidance as the rollout's forward there: recomputing it yields the velocity the rollout already had. So the rollout
runs the trained rows of each step with gradients enabled and keeps their output; the update feeds the loss a detached
copy of those rows (a leaf), back-propagates the loss to it, and hands that gradient to the kept graph, which then
back-propagates into the weights. After the first optimizer step the kept graphs would give the gradient at the old
weights, so the driver refuses them there (``RetainedGraphs.check_layout``).

What it costs. Which steps a trajectory trains is drawn before the rollout, from a copy of the update's generator (the
update draws the same ones again, and ``check_indices`` compares them). At a step, a rollout chunk's trained rows run
as one forward with gradients, the others as one without (a chunk whose rows all train, as in every window config,
stays one forward); so only the trained forwards keep activations, and each graph is back-propagated once, when all
its rows have their gradients. The kept activations (gradient checkpointing: every block's input) live from the
rollout to the update: ``training/memory.py`` sizes them.

Bitwise where the arithmetic is the same: with one trajectory per rollout chunk and per micro-batch, every kept graph
is exactly the forward the update would have run, and it is back-propagated at the same point of the update, so the
gradients and the weights equal the recomputing update's bit for bit (tests/grpo/test_retain.py). With larger
batches, the forwards and the weight gradients reduce over other groupings of rows: equal within fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# One forward of rows (global trajectory indices, in order) of the rollout at one step: (rows, inputs [r, L, C]) → v.
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Graph:
    """One kept forward: its output with its graph, the trajectories it holds, and their gradients as they come."""

    output: torch.Tensor  # [r, L, C] with grad_fn
    rows: torch.Tensor  # [r] int64, global trajectory indices
    grad: torch.Tensor | None = None  # [r, L, C], filled row by row by the update
    pending: int = 0  # rows whose gradient has not come yet


@dataclass
class _Lookup:
    """The leaf an update step was handed and where each of its rows lives: (graph key, row in that graph)."""

    leaf: torch.Tensor
    places: list[tuple[tuple[int, int], int]] = field(default_factory=list)


class RetainedGraphs:
    """The trained forwards of one rollout, kept for its update (the module docstring)."""

    def __init__(self, train_indices: torch.Tensor, num_steps: int) -> None:
        """``train_indices`` [B, T] int64: the σ-table step each trajectory trains at each slot (as the objective will
        draw them); ``num_steps`` N."""
        self.train_indices = train_indices.to("cpu", torch.int64)
        num_trajectories = self.train_indices.shape[0]
        self.trains = torch.zeros((num_trajectories, num_steps), dtype=torch.bool)  # [B, N] cpu
        self.trains[torch.arange(num_trajectories).unsqueeze(1), self.train_indices] = True
        self._graphs: dict[tuple[int, int], _Graph] = {}  # (step, first row) → graph
        self._where: dict[tuple[int, int], tuple[tuple[int, int], int]] = {}  # (row, step) → (graph key, local row)
        self._lookup: _Lookup | None = None
        self.kept_rows = 0  # row-forwards kept with their activations (the memory model's count)

    # ------------------------------------------------------------------------------------------ the rollout side

    def velocity(self, forward: Forward, x: torch.Tensor, start: int, stop: int, step: int) -> torch.Tensor:
        """v [stop−start, L, C] of trajectories start…stop−1 at ``step``, detached; the trained rows' forward runs with
        gradients and is kept. ``forward(rows, x_rows)`` is the rollout's model call for those rows."""
        trains = self.trains[start:stop, step]
        rows = torch.arange(start, stop)
        if not bool(trains.any()):
            return forward(rows, x)
        if bool(trains.all()):  # a copy: the graph saves its input, and the rollout writes on into the latents' store
            return self._keep(forward, rows, x.clone(), step)
        local = trains.nonzero().squeeze(1)
        others = (~trains).nonzero().squeeze(1)
        kept = self._keep(forward, rows[local], x[local.to(x.device)], step)
        rest = forward(rows[others], x[others.to(x.device)])
        velocity = torch.empty((stop - start, *kept.shape[1:]), dtype=kept.dtype, device=kept.device)
        velocity[local.to(kept.device)] = kept
        velocity[others.to(kept.device)] = rest
        return velocity

    def _keep(self, forward: Forward, rows: torch.Tensor, x: torch.Tensor, step: int) -> torch.Tensor:
        with torch.enable_grad():
            output = forward(rows, x)
        if not output.requires_grad:
            raise RuntimeError("--retain-rollout-graphs: the rollout's forward has no graph (no trainable parameter?)")
        key = (step, int(rows[0]))
        self._graphs[key] = _Graph(output, rows, pending=rows.numel())
        for local, row in enumerate(rows.tolist()):
            self._where[(row, step)] = (key, local)
        self.kept_rows += rows.numel()
        return output.detach()

    # ------------------------------------------------------------------------------------------- the update side

    def check_indices(self, train_indices: torch.Tensor) -> None:
        """The update drew the steps the rollout kept (a different draw is a programming error)."""
        if not torch.equal(train_indices.to("cpu", torch.int64), self.train_indices):
            raise RuntimeError("--retain-rollout-graphs: the update trains other steps than the rollout kept")

    @staticmethod
    def check_layout(num_micro_batches: int, grad_accum_steps: int) -> None:
        """Every micro-batch before the first optimizer step: the kept graphs hold the rollout's weights."""
        if num_micro_batches > grad_accum_steps:
            raise ValueError(
                f"--retain-rollout-graphs needs one optimizer step per rollout, got {num_micro_batches} micro-batches "
                f"for {grad_accum_steps} per step: raise --gradient-accumulation-steps or turn the flag off"
            )

    def step_velocity(self, rows: range, steps: torch.Tensor) -> torch.Tensor:
        """[m, L, C] the kept velocities of trajectories ``rows`` at their ``steps`` [m], as a leaf that collects the
        loss's gradient (``after_backward`` hands it on)."""
        places = [self._where[(row, int(step))] for row, step in zip(rows, steps.tolist(), strict=True)]
        leaf = torch.stack([self._graphs[key].output.detach()[local] for key, local in places]).requires_grad_()
        self._lookup = _Lookup(leaf, places)
        return leaf

    def after_backward(self) -> None:
        """Hand the last step's gradient to its graphs; back-propagate each graph whose rows all have theirs."""
        lookup, self._lookup = self._lookup, None
        if lookup is None:
            return
        grad = lookup.leaf.grad if lookup.leaf.grad is not None else torch.zeros_like(lookup.leaf)
        complete: list[tuple[int, int]] = []
        for index, (key, local) in enumerate(lookup.places):
            graph = self._graphs[key]
            if graph.grad is None:
                graph.grad = torch.zeros_like(graph.output)
            graph.grad[local] = grad[index]
            graph.pending -= 1
            if graph.pending == 0:
                complete.append(key)
        for key in complete:
            graph = self._graphs.pop(key)
            torch.autograd.backward(graph.output, graph.grad)

    @property
    def pending(self) -> int:
        """Graphs not back-propagated yet (0 once the update has used every kept step)."""
        return len(self._graphs)

    def release(self) -> None:
        """Drop every kept graph (an update that does not run frees their activations)."""
        self._graphs.clear()
        self._where.clear()
        self._lookup = None
