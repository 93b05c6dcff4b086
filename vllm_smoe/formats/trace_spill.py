"""A writer's spill directory (``.trace-*``): its lock, the ``.npz`` assembled from it, and the
recovery of one whose writer died before ``close``."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from typing import Mapping

import numpy as np

from .bounded import short
from .trace_meta import FIELD2SPEC, REQUIRED_FIELDS, TraceMeta


SPILL_PREFIX = ".trace-"
SPILL_INDEX = "spill.json"
SPILL_LOCK = "lock"  # flock-ed by the writer for its whole life: the kernel drops it when the writer dies


def try_lock(spill_dir: str):
    """The spill's lock file, flock-ed exclusively without waiting, or None when its writer (or
    another recoverer) still holds it, or it has no lock file."""
    import fcntl

    try:
        fd = open(os.path.join(spill_dir, SPILL_LOCK), "a")
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fd.close()
        return None
    return fd


def assemble(path: str, meta: TraceMeta, spill_dir: str, dtypes: Mapping[str, np.dtype],
              tails: Mapping[str, tuple[int, ...]], num_tokens: int, compresslevel: int = 1) -> None:
    """The ``.npz`` at ``path`` from the first ``num_tokens`` rows of each raw spill file,
    written to a temporary name and renamed (readers never see a half-written trace)."""
    from .bounded import refuse_special

    refuse_special(path, "output")  # never a regular file renamed over a device node or FIFO
    tmp = path + ".tmp"
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=compresslevel) as zf:
            for name, dtype in dtypes.items():
                shape = (num_tokens, *tails[name])
                with zf.open(name + ".npy", "w", force_zip64=True) as out:
                    np.lib.format.write_array_header_2_0(
                        out, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
                    )
                    left = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                    with open(os.path.join(spill_dir, name), "rb") as src:
                        while left > 0:
                            block = src.read(min(left, 1 << 22))
                            if not block:
                                raise ValueError(f"{spill_dir}: spill file {name!r} ends early")
                            out.write(block)
                            left -= len(block)
            with zf.open("meta.npy", "w") as out:
                np.lib.format.write_array(out, np.array(meta.to_json()), allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def spill_owner_alive(spill_dir: str) -> bool:
    """Is someone (its writer, or a recoverer) still holding ``spill_dir``? Asked of the lock
    the writer holds while it lives, which the kernel drops when it dies, whatever its pid
    namespace. A directory without a lock file counts as held: only ``--force`` touches it."""
    fd = try_lock(spill_dir)
    if fd is None:
        return os.path.isdir(spill_dir)
    fd.close()
    return False


def _free_name(path: str) -> str:
    if not os.path.exists(path):
        return path
    stem = path[: -len(".npz")] if path.endswith(".npz") else path
    n = 1
    while os.path.exists(f"{stem}-recovered{'' if n == 1 else f'-{n}'}.npz"):
        n += 1
    return f"{stem}-recovered{'' if n == 1 else f'-{n}'}.npz"


def recover_spill(spill_dir: str, force: bool = False) -> tuple[str | None, int]:
    """Turn the spill directory of a writer that died before ``close`` into its trace.

    Takes the spill's lock first (refused while the writer or another recoverer holds it, unless
    ``force``). Keeps the rows every field holds completely (a kill in the middle of a step
    loses that step only), writes the ``.npz`` the writer would have written (or a free
    ``<name>-recovered[-n].npz`` beside it) and removes the directory. Returns (path or None when
    no row was complete, tokens). Raises ValueError naming the directory when it is held, or its
    index is damaged (the directory is then left alone)."""
    lock = try_lock(spill_dir)
    if lock is None and not force:
        raise ValueError(f"{spill_dir}: still held by its writer or another recoverer (or has no lock file); "
                         f"--force to recover it anyway")
    try:
        where = os.path.join(spill_dir, SPILL_INDEX)
        if not os.path.exists(where):
            if not any(n not in (SPILL_LOCK, SPILL_INDEX + ".tmp") for n in os.listdir(spill_dir)):
                shutil.rmtree(spill_dir, ignore_errors=True)  # died before its first rows: nothing to keep
                return None, 0
            raise ValueError(f"{spill_dir}: no {SPILL_INDEX}: unrecoverable (not a smoe spill directory?)")
        try:
            with open(where) as f:
                index = json.load(f)
            meta = TraceMeta.from_json(index["meta"], where)
            fields = {n: (np.dtype(np.lib.format.descr_to_dtype(v["dtype"])), tuple(int(x) for x in v["tail"]))
                      for n, v in index["fields"].items()}
            # the output beside the spill: the record directory may have moved since
            path = os.path.join(os.path.dirname(os.path.abspath(spill_dir)), os.path.basename(os.fspath(index["path"])))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: damaged spill index ({e}): unrecoverable") from None
        missing = [n for n in REQUIRED_FIELDS if n not in fields]
        if missing:
            raise ValueError(f"{where}: field(s) {missing} missing: unrecoverable")
        foreign = sorted(n for n in fields if n not in FIELD2SPEC)  # a name is a file in the spill: no paths
        if foreign:
            raise ValueError(f"{where}: field(s) {[short(n) for n in foreign[:3]]} are not fields of the trace format "
                             f"({', '.join(FIELD2SPEC)}): unrecoverable")
        rows = []
        for name, (dtype, tail) in fields.items():
            row_bytes = dtype.itemsize * int(np.prod(tail, dtype=np.int64))
            try:
                rows.append(os.path.getsize(os.path.join(spill_dir, name)) // row_bytes)
            except OSError:
                rows.append(0)
        n = min(rows)
        out = None
        if n > 0:
            out = _free_name(path)
            assemble(out, meta, spill_dir, {k: d for k, (d, _) in fields.items()},
                      {k: t for k, (_, t) in fields.items()}, n, int(index.get("compresslevel", 1)))
        shutil.rmtree(spill_dir, ignore_errors=True)
        return out, n
    finally:
        if lock is not None:
            lock.close()


def recover_dead_spills(directory: str, wait_s: float = 0.0) -> list[tuple[str, str | None, int, str | None]]:
    """Recover the spill directories in ``directory`` whose writer is gone, waiting up to
    ``wait_s`` for writers still running (e.g. a worker finishing its own close; one that
    closes meanwhile leaves nothing to do). Returns [(spill dir, trace path or None, tokens,
    error or None)]; spills still held are left out."""
    import time

    deadline = time.monotonic() + wait_s
    done = []
    for spill in find_spills(directory):
        while os.path.isdir(spill) and spill_owner_alive(spill) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not os.path.isdir(spill) or spill_owner_alive(spill):
            continue
        try:
            out, n = recover_spill(spill)
            done.append((spill, out, n, None))
        except (ValueError, OSError) as e:  # held again meanwhile, damaged, or a full disk: named, not fatal
            done.append((spill, None, 0, str(e)))
    return done


def find_spills(directory: str) -> list[str]:
    """Spill directories (``.trace-*``) directly inside ``directory``, sorted."""
    try:
        names = os.listdir(directory)
    except OSError as e:
        raise ValueError(f"{directory}: cannot list ({e.strerror})") from None
    return sorted(os.path.join(directory, n) for n in names
                  if n.startswith(SPILL_PREFIX) and os.path.isdir(os.path.join(directory, n)))
