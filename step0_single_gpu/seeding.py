"""Determinism: one seed fixes everything, and every random state can be saved and restored.

Bitwise reproducibility needs more than ``torch.manual_seed``: Python's and NumPy's generators,
deterministic kernels, and one CPU thread per process (a multi-threaded reduction may add in a
different order from run to run). Resume needs the *current* state of every generator, not the
seed: after k steps the generators have moved on.
"""

import random

import numpy as np
import torch


def seed_everything(seed: int, deterministic: bool = True) -> None:
    """Seed Python, NumPy and torch (CPU and every GPU); one CPU thread; deterministic kernels
    unless ``deterministic`` is False (--nondeterministic: torch's default kernels)."""
    # No CUBLAS_WORKSPACE_CONFIG: torch gives each stream its own cuBLAS workspace, which is what
    # cuBLAS needs to be deterministic, and torch 2.11 on asks for nothing more; the old advice
    # (:4096:8) costs a GPU a third of its speed (docs/gpu.md).
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(deterministic)
    # Deterministic mode also fills every new uninitialised tensor with NaN, a kernel per
    # allocation: a guard for code that reads memory before writing it, which none here does (two
    # runs are compared bitwise).
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.benchmark = False
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict:
    """Every generator's current state, as tensors and plain values
    (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, cached_gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached_gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Put every generator back where ``rng_state()`` found it."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached_gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
