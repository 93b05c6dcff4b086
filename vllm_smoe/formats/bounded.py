"""Readers that trust nothing a file says about itself: every file smoe accepts from a user is a
regular file under a size cap, and YAML comes without deep nesting and without aliases that
expand past a cap.

Why: a FIFO or a symlink to ``/dev/zero`` would block or read until memory runs out; a 300-byte
YAML of nested aliases expands to gigabytes (and so would any message that quotes a value);
nesting deep enough exhausts the parser's recursion. Errors name the file and what was wrong,
never the file's content.
"""

from __future__ import annotations

import os
import stat

MAX_YAML_BYTES = 16 << 20  # a placement of 256 experts x 61 layers with copies is well under 1 MiB
MAX_DEPTH = 32  # smoe's own YAML nests 4 deep
MAX_NODES = 5_000_000  # values once aliases are expanded; a placement of 61 layers x 256 experts has ~50 k


def kind_of(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def regular_file(path: str, what: str, max_bytes: int | None = None) -> int:
    """Size of ``path`` (symlinks followed) after checking it is a regular file of at most
    ``max_bytes``. Raises ValueError naming the file and ``what`` it was given as."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: {what} not found") from None
    except OSError as e:
        raise ValueError(f"{path}: {what}: cannot read ({e.strerror})") from None
    return _checked_size(st, path, what, max_bytes)


def _checked_size(st: os.stat_result, path: str, what: str, max_bytes: int | None) -> int:
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: {what} is {kind_of(st.st_mode)}, not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise ValueError(f"{path}: {what} is {st.st_size} bytes, over the {max_bytes} smoe reads")
    return st.st_size


def short(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that name a bad value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...)"


def expanded_size(root) -> int:
    """Nodes of a composed YAML document once every alias is expanded (what a reader that walks
    it touches), counted over the shared node graph without expanding it. Raises ValueError on
    a node that contains itself."""
    import yaml

    size: dict[int, int] = {}
    stack = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            kids = _children(node, yaml)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            continue
        if key in size:
            continue
        if key in on_path:
            raise ValueError("a YAML alias refers to a node that contains it")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in _children(node, yaml) if id(k) not in size)
    return size[id(root)]


def _children(node, yaml) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    return []


def read_bytes(path: str, what: str, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``, read once. What is read is checked
    again once open (non-blocking, so a FIFO or device put there after the check is refused, not
    waited on): a path can change between a check and an open."""
    regular_file(path, what, max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise ValueError(f"{path}: {what}: cannot read ({e.strerror})") from None
    try:
        with os.fdopen(fd, "rb") as f:
            _checked_size(os.fstat(f.fileno()), path, what, max_bytes)
            data = f.read(max_bytes + 1)  # a regular file: O_NONBLOCK changes nothing
    except OSError as e:
        raise ValueError(f"{path}: {what}: cannot read ({e.strerror})") from None
    if len(data) > max_bytes:  # grew since the check
        raise ValueError(f"{path}: {what} is over the {max_bytes} bytes smoe reads")
    return data


def load_yaml(path: str, what: str, max_bytes: int = MAX_YAML_BYTES, max_depth: int = MAX_DEPTH,
              max_nodes: int = MAX_NODES, data: bytes | None = None):
    """The document in ``path``, read once from a regular file of at most ``max_bytes``, parsed
    with YAML's safe loader, nested at most ``max_depth`` levels and at most ``max_nodes``
    values once aliases are expanded (aliases are fine; a few hundred bytes of nested aliases
    that expand to billions of values are not). Raises ValueError naming the file and the line.
    ``data``: the file's bytes as read before (the file is then not opened; ``path`` names it)."""
    import yaml

    if data is None:
        data = read_bytes(path, what, max_bytes)
    if len(data) > max_bytes:
        raise ValueError(f"{path}: {what} is over the {max_bytes} bytes smoe reads")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: {what} is not a text (YAML) file") from None

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            event = self.peek_event()
            self.depth += 1
            try:
                if self.depth > max_depth and not isinstance(event, yaml.AliasEvent):
                    raise ValueError(f"{path}: {what}: line {event.start_mark.line + 1}: nested deeper than "
                                     f"{max_depth} levels")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    try:
        loader = Loader(text)  # refuses characters YAML does not allow (a NUL byte) here already
    except yaml.reader.ReaderError as e:
        raise ValueError(f"{path}: {what}: not YAML text (unacceptable character #x{e.character:04x} at "
                         f"position {e.position})") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            n = expanded_size(node)
        except ValueError as e:
            raise ValueError(f"{path}: {what}: {e}") from None
        if n > max_nodes:
            raise ValueError(f"{path}: {what}: its aliases expand to {n} values, over the {max_nodes} smoe reads")
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "not valid YAML"
        raise ValueError(f"{path}: {what}: malformed YAML{where} ({problem})") from None
    finally:
        loader.dispose()


def refuse_special(path: str, flag: str) -> None:
    """smoe writes a file by renaming a finished temporary over it: that would put a regular file
    where a device node, FIFO or socket was (as root, ``-o /dev/null`` would break the host).
    Raises ValueError for anything at ``path`` (symlinks followed) but a regular file."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return  # nothing there (the directory checks name what is wrong with the parents)
    if stat.S_ISDIR(mode):
        raise ValueError(f"{path}: {flag} names a directory, not a file")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path}: {flag} names {kind_of(mode)}; smoe writes regular files only (it would replace it)")
