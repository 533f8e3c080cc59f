"""Load, override, validate and save configs.

A config is built in layers, later layers overriding earlier ones key by key:

1. the dataclass defaults of `tttvideo.config.schema.Config`;
2. the files named by a top-level ``include = "base.toml"`` (or a list of them), recursively, paths relative to the
   including file;
3. the file itself;
4. ``--set section.key=value`` overrides, in command-line order (the value is a TOML literal; text that is not one
   is taken as a bare string).

The mapping from TOML onto the dataclasses is generic: it walks `dataclasses.fields` and the resolved type hints, so
a field added to any section is loadable, overridable, validated and dumped without touching this module. Every
mistake in user input is a `ConfigError` whose one sentence names the dotted key, the file (or ``--set``) and what is
allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from tttvideo.config.schema import Config
from tttvideo.errors import ConfigError

INCLUDE_KEY = "include"
OVERRIDE_SOURCE = "--set"
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_NONE = type(None)


# ---------------------------------------------------------------------------------------------------------- loading
# an override: "section.key=value" (from --set), or (that text, the flag it came from) so a mistake in it is named
# by the flag the user typed (`tttv sample --steps 0`: "sample.steps in --steps: ...")
Override = Union[str, tuple[str, str]]


def load_config(path: str | Path | None, overrides: Iterable[Override] = (), *, schema: type = Config) -> Any:
    """Defaults <- included files <- `path` <- `overrides`, validated.

    `schema` is the root dataclass (tests use small ones); every field of it must be a section dataclass.
    """
    cfg = schema()
    if path is not None:
        for source, table in _read_chain(Path(path), stack=(), parent=None):
            _apply_table(cfg, table, prefix="", source=source)
    for override in overrides:
        _apply_override(cfg, override)
    return cfg


def with_overrides(cfg: Config, overrides: Iterable[Override]) -> Config:
    """A copy of `cfg` with `overrides` applied and validated as `--set` is."""
    cfg = copy.deepcopy(cfg)
    for override in overrides:
        _apply_override(cfg, override)
    return cfg


def _label(path: Path) -> str:
    """How a file is named in messages: the path as the user (or the include line) spelled it, normalised."""
    return os.path.normpath(str(path))


def _read_chain(path: Path, stack: tuple[Path, ...], parent: str | None) -> list[tuple[str, dict]]:
    """(file label, table) layers in the order they apply: includes first (depth first), then the file itself."""
    label = _label(path)
    resolved = path.resolve()
    if resolved in stack:
        chain = " -> ".join(_label(p) for p in (*stack, resolved))
        raise ConfigError(f"include cycle in {parent}: {chain}; remove one of these include lines")
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is not a file"
        if parent is not None:
            raise ConfigError(f"include {label} (named in {parent}, relative to its folder) {what}")
        raise ConfigError(f"config file {label} {what}{_nearby_configs_hint(path)}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{label} is not valid TOML: {err}") from None
    except (UnicodeDecodeError, OSError) as err:
        raise ConfigError(f"cannot read config file {label}: {err}") from None

    includes = data.pop(INCLUDE_KEY, None)
    layers: list[tuple[str, dict]] = []
    if includes is not None:
        if isinstance(includes, str):
            includes = [includes]
        if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
            raise ConfigError(
                f"{INCLUDE_KEY} in {label}: expected a path string or a list of them (relative to the file), "
                f"got {_describe(includes)}"
            )
        for name in includes:
            layers += _read_chain(path.parent / name, (*stack, resolved), parent=label)
    layers.append((label, data))
    return layers


def _nearby_configs_hint(path: Path) -> str:
    """The configs a mistyped CONFIG may have meant: those in the folder named (when a folder was given), else
    beside it."""
    if path.is_dir():
        folder = path
    else:
        folder = path.parent if str(path.parent) not in ("", ".") else Path("configs")
    found = sorted(p.name for p in folder.glob("*.toml")) if folder.is_dir() else []
    return f"; configs in {_label(folder)}/: {', '.join(found)}" if found else ""


def _legacy_key(obj: Any, dotted: str, value: Any, source: str) -> bool:
    """Keys an earlier version had, read into what replaced them, so that the config.toml saved with an older run
    still loads (tttv sample reads it). True when `dotted` was one of them."""
    section, _, key = dotted.rpartition(".")
    renamed = getattr(type(obj), "RENAMED_KEYS", {}).get(key)  # a section's plain renames: same value, new name
    if renamed is not None:
        _apply_table(obj, {renamed: value}, prefix=section + ".", source=source)
        return True
    removed = getattr(type(obj), "REMOVED_KEYS", {}).get(key)  # settings that did nothing: a warning, not an error
    if removed is not None:
        import logging

        logging.getLogger(__name__).warning("%s in %s is ignored: it was removed (%s)", dotted, source, removed)
        return True
    if dotted != "train.overwrite":
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"train.overwrite in {source} was replaced by train.if_exists; set train.if_exists = "
                          f"'overwrite' (or pass --overwrite) instead")
    if value:  # false was the default: nothing to carry over
        import logging

        logging.getLogger(__name__).warning(
            "train.overwrite = true in %s is the old spelling of train.if_exists = 'overwrite'; read as that", source)
        obj.if_exists = "overwrite"
    return True


def _apply_table(obj: Any, table: dict, prefix: str, source: str) -> None:
    """Set the keys of `table` on the dataclass instance `obj`; sub-tables merge into nested dataclasses."""
    fields = _settable_fields(type(obj))
    hints = _hints(type(obj))
    for key, value in table.items():
        dotted = prefix + key
        if key not in fields and _legacy_key(obj, dotted, value, source):
            continue
        if key not in fields:
            raise _unknown_key(type(obj), key, prefix, source, is_table=isinstance(value, dict))
        tp = hints[key]
        if _is_dataclass_type(tp) and isinstance(value, dict):
            # A partial table overrides only the keys it names: that is what makes include/--set layering work.
            _apply_table(getattr(obj, key), value, dotted + ".", source)
        else:
            setattr(obj, key, _convert(tp, value, dotted, source, fields[key].metadata))


def _build(cls: type, table: dict, key: str, source: str) -> Any:
    """A fresh dataclass from a table (elements of a list of tables replace, they do not merge)."""
    fields = _settable_fields(cls)
    hints = _hints(cls)
    kwargs = {}
    for name, value in table.items():
        if name not in fields:
            raise _unknown_key(cls, name, key + ".", source)
        kwargs[name] = _convert(hints[name], value, f"{key}.{name}", source, fields[name].metadata)
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{key} in {source}: missing required key(s) {', '.join(missing)}")
    return cls(**kwargs)


def _unknown_key(cls: type, key: str, prefix: str, source: str, is_table: bool = True) -> ConfigError:
    valid = list(_settable_fields(cls))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not prefix and not is_table:  # `foo = 1` above every [section]: a key, which belongs in one
        return ConfigError(f"key '{key}' in {source} stands outside any section; put it under its [section] "
                           f"({', '.join(valid)}), e.g. [train] for train.steps")
    if not prefix:
        hint = f" (did you mean [{close[0]}]?)" if close else ""
        return ConfigError(f"unknown section [{key}] in {source}{hint}; valid sections: {', '.join(valid)}")
    section = prefix.rstrip(".")
    hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
    return ConfigError(f"unknown key '{prefix}{key}' in {source}{hint}; valid keys in [{section}]: {', '.join(valid)}")


# ------------------------------------------------------------------------------------------------ type conversion
def _convert(tp: Any, value: Any, key: str, source: str, meta: Any) -> Any:
    """Check `value` (as parsed from TOML) against the type hint `tp` and the field metadata; return the value."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        options = [a for a in args if a is not _NONE]
        if len(options) == 1:  # Optional[X]: TOML has no null, so a given value is always an X
            return _convert(options[0], value, key, source, meta)
        for option in options:
            try:
                return _convert(option, value, key, source, meta)
            except ConfigError:
                continue
        raise _type_error(tp, value, key, source, meta)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _choice_error(value, args, key, source)
    if _is_dataclass_type(tp):
        if not isinstance(value, dict):
            raise _type_error(tp, value, key, source, meta)
        return _build(tp, value, key, source)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, list):
            raise _type_error(tp, value, key, source, meta)
        if (origin is tuple or tp is tuple) and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(f"{key} in {source}: expected {len(args)} items ({_type_name(tp)}), got {len(value)}")
            items = [_convert(a, v, f"{key}[{i}]", source, meta) for i, (a, v) in enumerate(zip(args, value))]
        else:
            elem = args[0] if args else Any
            # Element-level metadata (listed(..., choices=, lo=, hi=)) is checked on every element.
            items = [_convert(elem, v, f"{key}[{i}]", source, meta) for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _type_error(tp, value, key, source, meta)
        val_tp = args[1] if len(args) == 2 else Any
        return {k: _convert(val_tp, v, f"{key}.{k}", source, {}) for k, v in value.items()}
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    else:
        # A schema field of a type TOML cannot express is a bug in the schema, not in the user's file.
        raise TypeError(f"config field {key} has type {tp!r}, which the loader does not support")
    if not ok:
        raise _type_error(tp, value, key, source, meta)
    _check_metadata(value, key, source, meta)
    return value


# what a device field may name: torch.device's forms for the hardware the project runs on, and 'auto'
DEVICE_NAME = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
DEVICE_ADVICE = "use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"  # what a refused device name is told


def _check_metadata(value: Any, key: str, source: str, meta: Any) -> None:
    if meta and meta.get("device") and not DEVICE_NAME.fullmatch(value):
        raise ConfigError(f"{key} in {source}: {_toml_literal(value)} is not a device; {DEVICE_ADVICE}")
    choices = meta.get("choices") if meta else None
    if choices and value not in choices:
        raise _choice_error(value, choices, key, source)
    lo, hi = (meta.get("min"), meta.get("max")) if meta else (None, None)
    # `not value >= lo` also rejects NaN, which compares false with everything.
    if (lo is not None and not value >= lo) or (hi is not None and not value <= hi):
        raise ConfigError(f"{key} in {source}: {_toml_literal(value)} is out of range; allowed: {_range_text(lo, hi)}")


def _choice_error(value: Any, choices: Iterable[Any], key: str, source: str) -> ConfigError:
    choices = list(choices)
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
    hint = f" (did you mean {_toml_literal(choices[[str(c) for c in choices].index(close[0])])}?)" if close else ""
    allowed = ", ".join(_toml_literal(c) for c in choices)
    return ConfigError(f"{key} in {source}: {_toml_literal(value)} is not allowed{hint}; allowed: one of {allowed}")


def _type_error(tp: Any, value: Any, key: str, source: str, meta: Any) -> ConfigError:
    allowed = _allowed_text(meta)
    extra = f" ({allowed})" if allowed else ""
    hint = ""
    if source == OVERRIDE_SOURCE and typing.get_origin(tp) is list and isinstance(value, str) and value.startswith("["):
        # [attention] is no TOML list: its strings need quotes, and the shell must keep them
        words = [w.strip().strip("\"'") for w in value.strip("[]").split(",") if w.strip()]
        listed_words = ", ".join(f'"{w}"' for w in words)
        hint = f"; write it as a TOML list, quoted for the shell: --set '{key}=[{listed_words}]'"
    return ConfigError(f"{key} in {source}: expected {_type_name(tp)}{extra}, got {_describe(value)}{hint}")


def _range_text(lo: Any, hi: Any) -> str:
    if lo is not None and hi is not None:
        return f"from {lo} to {hi}"
    return f"at least {lo}" if lo is not None else f"at most {hi}"


def _allowed_text(meta: Any) -> str:
    if not meta:
        return ""
    if meta.get("choices"):
        return "one of " + ", ".join(_toml_literal(c) for c in meta["choices"])
    if meta.get("min") is not None or meta.get("max") is not None:
        return _range_text(meta.get("min"), meta.get("max"))
    return ""


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any value"
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not _NONE)
    if origin is Literal:
        # a choice field (`schema.choice`) is typed by its allowed values, which the key's help lists as "one of"
        kinds = {type(a) for a in args}
        return _type_name(kinds.pop()) if len(kinds) == 1 else "one of " + ", ".join(_toml_literal(a) for a in args)
    if _is_dataclass_type(tp):
        return f"a table of {', '.join(_settable_fields(tp))}"
    if origin in (list, tuple) or tp in (list, tuple):
        if args and not (len(args) == 2 and args[1] is Ellipsis) and (origin is tuple or tp is tuple):
            return f"list[{', '.join(_type_name(a) for a in args)}]"
        inner = args[0] if args else Any
        return f"list[{'table' if _is_dataclass_type(inner) else _type_name(inner)}]"
    if origin is dict or tp is dict:
        return f"table of {_type_name(args[1])}" if len(args) == 2 else "table"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    kind = "table" if isinstance(value, dict) else type(value).__name__
    text = _toml_literal(value) if isinstance(value, (bool, int, float, list, dict)) else repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind} {text}"


# ------------------------------------------------------------------------------------------------------- overrides
def _apply_override(cfg: Any, override: Override) -> None:
    text, source = (override, OVERRIDE_SOURCE) if isinstance(override, str) else override
    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    parts = key.split(".")
    if not sep or not key or not all(_BARE_KEY.fullmatch(p) for p in parts):
        raise ConfigError(
            f"{OVERRIDE_SOURCE} {text!r}: expected KEY=VALUE with a dotted key, e.g. {OVERRIDE_SOURCE} ttt.kind=linear"
        )
    value = _parse_literal(raw)
    if key == "train.overwrite":  # replaced by train.if_exists (`_legacy_key`)
        plain = value.lower() == "true" if isinstance(value, str) and value.lower() in ("true", "false") else value
        _apply_table(cfg, {"train": {"overwrite": plain}}, prefix="", source=source)
        return
    target = _field_type(type(cfg), parts)
    plain = _strip_optional(target)
    if typing.get_origin(plain) is Literal and all(isinstance(a, str) for a in typing.get_args(plain)):
        plain = str  # a choice of strings
    if plain is str and not isinstance(value, str):
        value = raw  # --set train.output_dir=2024 means the string "2024": the field says so
    elif plain is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"  # Python spellings True/False are what people type
    for part in reversed(parts):
        value = {part: value}
    _apply_table(cfg, value, prefix="", source=source)


def _parse_literal(raw: str) -> Any:
    """A TOML literal (10, 1e-4, true, "x", [1, 2], {a = 1}); anything else is the bare string itself."""
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        return raw
    # A value with a newline could smuggle in extra keys ("1\nw = 2"): only a lone `v` counts as a literal.
    return parsed["v"] if list(parsed) == ["v"] else raw


def _field_type(cls: type, parts: list[str]) -> Any:
    """The type hint at a dotted path, or None when the path names nothing (the apply step reports that)."""
    tp: Any = cls
    for part in parts:
        if not _is_dataclass_type(tp) or part not in _settable_fields(tp):
            return None
        tp = _hints(tp)[part]
    return tp


def _strip_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not _NONE]
        return options[0] if len(options) == 1 else tp
    return tp


# ---------------------------------------------------------------------------------------------------------- dumping
def config_to_dict(cfg: Any) -> dict:
    """Plain nested dicts/lists/scalars, tuples as lists and None values left out (TOML has no null)."""
    return _to_plain(cfg)


def flat_keys(table: dict, prefix: str = "") -> dict[str, str]:
    """{'train.lr': '0.001', ...}: the keys of nested tables (`config_to_dict`'s, or a TOML file's) dotted, each
    value as JSON text, so that two configs compare key by key."""
    out: dict[str, str] = {}
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.update(flat_keys(value, name))
        else:
            out[name] = json.dumps(value, sort_keys=True, default=str)
    return out


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.init and getattr(value, f.name) is not None}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items() if v is not None}
    return value


def dump_toml(cfg: Any, comments: bool = False) -> str:
    """The config as TOML that `load_config` reads back to an equal config.

    One ``[section]`` table per dataclass field (nested dataclasses become ``[section.sub]``); lists of tables and
    dict fields are written inline. With `comments`, every key gets its help text and allowed values above it.
    """
    lines: list[str] = []
    _emit_table(cfg, [], lines, comments)
    return "\n".join(lines).strip("\n") + "\n"


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config (what a run actually used) next to its outputs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_toml(cfg), encoding="utf-8")
    return path


def _emit_table(obj: Any, path: list[str], lines: list[str], comments: bool) -> None:
    tables = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not f.init or value is None:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            tables.append((f, value))  # TOML needs a table's plain keys before its sub-tables
            continue
        if comments:
            lines.extend(_comment_lines(_hints(type(obj))[f.name], f.metadata))
        lines.append(f"{_toml_key(f.name)} = {_toml_literal(value)}")
    for f, value in tables:
        lines.append("")
        if comments and f.metadata.get("help"):
            lines.append(f"# {f.metadata['help']}")
        lines.append("[" + ".".join(_toml_key(p) for p in (*path, f.name)) + "]")
        _emit_table(value, [*path, f.name], lines, comments)


def _comment_lines(tp: Any, meta: Any) -> list[str]:
    bits = [meta.get("help", "")] if meta and meta.get("help") else []
    allowed = _allowed_text(meta)
    bits.append(f"{_type_name(tp)}{', ' + allowed if allowed else ''}")
    return [f"# {'; '.join(bits)}"]


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}
    out = []
    for ch in text:
        if ch in escapes:
            out.append(escapes[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:  # TOML forbids raw control characters in basic strings
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest text that reads back to the same double
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = _to_plain(value)
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_literal(v)}" for k, v in value.items()
                                if v is not None) + " }"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


# ------------------------------------------------------------------------------------------------- key reference
@dataclasses.dataclass(frozen=True)
class KeyInfo:
    """One settable key, for `tttv config keys` and the docs."""

    key: str  # dotted
    type: str
    default: str  # TOML literal ('' when the default is None)
    allowed: str
    help: str


def describe_keys(schema: type = Config) -> list[KeyInfo]:
    """Every key of the schema, depth first in declaration order; element keys of lists of tables as ``a.b[].c``."""
    out: list[KeyInfo] = []
    _describe_into(schema(), schema, "", out)
    return out


def _describe_into(obj: Any, cls: type, prefix: str, out: list[KeyInfo]) -> None:
    hints = _hints(cls)
    for name, f in _settable_fields(cls).items():
        tp, key = hints[name], prefix + name
        value = getattr(obj, name) if obj is not None else _field_default(f)
        if _is_dataclass_type(tp):
            _describe_into(value, tp, key + ".", out)
            continue
        default = "" if value is None or value is dataclasses.MISSING else _toml_literal(value)
        out.append(KeyInfo(key, _type_name(tp), default, _allowed_text(f.metadata), f.metadata.get("help", "")))
        elem = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        if elem is not None and _is_dataclass_type(elem):
            _describe_into(None, elem, key + "[].", out)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


# --------------------------------------------------------------------------------------------------------- helpers
def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _settable_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    # schema.py uses `from __future__ import annotations`, so field.type is a string; resolve it once per class.
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]
