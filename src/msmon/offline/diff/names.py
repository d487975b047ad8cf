"""`--map names.json`: A's tensor names rewritten into B's, msprobe's way: pairs of substrings,
each occurrence of the first replaced by the second, pair after pair in the file's order
(`{"model.layers.": "decoder.layers.", "self_attn.": "self_attention."}` for HF against
Megatron names, `{"te_linear": "linear"}` for TransformerEngine modules against plain ones).
A list of pairs, `[["a", "b"], ...]`, is read the same way."""

from __future__ import annotations

import json
from typing import Any

from .errors import DiffInputError


class NameMap:
    """Substring pairs applied to A's names (empty: names are kept)."""

    def __init__(self, pairs: list[tuple[str, str]] | None = None) -> None:
        self.pairs = list(pairs or [])
        self._cache: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def rename(self, name: str) -> str:
        found = self._cache.get(name)
        if found is None:
            found = name
            for old, new in self.pairs:
                found = found.replace(old, new)
            self._cache[name] = found
        return found

    def __getstate__(self) -> dict[str, Any]:  # sent to the reading processes without its cache
        return {"pairs": self.pairs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.pairs, self._cache = state["pairs"], {}


def load_map(path: str | None) -> NameMap:
    """The pairs of a --map file; DiffInputError for a file that is not such pairs."""
    if path is None:
        return NameMap()
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise DiffInputError(f"--map {path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise DiffInputError(f"--map {path}: not valid JSON ({exc})") from None
    items = list(data.items()) if isinstance(data, dict) else data
    if not isinstance(items, list) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in items
    ):
        raise DiffInputError(f'--map {path}: expected {{"substring in A": "substring in B", ...}} or [["a", "b"], ...]')
    empty = [old for old, _ in items if not old]
    if empty:
        raise DiffInputError(f"--map {path}: an empty substring would match everywhere")
    return NameMap([(old, new) for old, new in items])
