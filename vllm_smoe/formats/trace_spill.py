"""A writer's spill directory (``.trace-*``): its lock, the ``.npz`` assembled from it, and the
recovery of one whose writer died before ``close``."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import stat
import zipfile
from typing import BinaryIO, Mapping

import numpy as np

from .bounded import kind_of, short
from .trace_meta import FIELD2SPEC, MAX_META_CHARS, REQUIRED_FIELDS, TraceMeta


SPILL_PREFIX = ".trace-"
SPILL_INDEX = "spill.json"
SPILL_LOCK = "lock"  # flock-ed by the writer for its whole life: the kernel drops it when the writer dies
# bytes of spill index recovery reads: the writer's holds the meta (at most MAX_META_CHARS, some
# escaped) and a line per field
MAX_INDEX_BYTES = 8 * MAX_META_CHARS


def try_lock(spill_dir: str):
    """The spill's lock file, flock-ed exclusively without waiting, or None when its writer (or
    another recoverer) still holds it, or it has no lock file (or something else than a regular
    file stands there: a FIFO would block the open)."""
    import fcntl

    try:
        fd = os.open(os.path.join(spill_dir, SPILL_LOCK),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError:
        return None
    f = os.fdopen(fd, "ab", buffering=0)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            f.close()
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def assemble(path: str, meta: TraceMeta, spill_dir: str, dtypes: Mapping[str, np.dtype],
             tails: Mapping[str, tuple[int, ...]], num_tokens: int, compresslevel: int = 1,
             sources: Mapping[str, BinaryIO] | None = None, mode_mask: int = 0o777) -> None:
    """The ``.npz`` at ``path`` from the first ``num_tokens`` rows of each raw spill file,
    written to a temporary name and renamed (readers never see a half-written trace).
    ``sources``: the spill files, opened already (else they are opened in ``spill_dir``);
    ``mode_mask``: permission bits the trace may have at most (those of the files it is made of)."""
    from .bounded import refuse_special

    refuse_special(path, "output")  # never a regular file renamed over a device node or FIFO
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o666)
        with os.fdopen(fd, "wb") as dest:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{tmp}: not a regular file; smoe writes the trace there before renaming it")
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & mode_mask)
            with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=compresslevel) as zf:
                for name, dtype in dtypes.items():
                    shape = (num_tokens, *tails[name])
                    with zf.open(name + ".npy", "w", force_zip64=True) as out:
                        np.lib.format.write_array_header_2_0(
                            out, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
                        )
                        left = math.prod(shape) * dtype.itemsize
                        src = sources[name] if sources is not None else open(os.path.join(spill_dir, name), "rb")
                        try:
                            while left > 0:
                                block = src.read(min(left, 1 << 22))
                                if not block:
                                    raise ValueError(f"{spill_dir}: spill file {name!r} ends early")
                                out.write(block)
                                left -= len(block)
                        finally:
                            if sources is None:
                                src.close()
                with zf.open("meta.npy", "w") as out:
                    np.lib.format.write_array(out, np.array(meta.to_json()), allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def spill_owner_alive(spill_dir: str) -> bool:
    """Is someone (its writer, or a recoverer) still holding ``spill_dir``? Asked of the lock
    the writer holds while it lives, which the kernel drops when it dies, whatever its pid
    namespace. A directory without a lock file counts as held: only ``--force`` touches it."""
    try:
        if not stat.S_ISDIR(os.lstat(spill_dir).st_mode):
            return False  # a symlink or a file: nobody's spill; recover_spill says why it refuses it
    except OSError:
        return False
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
    no row was complete, tokens). Raises ValueError naming the directory when it is held, or
    naming the file and field when the spill is not one a writer of this user left: a symlink,
    FIFO or another user's file in it, an index over MAX_INDEX_BYTES or damaged, a dtype or row
    shape the format does not have (the directory is then left alone). The trace's permission
    bits are at most those of the spill files it is made of."""
    try:
        dfd = os.open(spill_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:  # O_DIRECTORY | O_NOFOLLOW on a symlink answers ENOTDIR
        why = "a symbolic link" if os.path.islink(spill_dir) else _why(e)
        raise ValueError(f"{spill_dir}: not a spill directory ({why}): refused") from None
    opened: list[BinaryIO] = []
    lock = None
    try:
        _check_owner(spill_dir, os.fstat(dfd))
        lock = try_lock(spill_dir)
        if lock is None and not force:
            raise ValueError(f"{spill_dir}: still held by its writer or another recoverer (or has no lock file); "
                             f"--force to recover it anyway")
        names = os.listdir(dfd)
        if SPILL_INDEX not in names:
            if not any(n not in (SPILL_LOCK, SPILL_INDEX + ".tmp") for n in names):
                shutil.rmtree(spill_dir, ignore_errors=True)  # died before its first rows: nothing to keep
                return None, 0
            raise ValueError(f"{spill_dir}: no {SPILL_INDEX}: unrecoverable (not a smoe spill directory?)")
        where = os.path.join(spill_dir, SPILL_INDEX)
        f, st = _open_member(dfd, spill_dir, SPILL_INDEX)
        opened.append(f)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_size > MAX_INDEX_BYTES:  # before a byte is read: a sparse file costs no disk
            raise ValueError(f"{where}: {st.st_size} bytes, over the {MAX_INDEX_BYTES} smoe reads: not a spill index")
        meta, path, fields, compresslevel = _read_index(where, f.read(MAX_INDEX_BYTES + 1))
        path = os.path.join(os.path.dirname(os.path.abspath(spill_dir)), path)
        sources, rows = {}, []
        for name, (dtype, tail) in fields.items():
            try:
                src, st = _open_member(dfd, spill_dir, name)
            except FileNotFoundError:
                rows.append(0)  # its writer died before this field's first row
                continue
            opened.append(src)
            sources[name] = src
            mode &= stat.S_IMODE(st.st_mode)
            rows.append(st.st_size // (dtype.itemsize * math.prod(tail)))
        n = min(rows)
        out = None
        if n > 0:
            out = _free_name(path)
            assemble(out, meta, spill_dir, {k: d for k, (d, _) in fields.items()},
                     {k: t for k, (_, t) in fields.items()}, n, compresslevel, sources, mode)
        shutil.rmtree(spill_dir, ignore_errors=True)
        return out, n
    finally:
        for f in opened:
            f.close()
        if lock is not None:
            lock.close()
        os.close(dfd)


def _why(e: OSError) -> str:
    return ("a symbolic link" if e.errno == errno.ELOOP else "not a directory" if e.errno == errno.ENOTDIR
            else e.strerror or str(e))


def _check_owner(where: str, st: os.stat_result) -> None:
    if st.st_uid != os.geteuid():
        raise ValueError(f"{where}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): a writer of "
                         f"another user left it; recover it as that user")


def _open_member(dfd: int, spill_dir: str, name: str) -> tuple[BinaryIO, os.stat_result]:
    """The file ``name`` directly in the spill (opened through its directory's descriptor, so a
    directory swapped in meanwhile is not read), when it is a regular file of this user.
    Raises FileNotFoundError when there is none, ValueError naming it for anything else."""
    where = os.path.join(spill_dir, name)
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ValueError(f"{where}: cannot read ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{where}: a symbolic link; a spill holds regular files only: refused")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{where}: {kind_of(st.st_mode)}; a spill holds regular files only: refused")
    _check_owner(where, st)
    if st.st_nlink != 1:  # the writer's files have one name; another is a file it never wrote
        raise ValueError(f"{where}: has {st.st_nlink} hard links; a spill's files have one: refused")
    try:  # a swap since the check is refused too: no symlink followed, no FIFO waited on
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        raise ValueError(f"{where}: cannot read ({_why(e)})") from None
    f = os.fdopen(fd, "rb")
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        f.close()
        raise ValueError(f"{where}: replaced while it was opened: refused")
    return f, now


def _read_index(where: str, data: bytes) -> tuple[TraceMeta, str, dict[str, tuple[np.dtype, tuple[int, ...]]], int]:
    """(meta, output file name, {field: (dtype, row shape)}, compression level) from the bytes of
    a spill index; each checked against the format before the spill's files are touched."""
    if len(data) > MAX_INDEX_BYTES:  # grew since the size was checked
        raise ValueError(f"{where}: over the {MAX_INDEX_BYTES} bytes smoe reads: not a spill index")
    try:
        index = json.loads(data)
    except RecursionError:
        raise ValueError(f"{where}: damaged spill index (nested too deeply): unrecoverable") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are no text
        raise ValueError(f"{where}: damaged spill index ({e}): unrecoverable") from None
    if not isinstance(index, dict) or not isinstance(index.get("fields"), dict):
        raise ValueError(f"{where}: damaged spill index (no 'fields' object): unrecoverable")
    try:
        meta = TraceMeta.from_json(index.get("meta"), where)
    except ValueError as e:
        raise ValueError(f"damaged spill index: {e}: unrecoverable") from None
    name = index.get("path")
    name = os.path.basename(name) if isinstance(name, str) else None
    if not name or name in (".", "..") or "\0" in name:
        raise ValueError(f"{where}: damaged spill index (field 'path' = {short(index.get('path'))}): unrecoverable")
    level = index.get("compresslevel", 1)
    if not isinstance(level, int) or isinstance(level, bool) or not -1 <= level <= 9:
        raise ValueError(f"{where}: field 'compresslevel' = {short(level)} is not a zlib level (-1 to 9): "
                         f"unrecoverable")
    raw = index["fields"]
    missing = [n for n in REQUIRED_FIELDS if n not in raw]
    if missing:
        raise ValueError(f"{where}: field(s) {missing} missing: unrecoverable")
    foreign = sorted(n for n in raw if n not in FIELD2SPEC)  # a name is a file in the spill: no paths
    if foreign:
        raise ValueError(f"{where}: field(s) {[short(n) for n in foreign[:3]]} are not fields of the trace format "
                         f"({', '.join(FIELD2SPEC)}): unrecoverable")
    fields = {}
    for n, v in raw.items():
        dtypes, rank = FIELD2SPEC[n]
        # matched against the format's own dtypes: a hostile descr is never parsed
        descr2dtype = {np.lib.format.dtype_to_descr(d): d for d in dtypes}
        descr = v.get("dtype") if isinstance(v, dict) else None
        if not isinstance(descr, str) or descr not in descr2dtype:
            raise ValueError(f"{where}: field {n!r} has dtype {short(descr)}, not one the format allows "
                             f"({' or '.join(descr2dtype)}): unrecoverable")
        want = [] if rank == 1 else [meta.num_layers, meta.top_k]
        tail = v.get("tail") if isinstance(v, dict) else None
        if tail != want or not all(type(x) is int for x in tail):
            shape = "[] (a [T] field)" if rank == 1 else f"{want} (meta's num_layers, top_k)"
            raise ValueError(f"{where}: field {n!r} has row shape (tail) {short(tail)}, the format's is {shape}: "
                             f"unrecoverable")
        fields[n] = (descr2dtype[descr], tuple(tail))
    return meta, name, fields, level


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
