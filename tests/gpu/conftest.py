"""tests/gpu runs only where CUDA is present; elsewhere its modules are not even imported
(they need triton and a GPU)."""

import importlib.util


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


collect_ignore_glob = [] if _cuda_available() else ["test_*.py"]
