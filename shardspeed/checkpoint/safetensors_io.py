"""Streaming safetensors writer: tensors go to the file one by one, with no in-memory blob."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    tensors: dict[str, torch.Tensor],
    path: Path,
    metadata: dict[str, str] | None = None,
    *,
    fsync: bool = True,
) -> str:
    """Write a safetensors file tensor by tensor, without serialising it into memory first.

    ``safetensors.torch.save_file`` builds a byte copy of every tensor before writing, which
    doubles the peak memory of a shard and costs a copy; here each tensor's bytes go
    straight to the file. The result is a standard safetensors file (``safetensors`` reads
    it). With ``fsync`` the data is on disk when this returns.

    Returns the sha256 (hex) of every byte written, header included, hashed while streaming
    so the file is never read back.
    """
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _ST_DTYPES:
            raise ValueError(
                f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store; "
                f"allowed: {sorted(str(d) for d in _ST_DTYPES)}. Convert it or write .bin."
            )
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(blob).to_bytes(8, "little"), blob):
            f.write(chunk)
            digest.update(chunk)
        for tensor in tensors.values():
            if tensor.numel():
                flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                data = memoryview(flat.numpy())
                f.write(data)
                digest.update(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()
