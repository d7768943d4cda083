"""Which attention kernels a runtime's cached forwards may run: every kernel but cuDNN's, by default.

torch puts cuDNN's attention first on Hopper and datacenter Blackwell (sm 90/100) once its bundled cuDNN is newer
than 9.15 and CUDA at least 12.9 (pytorch pull requests 162073 and 171627; torch 2.11's CUDA 13 wheels qualify).
cuDNN builds an execution graph for each set of shapes and caches it, and a forward's shapes carry its query and
key lengths. Decoding meets a new context length every round, so it built a graph nearly every round: in sessions
35 and 36's GPU runs (one H200, torch 2.11.0+cu130) a round whose target forward was the first to meet its
(tokens, context length) shape was over 30 ms slower than target-only's median round 75-100% of the time, one token
scored or several, and 45-57 ms slower on average for one token; a round at a shape met before never was when it
scored one token, 0-19% of the time when it scored several (its draft's forward may have met a new shape)
(`benchmarks/round_kinds.py`, its last table; docs/cuda.md). The systems of a benchmark decode the same prompts in
turns, so the one ahead paid for the others: that priced drafting rounds at ~5 plain rounds. The cost per new shape
is measured; that it is cuDNN's graph building is inferred (torch's order on that GPU, cuDNN's per-shape graphs),
not yet measured: `benchmarks/cuda_check.sh stalls` runs the engine's kernels against torch's pick. Upstream reads
the same: torch's opt-in `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1` (pytorch pull request 155958) exists to avoid
"recompiling for different sequence lengths", but only without a mask and with query, keys and values laid out
sequence-major, which the runtimes' head-major caches are not; MLX's cuDNN attention (ml-explore/mlx pull request
2743) recreated its graph whenever the sequence length grew, and left decoding to another kernel.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch


_lock = threading.Lock()
_holders = 0  # forwards inside that rely on cuDNN's attention being off; the last one out turns it back on


@contextlib.contextmanager
def without_cudnn_attention(allow_cudnn: bool) -> Iterator[None]:
    """Run the body with cuDNN's attention kernels off, unless `allow_cudnn`, a caller turned them off already, or no
    kernel that takes a mask (memory-efficient, math) is left on by a caller's `torch.nn.attention.sdpa_kernel`,
    whose choice that is to keep.

    Only that flag changes: kernels a caller has restricted stay restricted. The flag is process-wide, like
    `sdpa_kernel`'s, so this function's callers share one hold on it: the first in turns cuDNN off, the last out
    turns it back on, and none of their forwards runs with cuDNN while another one ends, in any thread. It cannot
    coordinate with other code that sets the flag meanwhile: an `sdpa_kernel` context in another thread that
    overlaps a hold can turn cuDNN back on under it, or leave it off after it, as such contexts can with each other.
    """
    global _holders
    flags = torch.backends.cuda
    held = False
    try:
        with _lock:
            masked_alternative = flags.mem_efficient_sdp_enabled() or flags.math_sdp_enabled()  # flash takes no mask
            if not allow_cudnn and masked_alternative and (_holders > 0 or flags.cudnn_sdp_enabled()):
                flags.enable_cudnn_sdp(False)  # also when held already: a caller's sdpa_kernel may have turned it on
                _holders, held = _holders + 1, True
        yield
    finally:
        if held:
            with _lock:
                _holders -= 1
                if _holders == 0:
                    flags.enable_cudnn_sdp(True)
