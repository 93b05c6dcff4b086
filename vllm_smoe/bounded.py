"""Readers that trust nothing a file says about itself: every file smoe accepts from a user is a
regular file under a size cap, and YAML comes without aliases and without deep nesting.

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
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: {what} is {kind_of(st.st_mode)}, not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise ValueError(f"{path}: {what} is {st.st_size} bytes, over the {max_bytes} smoe reads")
    return st.st_size


def short(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that name a bad value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...)"


def load_yaml(path: str, what: str, max_bytes: int = MAX_YAML_BYTES, max_depth: int = MAX_DEPTH):
    """The document in ``path``, read once from a regular file of at most ``max_bytes``, parsed
    with YAML's safe loader minus aliases and nesting deeper than ``max_depth``. Raises
    ValueError naming the file and the line."""
    import yaml

    regular_file(path, what, max_bytes)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(f"{path}: {what}: cannot read ({e.strerror})") from None
    if len(data) > max_bytes:  # grew since the check
        raise ValueError(f"{path}: {what} is over the {max_bytes} bytes smoe reads")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: {what} is not a text (YAML) file") from None

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                raise ValueError(f"{path}: {what}: line {event.start_mark.line + 1}: YAML aliases (*name) are not "
                                 f"accepted")
            self.depth += 1
            try:
                if self.depth > max_depth:
                    raise ValueError(f"{path}: {what}: line {event.start_mark.line + 1}: nested deeper than "
                                     f"{max_depth} levels")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "not valid YAML"
        raise ValueError(f"{path}: {what}: malformed YAML{where} ({problem})") from None
