"""The YAML file `pdserve serve --config FILE` reads: a mapping of option names
(router/serve_options.py) to values, each checked as its flag is. A bad file stops the server
before it starts, naming the field (`config FILE: decode: must be an integer >= 1, got 0`).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml

from router.option_values import OptionError
from router.serve_options import BY_NAME


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (which YAML would take as
    its last value, the first one lost silently), an option's `-` and `_` spellings alike; and
    reading numbers as YAML 1.2 does: `050051` is 50051 (YAML 1.1 reads a leading 0 as octal,
    20521), `1:30` and `1:30.5` are strings (1.1: 90 and 90.5, in base 60), `1e3` is 1000.0."""

    _root: Any = None

    def construct_document(self, node: Any) -> Any:
        self._root = node
        return super().construct_document(node)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges a mapping in: not a field of its own
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # not an option name: refused as an unknown field later
            # Option names are spelled either way; other keys (Ray resources) are as written.
            name = key.replace("-", "_") if isinstance(key, str) and node is self._root else key
            if name in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"field {key!r} is given twice", key_node.start_mark
                )
            seen.add(name)
        return super().construct_mapping(node, deep)


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_UniqueKeys.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# YAML 1.2's core schema: an integer first, then a float (1e3 included; 1:30.5 no longer 90.5).
_UniqueKeys.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_UniqueKeys.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)


def _yaml12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    word = str(loader.construct_scalar(node))
    if word.startswith(("0o", "0x")):
        return int(word[2:], 8 if word[1] == "o" else 16)
    return int(word)


_UniqueKeys.add_constructor(_INT, _yaml12_int)


def read_file(path: Path) -> dict[str, Any]:
    """The options a YAML file sets, checked; raises OptionError naming the field."""
    where = f"config {path}"
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeys)
    except OSError as exc:
        raise OptionError(f"{where}: cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise OptionError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise OptionError(f"{where}: not valid YAML: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise OptionError(f"{where}: must be a mapping of option names to values")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        option = BY_NAME.get(name)
        if option is None:
            near = difflib.get_close_matches(name, BY_NAME, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise OptionError(f"{where}: unknown field {key!r}{hint}")
        try:
            out[name] = option.parse(value)
        except ValueError as exc:
            raise OptionError(f"{where}: {name}: {exc}") from None
        if option.is_path and out[name] is not None:
            out[name] = _beside(out[name], path)  # wherever serve runs
    return out


def model_beside(model: str, config: Path) -> str:
    """`model` as a file gives it: a relative folder or .gguf file is the file's folder's, as
    the file's other paths are; a built-in name is itself."""
    from engine.loader import BUILTIN_MODELS  # torch's and transformers' imports: only here

    return model if model in BUILTIN_MODELS else str(_beside(Path(model).expanduser(), config))


def _beside(path: Path, config: Path) -> Path:
    """A relative path in the file, as the file's folder's."""
    return path if path.is_absolute() else config.absolute().parent / path
