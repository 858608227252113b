"""Default locations, the same as DanceGRPO's so existing data keeps working. Every one is a flag."""

DEFAULT_FLUX_DIR = "data/flux"
DEFAULT_HPS_DIR = "hps_ckpt"
DEFAULT_EMBEDDINGS_DIR = "data/rl_embeddings"
DEFAULT_OUTPUT_DIR = "data/outputs/grpo"
EMBEDDINGS_INDEX = "videos2caption.json"
DEFAULT_SAMPLES_DIR = "data/outputs/samples"
