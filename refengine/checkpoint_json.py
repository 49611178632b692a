"""A checkpoint's JSON files, read strictly: config.json fields with their JSON types checked (an error names
the file, the field and the value, expected vs actual), and the stop ids HF generate() uses.

config.py's ModelConfig.from_hf / DFlashConfig.from_hf parse through these helpers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from refengine.errors import CheckpointError


class ConfigJson(dict):
    """A parsed config.json that remembers its file, so a bad field's error can name it."""

    def __init__(self, data: dict, path: Path):
        super().__init__(data)
        self.path = path


def read_json_object(p: Path, what: str) -> dict:
    """A JSON file whose top level must be an object; CheckpointError naming the file otherwise."""
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p}: {what} is not valid JSON ({e})") from e
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read {what} ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{p}: {what} must hold a JSON object {{...}}, got a JSON {json_kind(data)}")
    return data


def read_config_json(path: str | Path) -> ConfigJson:
    """config.json from a checkpoint directory (or the file itself)."""
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise CheckpointError(f"{p}: no config.json (expected a checkpoint directory with config.json)")
    return ConfigJson(read_json_object(p, "config.json"), p)


def json_kind(v) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "list",
        dict: "object",
        type(None): "null",
    }.get(type(v), type(v).__name__)


def where_of(cfg: dict, where: str) -> str:
    """'target config /ckpt/config.json' when cfg came from read_config_json, else 'target config.json'."""
    path = getattr(cfg, "path", None)
    return f"{where} config {path}" if path is not None else f"{where} config.json"


def field_error(cfg: dict, where: str, key: str, value, expected: str) -> CheckpointError:
    return CheckpointError(
        f"{where_of(cfg, where)}: field {key!r} is {value!r} (a JSON {json_kind(value)}), expected {expected}"
    )


def need_field(cfg: dict, where: str, key: str):
    if cfg.get(key) is None:
        raise CheckpointError(f"{where_of(cfg, where)}: lacks required field {key!r}")
    return cfg[key]


def check_int(cfg: dict, where: str, key: str, value, minimum: int = 1) -> int:
    """`value` (field `key`) as an int >= minimum; booleans, numbers with a point (4.0 too), strings refused."""
    if type(value) is not int or value < minimum:
        raise field_error(cfg, where, key, value, f"an integer >= {minimum}")
    return value


def int_field(cfg: dict, where: str, key: str, default: int | None = None, minimum: int = 1) -> int:
    """cfg[key] checked by check_int; absent or null: `default`, or an error when there is none."""
    if cfg.get(key) is None and default is not None:
        return default
    return check_int(cfg, where, key, need_field(cfg, where, key), minimum)


def positive_float(cfg: dict, where: str, key: str, value) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise field_error(cfg, where, key, value, "a finite number > 0")
    return float(value)


def bool_field(cfg: dict, where: str, key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if type(value) is not bool:
        raise field_error(cfg, where, key, value, "true or false")
    return value


def token_ids_field(cfg: dict, where: str, key: str) -> tuple[int, ...]:
    """An HF eos-style field: an id, a list of ids, or null / absent (no ids)."""
    value = cfg.get(key)
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if any(type(i) is not int or i < 0 for i in items):
        raise field_error(cfg, where, key, value, "a token id >= 0, a list of them, or null")
    return tuple(items)


def read_stop_ids(checkpoint_dir: str | Path, model_cfg) -> tuple[int, ...]:
    """The token ids HF generate() stops on for this checkpoint, resolved as transformers does: the
    eos_token_id of generation_config.json when that file exists (an id or a list; absent or null there
    means no stop id at all, config.json's is then NOT used), else config.json's (model_cfg.eos_token_ids).
    Real Qwen3 checkpoints list two there, e.g. [151645, 151643], where config.json has one.

    Stricter than HF where HF is silent: a generation_config.json that is not a JSON object (HF falls back
    to config.json) or names ids outside the vocabulary is a CheckpointError naming the file."""
    d = Path(checkpoint_dir)
    d = d if d.is_dir() else d.parent
    p = d / "generation_config.json"
    if p.is_file():
        gen = ConfigJson(read_json_object(p, "generation_config.json"), p)
        ids = token_ids_field(gen, "generation", "eos_token_id")
        where = f"generation config {p}"
    else:
        ids, where = tuple(model_cfg.eos_token_ids), f"config {d / 'config.json'}"
    bad = [i for i in ids if i >= model_cfg.vocab_size]
    if bad:
        raise CheckpointError(f"{where}: eos_token_id {bad} outside the vocabulary 0..{model_cfg.vocab_size - 1}")
    return tuple(dict.fromkeys(ids))  # HF matches any of them; order kept, duplicates dropped
