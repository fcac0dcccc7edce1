"""Model/cache configs: YAML files under configs/models/ loaded into specs, groups and a pool."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ._groups import HybridPoolSpec, KVCacheGroup
from ._specs import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec, merge

_TOP_KEYS = {"name", "num_layers", "num_heads", "num_blocks", "block_size", "dtype", "groups"}
_REQUIRED_TOP = {"name", "num_layers", "num_heads", "num_blocks", "block_size", "groups"}
_GROUP_KEYS = {
    "mla": {"name", "type", "layers", "backend", "kv_lora_rank", "rope_dim", "dtype"},
    "full_attention": {"name", "type", "layers", "backend", "num_kv_heads", "head_size", "head_size_v", "dtype"},
    "sliding_window": {"name", "type", "layers", "backend", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window"},
    "mamba": {"name", "type", "layers", "backend", "shapes", "dtypes"},
}
_SPEC_TYPES = {
    "mla": MLAAttentionSpec,
    "full_attention": FullAttentionSpec,
    "sliding_window": SlidingWindowSpec,
    "mamba": MambaSpec,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A model's cache layout: its layers grouped, and the pool they share."""

  name: str
  num_layers: int
  num_heads: int
  pool: HybridPoolSpec

  @property
  def groups(self) -> tuple[KVCacheGroup, ...]:
    return self.pool.groups


def _check_keys(where: str, got: dict, allowed: set[str], required: set[str]) -> None:
  for key in got:
    if key not in allowed:
      raise ValueError(f"{where}: unknown key {key!r} (allowed: {sorted(allowed)})")
  for key in sorted(required - set(got)):
    raise ValueError(f"{where}: missing key {key!r}")


def _int(where: str, key: str, value: Any, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{where}: key {key!r} must be an int >= {minimum}, got {value!r}")
  return value


def _layers(where: str, value: Any, num_layers: int) -> tuple[int, ...]:
  """`layers` is "all", a list of indices, or {every: k, offset: o}."""
  if value == "all":
    return tuple(range(num_layers))
  if isinstance(value, dict):
    _check_keys(f"{where}.layers", value, {"every", "offset"}, {"every"})
    every = _int(f"{where}.layers", "every", value["every"])
    offset = _int(f"{where}.layers", "offset", value.get("offset", 0), 0)
    return tuple(range(offset, num_layers, every))
  if isinstance(value, list) and value:
    for i in value:
      if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
        raise ValueError(f"{where}: key 'layers' holds {i!r}, not a layer index in [0, {num_layers})")
    return tuple(value)
  raise ValueError(f"{where}: key 'layers' must be 'all', a list of layer indices or {{every, offset}}, got {value!r}")


def _group(where: str, raw: Any, top: dict) -> KVCacheGroup:
  if not isinstance(raw, dict):
    raise ValueError(f"{where}: must be a mapping, got {raw!r}")
  kind = raw.get("type")
  if kind not in _GROUP_KEYS:
    raise ValueError(f"{where}: key 'type' must be one of {sorted(_GROUP_KEYS)}, got {kind!r}")
  _check_keys(where, raw, _GROUP_KEYS[kind], {"name", "type", "layers", "backend"})
  fields = {k: v for k, v in raw.items() if k not in ("name", "type", "layers", "backend")}
  if kind != "mamba":
    fields.setdefault("dtype", top.get("dtype", "bfloat16"))
  try:
    spec = _SPEC_TYPES[kind](block_size=top["block_size"], **fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: {e}") from e
  layer_ids = _layers(where, raw["layers"], top["num_layers"])
  # Every layer of the group gets its own spec; merging checks that they agree.
  spec = merge([spec] * len(layer_ids))
  return KVCacheGroup(
      name=str(raw["name"]),
      layer_names=tuple(f"layers.{i}" for i in layer_ids),
      spec=spec,
      backend=str(raw["backend"]),
  )


def load_model_config(source: str | Path | dict) -> ModelConfig:
  """Loads a model/cache config.

  Args:
    source: a shipped config's name (`"tiny-mla"`, `"deepseek-v3"`,
      `"kimi-linear"`, `"llama3-8b"`), a path to a YAML file, or an already
      parsed mapping.

  Returns:
    The config, with every group's spec built and validated.

  Raises:
    ValueError: naming the unknown key, the missing key or the bad value.
  """
  if isinstance(source, dict):
    raw, where = source, "config"
  else:
    path = Path(source)
    if not path.suffix:
      shipped = resources.files("jaxkv._configs").joinpath("models", f"{source}.yaml")
      if not shipped.is_file():
        raise ValueError(f"no shipped model config {str(source)!r}; shipped: {list_model_configs()}")
      text, where = shipped.read_text(), f"{source}.yaml"
    else:
      text, where = path.read_text(), str(path)
    raw = yaml.safe_load(text)
  if not isinstance(raw, dict):
    raise ValueError(f"{where}: must be a YAML mapping")
  _check_keys(where, raw, _TOP_KEYS, _REQUIRED_TOP)
  for key in ("num_layers", "num_heads", "num_blocks", "block_size"):
    _int(where, key, raw[key])
  if not isinstance(raw["groups"], list) or not raw["groups"]:
    raise ValueError(f"{where}: key 'groups' must be a non-empty list")
  groups = tuple(_group(f"{where}: groups[{i}]", g, raw) for i, g in enumerate(raw["groups"]))
  covered = sorted(int(l.split(".")[1]) for g in groups for l in g.layer_names)
  if covered != list(range(raw["num_layers"])):
    raise ValueError(f"{where}: groups must cover every layer exactly once, got layers {covered}")
  try:
    pool = HybridPoolSpec(num_blocks=raw["num_blocks"], groups=groups)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from e
  return ModelConfig(name=str(raw["name"]), num_layers=raw["num_layers"], num_heads=raw["num_heads"], pool=pool)


def list_model_configs() -> list[str]:
  folder = resources.files("jaxkv._configs").joinpath("models")
  return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))
