"""The one tensor smoe reads from a model checkpoint: the input embedding, straight from the
safetensors header and byte range (only the shard and the rows needed), dequantised when fp8.

No torch, no safetensors package: ``smoe-place build --model DIR`` runs on a machine with only
numpy.
"""

from __future__ import annotations

import json
import os

import numpy as np


_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
                       "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}


def _fp8_table(exp_bits: int, man_bits: int, finite_max_code: bool) -> np.ndarray:
    """[256] float32 value of every fp8 code (OCP E4M3FN: no infinities, NaN at all-ones; E5M2:
    IEEE-like)."""
    code = np.arange(256)
    sign = np.where(code >> 7, -1.0, 1.0)
    e = (code >> man_bits) & ((1 << exp_bits) - 1)
    m = code & ((1 << man_bits) - 1)
    bias = (1 << (exp_bits - 1)) - 1
    val = np.where(e == 0, m / (1 << man_bits) * 2.0 ** (1 - bias), (1 + m / (1 << man_bits)) * 2.0 ** (e - bias))
    top = (1 << exp_bits) - 1
    if finite_max_code:
        val = np.where((e == top) & (m == (1 << man_bits) - 1), np.nan, val)
    else:
        val = np.where(e == top, np.where(m == 0, np.inf, np.nan), val)
    return (sign * val).astype(np.float32)


_FP8 = {"F8_E4M3": _fp8_table(4, 3, True), "F8_E5M2": _fp8_table(5, 2, False)}


def _read_rows(f, data_start: int, info: dict, rows: int | None = None) -> np.ndarray:
    """The first ``rows`` rows (all when None) of one safetensors tensor as float32."""
    dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
        raise ValueError(f"dtype {info['dtype']} (embeddings are read in {', '.join(_SAFETENSORS_DTYPES)})")
    shape = [int(x) for x in info["shape"]] or [1]
    if rows is not None:
        shape[0] = min(shape[0], rows)
    count = int(np.prod(shape, dtype=np.int64))
    f.seek(data_start + int(info["data_offsets"][0]))
    raw = np.frombuffer(f.read(count * np.dtype(dtype).itemsize), dtype=dtype)
    if raw.size != count:
        raise ValueError("truncated")
    if info["dtype"] == "BF16":  # the upper half of a float32
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    elif info["dtype"] in _FP8:
        raw = _FP8[info["dtype"]][raw]
    return raw.astype(np.float32).reshape(shape)


def _block(n: int, blocks: int, hint: int | None) -> int:
    """Block size along one axis: the checkpoint's (``weight_block_size``) when it fits, else
    128 (DeepSeek's) when it fits, else the smallest that gives ``blocks`` blocks."""
    for b in (hint, 128):
        if b and -(-n // b) == blocks:
            return b
    return -(-n // blocks)


def _dequantise(emb: np.ndarray, scale: np.ndarray, full_rows: int, inverse_blocks: bool,
                block: list[int] | None = None) -> np.ndarray:
    """fp8 embeddings times their scales: per tensor, per row, or per block (DeepSeek-style
    ``weight_scale_inv`` [ceil(R / b), ceil(H / b)])."""
    R, H = emb.shape
    if scale.size == 1 or (scale.ndim >= 1 and scale.shape[0] == full_rows and scale.size == full_rows):
        return emb * (scale.reshape(-1)[:R, None] if scale.size > 1 else scale.reshape(()))
    if inverse_blocks and scale.ndim == 2:
        br = _block(full_rows, scale.shape[0], block[0] if block else None)
        bh = _block(H, scale.shape[1], block[1] if block else None)
        return emb * np.repeat(np.repeat(scale, br, axis=0), bh, axis=1)[:R, :H]
    raise ValueError(f"scale of shape {scale.shape} does not fit an embedding of {full_rows} x {H}")


def _embedding_shard(model_dir: str) -> list[str]:
    """The safetensors files that may hold the input embedding: the one the sharded index names,
    else every ``*.safetensors`` (sorted)."""
    import glob

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: unreadable shard index ({e})") from None
        shards = sorted({v for k, v in weight_map.items() if k.endswith("embed_tokens.weight")})
        if shards:
            return [os.path.join(model_dir, s) for s in shards]
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def _safetensors_header(f) -> tuple[dict, int]:
    """(header, offset of the data) of an open safetensors file."""
    import struct

    (n,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(n)), 8 + n


def _tensor(path: str, key: str) -> np.ndarray | None:
    """One whole tensor of a safetensors file as float32, None when the file lacks it."""
    with open(path, "rb") as f:
        header, start = _safetensors_header(f)
        return _read_rows(f, start, header[key]) if key in header else None


def _fp8_scale(model_dir: str, path: str, key: str) -> tuple[np.ndarray, bool]:
    """(scale, is block-inverse) of an fp8 tensor: ``<key>_scale_inv`` or ``<key>_scale``, in its
    own shard or in the one the index names."""
    weight_map = {}
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
    for suffix, inverse in (("_scale_inv", True), ("_scale", False)):
        for shard in (path, os.path.join(model_dir, weight_map.get(key + suffix, os.path.basename(path)))):
            scale = _tensor(shard, key + suffix)
            if scale is not None:
                return scale, inverse
    raise ValueError(f"fp8 tensor without {key}_scale_inv or {key}_scale (it would be read unscaled)")


def _weight_block_size(model_dir: str) -> list[int] | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            block = (json.load(f).get("quantization_config") or {}).get("weight_block_size")
    except (OSError, ValueError, AttributeError):
        return None
    return block if isinstance(block, list) and len(block) == 2 else None


def read_embeddings(model_dir: str, vocab_size: int) -> np.ndarray:
    """[vocab_size, H] float32 rows of ``*embed_tokens.weight``, read straight from the
    safetensors header and byte range: only the shard and rows needed, in F64/F32/F16/BF16 or
    fp8 (E4M3/E5M2) times its ``weight_scale`` / ``weight_scale_inv`` beside it."""
    import struct

    for path in _embedding_shard(model_dir):
        key = "embed_tokens.weight"
        try:
            with open(path, "rb") as f:
                header, start = _safetensors_header(f)
                key = next((k for k in header if k.endswith("embed_tokens.weight")), None)
                if key is None:
                    continue
                info = header[key]
                if len(info["shape"]) != 2:
                    raise ValueError(f"shape {info['shape']}, expected [vocab, hidden]")
                emb = _read_rows(f, start, info, vocab_size)
                if info["dtype"] in _FP8:
                    scale, inverse = _fp8_scale(model_dir, path, key)
                    emb = _dequantise(emb, scale, int(info["shape"][0]), inverse, _weight_block_size(model_dir))
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise ValueError(f"{path}: cannot read tensor {key!r} ({e})") from None
        return emb
    raise ValueError(f"{model_dir}: no '*embed_tokens.weight' tensor in its safetensors files")
