"""Tensor-parallel helpers over the default process group (one process per rank, NCCL on GPUs,
gloo on CPU; without a group this process is rank 0 of 1 and collectives are identities).

Weight loaders get checkpoint tensors or safetensors slices (a rank reads only its shard);
`weight_shape` / `narrow_weight` / `full_weight` hide the difference. On CUDA,
`init_fast_all_reduce` sends small all-reduces through symmetric memory over NVLink, falling
back to NCCL for anything else. NVLink multicast (NVLS) is never used: it can take a shared
host's GPUs out of service.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from models.sampling_hash import NO_INDEX

logger = logging.getLogger(__name__)

# A torch.Tensor or a safetensors PySafeSlice (lazy: indexing it reads from disk).
WeightSource = Any


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tp_rank() -> int:
    return dist.get_rank() if _initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor-parallel "
                         f"size ({denominator})")
    return numerator // denominator


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; returns it. Through the symmetric-memory fast path
    when `init_fast_all_reduce` set one up (it sends what it does not cover to NCCL)."""
    if get_tp_size() > 1:
        if _FAST.impl is not None:
            return _FAST.impl.all_reduce(x)
        dist.all_reduce(x)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim (rank order); every rank gets it.
    Through the symmetric-memory fast path where it covers the gathered size, else NCCL."""
    size = get_tp_size()
    if size == 1:
        return x
    if _FAST.impl is not None:
        gathered = _FAST.impl.all_gather_last_dim(x)
        if gathered is not None:
            return gathered
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def _argmax_pairs(values: torch.Tensor, indices: torch.Tensor, dim: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce (value, index) pairs along `dim` with the race's tie rule (kernels/sample.py
    best_candidate); exact, so the order of the pairs never matters."""
    ok = (values > float("-inf")) & (indices != NO_INDEX)  # NaN > -inf is False
    values = torch.where(ok, values, float("-inf"))
    top = values.amax(dim, keepdim=True)
    index = torch.where(ok & (values == top), indices, NO_INDEX).amin(dim)
    return top.squeeze(dim), index


def tp_argmax(values: torch.Tensor, indices: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Collective: int64 [B], the same on every rank, the index of each row's best candidate
    over every rank's values float32 [B, S] / indices int32 [B, S]; 0 for a row with nothing
    above -inf (torch.argmax's answer). Written into `out` when given."""
    assert values.dim() == 2 and values.shape == indices.shape, (
        f"values {tuple(values.shape)} and indices {tuple(indices.shape)} must be [B, S]")
    num_rows, num_candidates = values.shape
    assert num_candidates > 0, "every rank needs at least one candidate per row"
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=values.device)
    if num_rows == 0:
        return out
    size = get_tp_size()
    value, index = _argmax_pairs(values, indices, dim=1)  # [B] each: this rank's best
    if size > 1:
        all_values = [torch.empty_like(value) for _ in range(size)]
        all_indices = [torch.empty_like(index) for _ in range(size)]
        dist.all_gather(all_values, value)
        dist.all_gather(all_indices, index)
        value, index = _argmax_pairs(torch.stack(all_values), torch.stack(all_indices), dim=0)
    return out.copy_(index.masked_fill(index == NO_INDEX, 0))


def weight_shape(loaded: WeightSource) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow_weight(loaded: WeightSource, dim: int, start: int, length: int) -> torch.Tensor:
    """`loaded[..., start:start+length, ...]` along `dim`, read lazily from a slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = [slice(None)] * len(weight_shape(loaded))
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def full_weight(loaded: WeightSource) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def check_shape(param: torch.Tensor, expected: tuple[int, ...], loaded: WeightSource,
                what: str) -> None:
    """Raise a readable error when a checkpoint tensor does not fit its parameter."""
    got = weight_shape(loaded)
    if got != tuple(expected):
        raise ValueError(f"checkpoint tensor for {what} has shape {list(got)}, expected "
                         f"{list(expected)} (parameter shard {list(param.shape)})")


# Set before any NCCL communicator or symmetric memory exists (NVLS: see the top).
NO_MULTICAST_ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0"}

# [512, 8192] bf16: the largest decode batch of the widest model we serve.
DEFAULT_FAST_ALL_REDUCE_BYTES = 512 * 8192 * 2
# The dtypes torch's symm_mem reduce kernels are built for; float16 goes to NCCL.
FAST_DTYPES = (torch.bfloat16, torch.float32)
# The kernels move 16 bytes per thread; a message of another size goes to NCCL.
FAST_ALIGN_BYTES = 16
# One-shot (each rank reads every peer's message) wins at any size with two ranks; with more,
# two-shot (each reduces 1/W and scatters it) wins above these sizes, as in vLLM.
ONE_SHOT_MAX_BYTES_UP_TO_4_RANKS = 512 * 1024
ONE_SHOT_MAX_BYTES_MORE_RANKS = 256 * 1024

NCCL, ONE_SHOT, TWO_SHOT = "nccl", "one_shot", "two_shot"

_SYMM_MEM_OPS = ("one_shot_all_reduce", "one_shot_all_reduce_copy_out", "two_shot_all_reduce_")


def disable_nvlink_multicast() -> None:
    """Default NVLink multicast off for NCCL and symmetric memory. An explicit setting wins;
    the fast path then refuses to start if symmetric memory would still use multicast."""
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)


def default_one_shot_max_bytes(world_size: int, max_bytes: int) -> int:
    if world_size <= 2:
        return max_bytes
    if world_size <= 4:
        return min(max_bytes, ONE_SHOT_MAX_BYTES_UP_TO_4_RANKS)
    return min(max_bytes, ONE_SHOT_MAX_BYTES_MORE_RANKS)


def choose_algorithm(dtype: torch.dtype, nbytes: int, max_bytes: int,
                     one_shot_max_bytes: int) -> str:
    """NCCL, ONE_SHOT or TWO_SHOT for a message of `nbytes`. It depends only on what is the
    same on every rank (dtype, size, settings): all ranks must join the same collective."""
    if dtype not in FAST_DTYPES or nbytes > max_bytes or nbytes % FAST_ALIGN_BYTES:
        return NCCL
    return ONE_SHOT if nbytes <= one_shot_max_bytes else TWO_SHOT


def _fits_fused_copy(x: torch.Tensor) -> bool:
    """The one-kernel one-shot reads x and writes the sum back with 16-byte vectors, and
    wants x's offset in its storage aligned like the symmetric buffer's (0)."""
    return (x.is_contiguous() and x.data_ptr() % FAST_ALIGN_BYTES == 0
            and x.storage_offset() * x.element_size() % FAST_ALIGN_BYTES == 0)


def _usable_symm_mem_device(device: torch.device) -> torch.device:
    """`device` with its index; raises unless symmetric memory works here without NVLink
    multicast."""
    from torch._C._autograd import DeviceType
    from torch._C._distributed_c10d import _SymmetricMemory
    from torch.distributed import _symmetric_memory as symm_mem

    for name in _SYMM_MEM_OPS:
        getattr(torch.ops.symm_mem, name)  # raises where this torch lacks the op
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    # The CUDA (IPC) backend is the one that honours TORCH_SYMM_MEM_DISABLE_MULTICAST; the
    # NVSHMEM and NCCL backends have multicast switches of their own.
    backend = symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else "CUDA"
    if backend != "CUDA" and hasattr(symm_mem, "set_backend"):
        symm_mem.set_backend("CUDA")
        backend = symm_mem.get_backend(device)
    if backend != "CUDA":
        raise RuntimeError(f"the symmetric-memory backend is {backend}, not CUDA")
    if _SymmetricMemory.has_multicast_support(DeviceType.CUDA, device.index):
        raise RuntimeError("symmetric memory would use NVLink multicast "
                           "(TORCH_SYMM_MEM_DISABLE_MULTICAST="
                           f"{os.environ.get('TORCH_SYMM_MEM_DISABLE_MULTICAST')!r})")
    return device


class SymmMemAllReduce:
    """Sum over the default group through one symmetric-memory buffer per rank that every peer
    maps. Graph-capturable once run eagerly (`rendezvous` does); every rank must then replay
    the same graphs. Construction is local, `rendezvous` collective; set it up through
    `init_fast_all_reduce`, which falls back to NCCL on any failure."""

    def __init__(self, device: torch.device, max_bytes: int = DEFAULT_FAST_ALL_REDUCE_BYTES,
                 one_shot_max_bytes: int | None = None) -> None:
        if max_bytes <= 0 or max_bytes % FAST_ALIGN_BYTES:
            raise ValueError(f"max_bytes ({max_bytes}) must be a positive multiple of "
                             f"{FAST_ALIGN_BYTES}")
        from torch._C._distributed_c10d import _SymmetricMemory

        self.device = _usable_symm_mem_device(device)
        self.max_bytes = max_bytes
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.group_name = dist.group.WORLD.group_name
        self.one_shot_max_bytes = (default_one_shot_max_bytes(self.world_size, max_bytes)
                                   if one_shot_max_bytes is None else one_shot_max_bytes)
        ops = torch.ops.symm_mem
        self._one_shot_copy_out = ops.one_shot_all_reduce_copy_out
        self._one_shot = ops.one_shot_all_reduce
        self._two_shot = ops.two_shot_all_reduce_
        # Not from symm_mem.empty()'s pool: close() must really free it, or a later engine's
        # group (named "0" again) would get it back with this rendezvous still cached.
        self._buffer: torch.Tensor | None = _SymmetricMemory.empty_strided_p2p(
            (max_bytes,), (1,), torch.uint8, self.device)
        self._handle: Any = None  # keeps the peers' mappings alive
        # One view per dtype of the same storage: [max_bytes // itemsize] each.
        self._views = {dtype: self._buffer.view(dtype) for dtype in FAST_DTYPES}

    def rendezvous(self) -> None:
        """Collective: map every peer's buffer, then run each algorithm once on known
        values (the eager run graph capture needs); raises if a sum is wrong."""
        from torch.distributed import _symmetric_memory as symm_mem

        self._handle = symm_mem.rendezvous(self._buffer, self.group_name)
        expected = self.world_size * (self.world_size + 1) // 2
        for dtype in FAST_DTYPES:
            numel = min(4096, self.max_bytes // dtype.itemsize)
            for algorithm in (ONE_SHOT, TWO_SHOT):
                x = torch.full((numel,), self.rank + 1, dtype=dtype, device=self.device)
                self._reduce(x, algorithm)
                wrong = int((x != expected).sum().item())
                if wrong:
                    raise RuntimeError(f"symmetric-memory {algorithm} all-reduce ({dtype}) "
                                       f"self-check: {wrong} of {numel} sums wrong")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        algorithm = (choose_algorithm(x.dtype, x.numel() * x.element_size(), self.max_bytes,
                                      self.one_shot_max_bytes) if x.is_cuda else NCCL)
        if algorithm == NCCL:
            dist.all_reduce(x)
        elif x.numel() > 0:
            self._reduce(x, algorithm)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` side by side along the last dim, or None where NCCL should do it:
        an all-reduce of zero-padded copies, which is exact (x + 0 is x)."""
        width = x.shape[-1]
        nbytes = x.numel() * x.element_size() * self.world_size
        if not x.is_cuda or choose_algorithm(x.dtype, nbytes, self.max_bytes,
                                             self.one_shot_max_bytes) == NCCL:
            return None
        full = x.new_zeros(*x.shape[:-1], width * self.world_size)
        full.narrow(-1, self.rank * width, width).copy_(x)
        return self.all_reduce(full)

    def _reduce(self, x: torch.Tensor, algorithm: str) -> None:
        staged = self._views[x.dtype][:x.numel()].view(x.shape)  # this rank's buffer
        if algorithm == ONE_SHOT and _fits_fused_copy(x):
            # One kernel: copies x into the buffer, sums every rank's buffer into x.
            self._one_shot_copy_out(staged, x, "sum", self.group_name, x)
            return
        # Kernels are launched with the same grid on every rank (it depends on the buffer
        # and the size only), so a rank may stage here while its peers fused the copy.
        staged.copy_(x)
        if algorithm == ONE_SHOT:
            x.copy_(self._one_shot(staged, "sum", self.group_name))
        else:
            self._two_shot(staged, "sum", self.group_name)  # the sum lands in every buffer
            x.copy_(staged)

    def close(self) -> None:
        """Free the buffer. Not collective, so it works with a peer gone; a rank is idle
        when its engine shuts down, so no kernel of this rank still uses the buffer."""
        self._views = {}
        self._handle = None
        self._buffer = None


@dataclass
class _FastAllReduceState:
    """This process's fast all-reduce: process-wide, like the default group it serves."""

    impl: SymmMemAllReduce | None = None
    # torch numbers rendezvous store keys per process: ranks that ran different numbers of
    # rendezvous (a rank 0 that hosted an earlier engine) would wait on each other's keys.
    rendezvous_count: int = 0
    rendezvous_broke_off: bool = False  # the numbering is unknown from then on


_FAST = _FastAllReduceState()


def _all_ranks_agree(ok: bool, count: int = 0) -> bool:
    """True on every rank when every rank says `ok` and all `count`s are equal."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flags = torch.tensor([int(ok), count, -count], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    low_ok, low_count, minus_high_count = flags.tolist()
    return low_ok == 1 and low_count == -minus_high_count


def _fall_back(fast: SymmMemAllReduce | None, error: BaseException | None) -> bool:
    if fast is not None:
        fast.close()
    if error is not None:
        reason = f"{type(error).__name__}: {error}"
    elif _FAST.rendezvous_broke_off:
        reason = "an earlier symmetric-memory rendezvous in this process broke off"
    else:
        reason = ("another rank could not set it up, or the ranks ran different numbers of "
                  "symmetric-memory rendezvous (this process hosted an earlier engine)")
    logger.warning("fast all-reduce off, all-reduces go through NCCL: %s", reason)
    return False


def init_fast_all_reduce(device: torch.device,
                         max_bytes: int = DEFAULT_FAST_ALL_REDUCE_BYTES,
                         one_shot_max_bytes: int | None = None) -> bool:
    """Collective, before any graph capture: route `tp_all_reduce` through symmetric memory
    for messages up to `max_bytes`. Returns whether it is on; if anything fails on any rank,
    every rank logs one warning and stays on NCCL."""
    close_fast_all_reduce()
    if device.type != "cuda" or get_tp_size() == 1:
        return False
    disable_nvlink_multicast()
    fast, error = None, None
    try:
        fast = SymmMemAllReduce(device, max_bytes, one_shot_max_bytes)
    except Exception as e:  # any failure means NCCL, never a dead engine
        error = e
    # Before the first collective step: the ranks must all go ahead, or none.
    if not _all_ranks_agree(fast is not None and not _FAST.rendezvous_broke_off,
                            _FAST.rendezvous_count):
        return _fall_back(fast, error)
    assert fast is not None
    try:
        _FAST.rendezvous_count += 1
        _FAST.rendezvous_broke_off = True
        fast.rendezvous()
        _FAST.rendezvous_broke_off = False
    except Exception as e:
        error = e
    if not _all_ranks_agree(error is None):
        return _fall_back(fast, error)
    _FAST.impl = fast
    logger.info("fast all-reduce on: symmetric memory, messages up to %d bytes (one-shot "
                "up to %d)", fast.max_bytes, fast.one_shot_max_bytes)
    return True


def close_fast_all_reduce() -> None:
    """Back to NCCL and free the buffer; not collective. Call it before the process group
    is destroyed, so this process can host another tensor-parallel engine."""
    fast, _FAST.impl = _FAST.impl, None
    if fast is not None:
        fast.close()
