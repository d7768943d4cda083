"""Which attention kernels a runtime's cached forwards may run: every kernel but cuDNN's, by default.

torch puts cuDNN's attention first on Hopper and datacenter Blackwell (sm 90/100) once its bundled cuDNN is newer
than 9.15 and CUDA at least 12.9 (pytorch pull requests 162073 and 171627). cuDNN builds an execution graph for each
set of shapes and caches it, and a forward's shapes carry its query and key lengths. Decoding meets a new context
length every round, so it would build a graph nearly every round: measured on one H200 (torch 2.11.0+cu130), a round
whose target forward was the first to meet its (tokens, context length) shape was over 30 ms slower than a plain
round's median most of the time. torch's opt-in `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1` (pytorch pull
request 155958) applies only without a mask and with sequence-major query, keys and values, which the runtimes'
head-major caches are not. So cached forwards run with cuDNN's attention off; the compiled decode step, whose shapes
never change, and uncached forwards keep torch's choice.
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
