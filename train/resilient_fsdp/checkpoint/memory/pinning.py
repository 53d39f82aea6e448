"""Page-locked memory slots on CUDA.

A slot is a file of ``/dev/shm`` mapped into the rank. A device-to-host copy into pageable memory
goes through the driver's pinned bounce buffer: the host thread that queues it waits for all of it,
at a fraction of the pinned rate, so the training thread's wait for a memory save's copy is the
whole copy. Registered with CUDA (``cudaHostRegister``, through torch's own helper that DCP's
stager uses), the mapping takes the side stream's copy at the pinned rate while the training
stream goes on. Registration page-locks every page, once per mapping: slots stay mapped across
saves, so a job pays it at its first save (and again only when the layout changes). A mapping is
unregistered before it goes; one that cannot be registered stays pageable and says why.
"""

from __future__ import annotations

from typing import Optional

import torch


def pin(buffer: torch.Tensor) -> Optional[str]:
    """Register ``buffer``'s bytes (a mapped slot) with CUDA; None when done, else why not."""
    nbytes = buffer.numel() * buffer.element_size()
    if nbytes == 0:
        return None
    try:
        from torch.cuda import _pin_memory_utils

        _pin_memory_utils.pin_memory(buffer.data_ptr(), nbytes)
    except (ImportError, AttributeError, RuntimeError) as exc:
        return f"its {nbytes} bytes stay pageable: cudaHostRegister failed ({exc})"
    return None


def unpin(buffer: torch.Tensor) -> Optional[str]:
    """Unregister what :func:`pin` registered, before the mapping goes; None when done, else why not."""
    try:
        from torch.cuda import _pin_memory_utils

        _pin_memory_utils.unpin_memory(buffer.data_ptr())
    except (ImportError, AttributeError, RuntimeError, AssertionError) as exc:
        return f"cudaHostUnregister failed ({exc})"
    return None
