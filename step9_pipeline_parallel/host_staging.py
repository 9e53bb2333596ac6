"""Host staging: a point-to-point message between CUDA tensors over gloo goes through host memory.

gloo's send and receive move CPU tensors only: given a CUDA tensor they fail in its transport
(``gloo/transport/tcp/pair.cc: writev: Bad address``), though gloo's all-reduce and broadcast take
CUDA tensors. So where ranks share one GPU (over gloo: nccl refuses two ranks on one device) the
sender copies the message to the CPU and sends that copy (the copy waits for the GPU; it is kept
until the send is waited), and the receiver receives into a CPU buffer and copies it to its device.
The bits do not change; on the CPU, and with nccl, nothing is staged.

Imported by pipeline.py (its rule 1, point-to-point), which asks ``host_staged`` at every send and
receive.
"""

import torch


def host_staged(backend: str, device) -> bool:
    """Whether a point-to-point message on ``device`` must go through host memory: over gloo, off
    the CPU."""
    return backend == "gloo" and torch.device(device).type != "cpu"
