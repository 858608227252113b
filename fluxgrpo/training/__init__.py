"""The run: the loop on every rank (``loop``), building its parts (``parts``), the stages that are not algorithm
(``stages``), per-iteration statistics and the progress line (``stats``), the held-out evaluation (``eval``), launch
planning and pre-flight checks (``launch_plan``) and the per-die memory estimate (``memory``). It calls down into
``fluxgrpo.grpo``, which imports nothing from here."""
