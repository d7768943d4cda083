"""Which attention kernels a runtime's masked cached forwards may run: every kernel but cuDNN's, by default.

torch puts cuDNN's attention first on Hopper and datacenter Blackwell (sm 90/100) once its bundled cuDNN is newer
than 9.15 and CUDA at least 12.9 (pytorch pull requests 162073 and 171627; torch 2.11's CUDA 13 wheels qualify).
cuDNN builds an execution graph for each set of shapes and caches it, and a masked forward's shapes carry its query
and key lengths. Speculative decoding scores several tokens at a new context length nearly every round, so it built
a graph nearly every round: in sessions 35 and 36's GPU runs (one H200, torch 2.11.0+cu130) rounds whose target
forward was the first to meet its (tokens, context length) shape were over 30 ms slower than target-only's median
round 75-100% of the time, rounds at a shape met before 0-19%, target-only's plain rounds 8-14%
(`benchmarks/round_kinds.py`, its last table; docs/cuda.md). A one-draft round at a new shape took 71-106 ms more
than at a met one (its draft forward meets a new shape too). One-token decode forwards of our runtime pass no mask
and did not stall, so they keep torch's choice. The cost per new shape is measured; that it is cuDNN's graph
building is inferred (torch's order on that GPU, cuDNN's per-shape graphs), not yet measured:
`benchmarks/cuda_check.sh stalls` runs the engine's kernels against torch's pick.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def masked_attention(allow_cudnn: bool) -> Iterator[None]:
    """Run the body with cuDNN's attention kernels off, unless `allow_cudnn`, they are off already, or no kernel that
    takes a mask (memory-efficient, math) is left on by a caller's `torch.nn.attention.sdpa_kernel`, whose choice
    that is to keep.

    Only that flag changes: kernels a caller has restricted stay restricted. The flag is process-wide, like
    `sdpa_kernel`'s; two threads in forwards at once can at worst let cuDNN run.
    """
    flags = torch.backends.cuda
    masked_alternative = flags.mem_efficient_sdp_enabled() or flags.math_sdp_enabled()  # flash takes no mask
    if allow_cudnn or not flags.cudnn_sdp_enabled() or not masked_alternative:
        yield
        return
    flags.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        flags.enable_cudnn_sdp(True)
