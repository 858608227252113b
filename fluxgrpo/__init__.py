"""fluxgrpo: GRPO fine-tuning of FLUX.1-dev against HPSv2, on Ascend, GPUs and CPU."""

__version__ = "0.1.0"
