"""A config file's bytes to a mapping, every problem one line naming the file, line and column.

Configs are often written in editors set up for Chinese text (the reference tool's own
examples hold `，`): a file that is not UTF-8, or holds full-width punctuation where JSON or
YAML needs ASCII, is reported at the character, with its code point and the ASCII meant,
instead of a parser's puzzle or a UnicodeDecodeError traceback. YAML comments may hold any
text. YAML reads `1e8` as a number (YAML 1.1 wanted `1.0e+8`), as JSON does. A YAML document
whose aliases expand it past MAX_EXPANDED_VALUES values (a "billion laughs" alias bomb) is
refused before anything is built from it.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

from .errors import ConfigError

# what a full-width or typographic character stands for in ASCII
_ASCII_FOR = {
    "\u3000": " ",
    "\u3001": ",",
    "\u3002": ".",
    "\u201c": '"',
    "\u201d": '"',
    "\u2018": "'",
    "\u2019": "'",
    "\u300c": '"',
    "\u300d": '"',
    "\u3010": "[",
    "\u3011": "]",
}
_ASCII_FOR.update({chr(c): chr(c - 0xFEE0) for c in range(0xFF01, 0xFF5F)})  # ！ .. ～ -> ! .. ~
_SUSPECT = re.compile("[" + "".join(re.escape(c) for c in _ASCII_FOR) + "]")


def is_yaml(path: str) -> bool:
    return path.endswith((".yaml", ".yml"))


def parse_config_bytes(data: bytes, path: str) -> Any:
    """The parsed JSON or YAML document; ConfigError (one line) for any problem."""
    text = decode(data, path)
    yaml = is_yaml(path)
    check_punctuation(text, path, yaml)
    kind = "YAML" if yaml else "JSON"
    try:
        return _load_yaml(text, path) if yaml else json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not valid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise ConfigError(f"config file {path} is not a monitor config: its {kind} nests too deeply") from None
    except ValueError as exc:  # an integer of thousands of digits; ConfigError is one too
        if isinstance(exc, ConfigError):
            raise
        what = " ".join(str(exc).split(";")[0].split())  # not Python's advice on sys.set_int_max_str_digits
        raise ConfigError(f"config file {path} is not valid {kind}: {what}") from None


def decode(data: bytes, path: str) -> str:
    """UTF-8 text (a leading byte-order mark is dropped); else where the first bad byte is."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        start = exc.start
        line = data.count(b"\n", 0, start) + 1
        line_start = data.rfind(b"\n", 0, start) + 1
        column = len(data[line_start:start].decode("utf-8")) + 1
        raise ConfigError(
            f"config file {path} is not UTF-8: line {line}, column {column}: byte "
            f"0x{data[start]:02X} {_reads_as(data, start)}; save the file as UTF-8"
        ) from None
    return text[1:] if text.startswith("\ufeff") else text


def _reads_as(data: bytes, start: int) -> str:
    """What the bad byte most likely was: a GBK character (two bytes), else a Latin-1 one."""
    try:
        char = data[start : start + 2].decode("gbk")
        if len(char) == 1:
            return f"(in GBK, {_describe(char)})"
    except UnicodeDecodeError:
        pass
    return f"(in Latin-1, {_describe(data[start : start + 1].decode('latin-1'))})"


def _describe(char: str) -> str:
    name = unicodedata.name(char, "")
    return f"{char!r} U+{ord(char):04X}" + (f" {name}" if name else "")


def check_punctuation(text: str, path: str, yaml: bool) -> None:
    """The first full-width or typographic punctuation mark outside a YAML comment."""
    for number, line in enumerate(text.splitlines(), 1):
        content = _strip_yaml_comment(line) if yaml else line
        match = _SUSPECT.search(content)
        if match:
            char = match.group()
            raise ConfigError(
                f"config file {path}: line {number}, column {match.start() + 1}: {_describe(char)} "
                f"is not ASCII; write {_ASCII_FOR[char]!r} instead"
            )


def _strip_yaml_comment(line: str) -> str:
    """The line without its comment: `#` at the start or after a blank, outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def _load_yaml(text: str, path: str) -> Any:
    import yaml

    loader = _yaml_loader()(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_EXPANDED_VALUES:
            raise ConfigError(
                f"config file {path} is not a monitor config: its YAML aliases expand it to more than "
                f"{MAX_EXPANDED_VALUES} values (an alias bomb?)"
            )
        return None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = "; ".join(p for p in (exc.context, exc.problem) if p)
        raise ConfigError(f"config file {path} is not valid YAML: {where}{what}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    finally:
        loader.dispose()


def _expanded_size(node: Any, sizes: dict[int, int]) -> int:
    """How many values the document under `node` holds once every alias is replaced by what it
    names, counted without expanding anything: an aliased node's size is counted once, then
    reused (a YAML alias is the very node its anchor marks)."""
    import yaml

    known = sizes.get(id(node))
    if known is not None:
        return known
    sizes[id(node)] = 1  # a node that holds itself (recursive aliases) counts once
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(item, sizes) for item in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    else:
        size = 1
    sizes[id(node)] = size
    return size


# values in a config once its YAML aliases are expanded: a real config has a few thousand at
# most (targets of a large model); a few lines of nested aliases can make billions
MAX_EXPANDED_VALUES = 1_000_000

_LOADER: Any = None


def _yaml_loader() -> Any:
    """SafeLoader that also reads `1e8` and `1E-8` as floats (YAML 1.2's core schema)."""
    global _LOADER
    if _LOADER is None:
        import yaml

        class Loader(yaml.SafeLoader):
            pass

        # appended after the YAML 1.1 resolvers, so integers and dotted floats resolve as before
        Loader.add_implicit_resolver(
            "tag:yaml.org,2002:float",
            re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
            list("-+0123456789"),
        )
        _LOADER = Loader
    return _LOADER
