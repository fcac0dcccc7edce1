"""Model/cache configs: the shipped YAML files and the errors bad ones give."""

import textwrap

import pytest

import jaxkv
from jaxkv import MambaSpec, MLAAttentionSpec, FullAttentionSpec, load_model_config, pool_zeroing_plan


def test_shipped_configs_load():
  assert jaxkv.list_model_configs() == ["deepseek-v3", "kimi-linear", "llama3-8b", "tiny-mla"]
  ds = load_model_config("deepseek-v3")
  (g,) = ds.groups
  assert (ds.num_layers, ds.num_heads, len(g.layer_names)) == (61, 128, 61)
  assert g.spec == MLAAttentionSpec(64, kv_lora_rank=512, rope_dim=64, dtype="bfloat16")
  llama = load_model_config("llama3-8b")
  assert llama.groups[0].spec == FullAttentionSpec(16, num_kv_heads=8, head_size=128, dtype="bfloat16")
  tiny = load_model_config("tiny-mla")
  assert tiny.pool.num_blocks == 64 and tiny.groups[0].spec.block_size == 64


def test_kimi_linear_is_a_hybrid_pool_that_zeroes():
  kimi = load_model_config("kimi-linear")
  mla, kda = kimi.groups
  assert isinstance(mla.spec, MLAAttentionSpec) and isinstance(kda.spec, MambaSpec)
  assert mla.layer_names == ("layers.3", "layers.7", "layers.11", "layers.15", "layers.19", "layers.23")
  assert len(kda.layer_names) == 18
  assert kimi.pool.page_size_bytes == kda.spec.page_size_bytes
  assert kimi.pool.padding_bytes["mla"] == kda.spec.page_size_bytes - mla.spec.page_size_bytes
  plan = pool_zeroing_plan(kimi.pool)
  assert plan["mla"].required and plan["kda"].required


BASE = """
name: t
num_layers: 2
num_heads: 4
num_blocks: 8
block_size: 16
groups:
  - name: mla
    type: mla
    layers: all
    backend: pallas_mla_decode_select
"""


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s + "colour: red\n", "unknown key 'colour'"),
        (lambda s: s.replace("    backend:", "    kv_lora_rnk: 4\n    backend:"), r"groups\[0\]: unknown key 'kv_lora_rnk'"),
        (lambda s: s.replace("num_heads: 4\n", ""), "missing key 'num_heads'"),
        (lambda s: s.replace("num_blocks: 8", "num_blocks: -3"), "'num_blocks' must be an int >= 1"),
        (lambda s: s.replace("num_blocks: 8", "num_blocks: 1"), "num_blocks"),
        (lambda s: s.replace("type: mla", "type: rnn"), "key 'type' must be one of"),
        (lambda s: s.replace("layers: all", "layers: [0, 5]"), "not a layer index"),
        (lambda s: s.replace("layers: all", "layers: [0]"), "cover every layer"),
        (lambda s: s.replace("    backend:", "    dtype: int77\n    backend:"), "dtype"),
        (lambda s: s.replace("    backend:", "    rope_dim: 0\n    backend:"), "rope_dim"),
    ],
)
def test_bad_configs_name_the_key(tmp_path, edit, match):
  path = tmp_path / "bad.yaml"
  path.write_text(edit(textwrap.dedent(BASE)))
  with pytest.raises(ValueError, match=match):
    load_model_config(path)


def test_unknown_shipped_name():
  with pytest.raises(ValueError, match="no shipped model config 'gpt-9'"):
    load_model_config("gpt-9")


def test_backend_of_config_is_checked_by_the_policy(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text(textwrap.dedent(BASE).replace("pallas_mla_decode_select", "xla_full_attention_reference"))
  config = load_model_config(path)
  with pytest.raises(ValueError, match="does not serve MLAAttentionSpec"):
    pool_zeroing_plan(config.pool)


def test_audit_cli(capsys):
  from jaxkv.__main__ import main

  assert main(["audit", "kimi-linear"]) == 0
  out = capsys.readouterr().out
  assert "group 'kda'" in out and "the pool holds recurrent state" in out
  assert main(["audit", "nope"]) == 2
