"""safetensors files in plain Python (struct, json, numpy): Debian ships no `safetensors` package.
The tests read ddpworker's train.params_file with it and write torchvision's state_dicts for
model.init. The format: an 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the raw little-endian tensors."""
import json
import struct

import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def read_header(path):
    """(header dict without __metadata__, metadata, offset of the data section)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v for k, v in header.items() if k != "__metadata__"}, header.get("__metadata__", {}), 8 + n


def load(path):
    """{name: numpy array} in the file's data order (BF16 comes back as float32)."""
    header, _, start = read_header(path)
    data = open(path, "rb").read()
    out = {}
    for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = t["data_offsets"]
        raw = data[start + begin:start + end]
        if t["dtype"] == "BF16":
            arr = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, np.dtype(DTYPES[t["dtype"]]).newbyteorder("<"))
        out[name] = arr.reshape(t["shape"])
    return out


def load_torch(path):
    """A state_dict for torch's load_state_dict."""
    import torch
    return {k: torch.from_numpy(np.array(v)) for k, v in load(path).items()}


def parameters(path):
    """Every trainable tensor (not batch norm's running statistics), flattened and concatenated in
    the file's order: what two runs' parameters are compared by."""
    return np.concatenate([v.reshape(-1).astype(np.float32) for k, v in load(path).items()
                           if not k.endswith(RUNNING)])


def flat(path):
    """Every floating-point tensor, parameters and running statistics, flattened, in file order."""
    return np.concatenate([v.reshape(-1).astype(np.float32) for k, v in load(path).items()
                           if not k.endswith("num_batches_tracked")])


def save(path, tensors, metadata=None, dtype=None):
    """tensors: {name: numpy array or torch tensor}, written in the given order; dtype ("F16",
    "BF16", ...) converts floating-point ones."""
    header, blobs, at = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        arr = t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)
        kind = {np.dtype(v): k for k, v in DTYPES.items()}[arr.dtype]
        if dtype and arr.dtype.kind == "f":
            kind = dtype
            if dtype == "BF16":  # round to nearest even, as torch does
                u = arr.astype(np.float32).view(np.uint32)
                arr = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
            else:
                arr = arr.astype(DTYPES[dtype])
        raw = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": kind, "shape": list(arr.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
