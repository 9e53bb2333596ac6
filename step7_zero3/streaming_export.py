"""Write the full weights as one safetensors file while holding one unit's parameters at a time.

``metrics.save_final_weights`` needs every tensor in memory at once: the whole model, which is what
ZeRO-3 never holds. But a safetensors file is simple enough to write in pieces:

    8 bytes     the header's length, little-endian
    header      JSON: per tensor its dtype, shape and [begin, end) byte offsets into the data;
                tensors sorted by name (as safetensors sorts them); padded with spaces to a multiple
                of 8 bytes
    data        the tensors' raw bytes, one after another, at those offsets

The header needs only names, shapes and dtypes, all known before anything is gathered, so it is
written first; then each tensor's bytes go to their offset as its unit is gathered, in whatever
order the units come. The file is byte for byte the one ``save_file`` writes for the same tensors (a
test compares it with step 1's).
"""

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import torch

from metrics import fingerprint

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def header_and_offsets(shapes: dict, dtype: torch.dtype = torch.float32) -> tuple[bytes, dict]:
    """The 8-byte length and the JSON header, and each tensor's byte offset in the file."""
    header, begin = {}, 0
    for name in sorted(shapes):
        end = begin + math.prod(shapes[name]) * dtype.itemsize
        header[name] = {
            "dtype": DTYPES[dtype],
            "shape": list(shapes[name]),
            "data_offsets": [begin, end],
        }
        begin = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {
        name: start + h["data_offsets"][0] for name, h in header.items()
    }


def save_final_weights_streaming(
    out_dir: Path, shapes: dict, named_tensors, is_writer: bool
) -> dict | None:
    """``save_final_weights`` for tensors that arrive one by one (``named_tensors``: an iterator of
    ``(name, tensor)``, every name of ``shapes`` once). Every rank must consume the iterator (its
    gathers are collectives); only the writer writes, and gets the ``final`` section back (its exact
    ``param_norm`` from each tensor's parts as it passes, exact_sums.py)."""
    from exact_sums import norm_from_parts, square_sum_parts

    path = Path(out_dir) / "model.safetensors"
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fingerprints, f, parts = {}, None, square_sum_parts([])  # zeros: no tensor yet
    if is_writer:
        header, offsets = header_and_offsets(shapes)
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(tmp, "wb")
        f.write(header)
    try:
        for name, tensor in named_tensors:
            if is_writer:
                t = tensor.detach().cpu().contiguous()
                f.seek(offsets[name])
                f.write(t.view(torch.uint8).numpy().tobytes())
                fingerprints[name] = fingerprint(t)
                parts += square_sum_parts([t])
    finally:
        if f is not None:
            f.close()
    if not is_writer:
        return None
    if sorted(fingerprints) != sorted(shapes):
        raise RuntimeError(
            f"streaming export: tensors missing: {sorted(set(shapes) - set(fingerprints))}"
        )
    os.replace(tmp, path)
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha256.update(block)
    return {
        "weights": path.name,
        "sha256": sha256.hexdigest(),
        "fingerprints": {name: fingerprints[name] for name in shapes},
        "param_norm": norm_from_parts(parts),
    }
