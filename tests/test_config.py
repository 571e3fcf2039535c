import pytest

from conftest import ROOT, tiny_config
from reasoner.config import ConfigError, check_mesh, load_config


def test_presets_load():
  names = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
  assert {"embedded", "embedded_sft", "embedded_prefer", "embedded_distill", "tiny",
          "gemma3_1b", "gemma2_2b"} <= set(names)
  for name in names:
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert cfg.rollout.num_generations >= 2


def test_overrides_are_typed():
  cfg = tiny_config("train.steps=7", "rollout.temperature=0.5", "rollout.top_k=null",
                    "grpo.scale_rewards=false")
  assert cfg.train.steps == 7 and cfg.rollout.temperature == 0.5
  assert cfg.rollout.top_k is None and cfg.grpo.scale_rewards is False


def test_unknown_key_names_the_key_and_the_known_ones():
  with pytest.raises(ConfigError, match=r"unknown config key 'train.stepz'.*steps"):
    tiny_config("train.stepz=5")


def test_wrong_type_names_key_value_and_expectation():
  with pytest.raises(ConfigError, match=r"'train.steps' = 'five': expected an integer"):
    tiny_config("train.steps=five")


def test_impossible_values():
  with pytest.raises(ConfigError, match=r"rollout.num_generations' = 1: expected at least 2"):
    tiny_config("rollout.num_generations=1")
  with pytest.raises(ConfigError, match=r"'grpo.loss_agg' = 'mean': expected one of"):
    tiny_config("grpo.loss_agg=mean")
  with pytest.raises(ConfigError, match=r"'rollout.vocab_chunk' = 0: expected a positive"):
    tiny_config("rollout.vocab_chunk=0")
  with pytest.raises(ConfigError, match=r"'rollout.layout' = 'tp': expected auto, train, "):
    tiny_config("rollout.layout=tp")
  from reasoner import mesh as mesh_lib
  from reasoner.build import build

  with pytest.raises(ConfigError, match=r"'rollout.layout' = 'tp3': tp 3 does not divide the "
                                        r"8 devices"):
    mesh_lib.decode_mesh(build(tiny_config(), abstract=True).mesh, "tp3")


def test_batch_must_split_over_data_parallel_size():
  cfg = tiny_config("train.batch_size=3", "rollout.num_generations=2")
  with pytest.raises(ConfigError, match=r"train.batch_size' = 3.*\(6\).*mesh.fsdp = 8"):
    check_mesh(cfg, 8)
  check_mesh(cfg, 2)


def test_missing_file_and_bad_override():
  with pytest.raises(ConfigError, match="config file 'nope.yaml' does not exist"):
    load_config("nope.yaml")
  with pytest.raises(ConfigError, match="expected key=value"):
    tiny_config("train.steps")


def test_a_preset_extends_another_key_by_key(tmp_path):
  """`extends`: the keys laid over the named preset's (relative to the preset's own folder),
  mappings key by key, lists and values whole, over as many levels as are named; the long
  preset is the 1B preset with its four keys changed."""
  (tmp_path / "sub").mkdir()
  (tmp_path / "base.yaml").write_text(
      "model: {source: random, name: tiny, tokenizer: bytes, dtype: float32}\n"
      "lora: {rank: 4, alpha: 8.0}\n"
      "rewards: [{fn: format_exact, weight: 0.2}, {fn: correct, weight: 0.8}]\n"
      "train: {steps: 4, batch_size: 2, run_name: base}\n")
  (tmp_path / "sub" / "mid.yaml").write_text("extends: ../base.yaml\nlora: {rank: 8}\n"
                                            "rewards: [{fn: correct, weight: 1.0}]\n")
  (tmp_path / "top.yaml").write_text("extends: sub/mid.yaml\ntrain: {run_name: top}\n")
  top = load_config(tmp_path / "top.yaml")
  assert (top.lora.rank, top.lora.alpha) == (8, 8.0)  # mid's rank, base's alpha
  assert [r.fn for r in top.rewards] == ["correct"]  # a list replaced whole
  assert (top.train.steps, top.train.run_name, top.model.name) == (4, "top", "tiny")
  assert load_config(tmp_path / "top.yaml", ["lora.rank=2"]).lora.rank == 2  # overrides last
  long = load_config(ROOT / "configs" / "gemma3_1b_long.yaml")
  assert long == load_config(ROOT / "configs" / "gemma3_1b.yaml", [
      "model.remat=block", "rollout.max_new_tokens=4096", "eval.max_new_tokens=4096",
      "train.run_name=gemma3-1b-gsm8k-long"])


def test_a_bad_extends_is_one_line_naming_the_key(tmp_path):
  (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
  (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
  with pytest.raises(ConfigError, match="config key 'extends' = 'a.yaml' extends itself"):
    load_config(tmp_path / "a.yaml")
  (tmp_path / "c.yaml").write_text("extends: nope.yaml\n")
  with pytest.raises(ConfigError, match=r"nope.yaml' does not exist \(config key 'extends' in"):
    load_config(tmp_path / "c.yaml")
  (tmp_path / "d.yaml").write_text("extends: [a.yaml]\n")
  with pytest.raises(ConfigError, match="config key 'extends' must be a preset's path"):
    load_config(tmp_path / "d.yaml")


def test_prompt_buckets_are_checked_against_the_prompt_limit():
  assert tiny_config("rollout.prompt_buckets=[128,256]").rollout.prompt_buckets == (128, 256)
  with pytest.raises(ConfigError, match=r"'rollout.prompt_buckets' .*strictly increasing"):
    tiny_config("rollout.prompt_buckets=[256,128]")
  with pytest.raises(ConfigError, match=r"'rollout.prompt_buckets'.*max_prompt_tokens = 256"):
    tiny_config("rollout.prompt_buckets=[64,128]")


@pytest.mark.parametrize("text,value", [("1e-5", 1e-5), ("3E-4", 3e-4), ("1.0e+30", 1e30),
                                        ("2.5e3", 2500.0), ("1_000", 1000.0), ("3.0e-5", 3e-5)])
def test_numbers_in_scientific_notation(tmp_path, text, value):
  assert load_config(None, [f"optim.learning_rate={text}"]).optim.learning_rate == value
  f = tmp_path / "c.yaml"
  f.write_text(f"optim:\n  learning_rate: {text}\n")
  assert load_config(f).optim.learning_rate == value


def test_the_committed_configuration_reference_is_what_the_command_writes(tmp_path):
  """docs/configuration.md is generated from the typed config (`python -m reasoner config
  --docs`, `make docs`): edit a field's comment in reasoner/config/ and regenerate."""
  from reasoner import cli
  from reasoner.config import Config, reference

  out = tmp_path / "configuration.md"
  assert cli.main(["config", "--docs", str(out)]) == 0
  assert out.read_text() == reference.markdown(Config)
  committed = (ROOT / "docs" / "configuration.md").read_text()
  assert committed == out.read_text(), "docs/configuration.md is stale: run `make docs`"
  # every key of every section is in it, with its default and its comment
  for key, cls in reference.sections(Config):
    assert f"## `{key}`" in committed
  assert "| `held_out_by` | 'record' \\| 'template' | `\"record\"` | arithmetic: what the held-out" in committed
  assert "## `eval.sets[]`" in committed and "## `data.mixture[]`" in committed


def test_config_prints_a_preset_as_resolved(capsys):
  import yaml

  from reasoner import cli

  assert cli.main(["config", "--config", str(ROOT / "configs/tiny.yaml"), "train.steps=7",
                   "eval.sets=[{name: r, source: jsonl, path: x.jsonl, retention: true}]"]) == 0
  tree = yaml.safe_load(capsys.readouterr().out)
  assert tree["train"]["steps"] == 7 and tree["model"]["name"] == "tiny"
  assert tree["eval"]["sets"][0]["retention"] is True
  assert tree["grpo"]["beta"] == 0.04 and tree["optim"]["learning_rate"] == 0.001  # the preset
  assert cli.main(["config", "--config", str(ROOT / "configs/tiny.yaml"), "train.steps=0"]) == 2
  assert "config key 'train.steps' = 0" in capsys.readouterr().err


def test_guidance_refuses_the_sampler_weight():
  with pytest.raises(ConfigError, match="'grpo.guidance' = True: expected false with "
                                        "grpo.sampler_is: token"):
    tiny_config("grpo.guidance=true", "grpo.sampler_is=token")
  with pytest.raises(ConfigError, match="'grpo.guidance_categories' = \\[\\]"):
    tiny_config("grpo.guidance=true", "grpo.guidance_categories=[]")
