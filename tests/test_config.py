"""Recipe configs: every shipped YAML loads through its recipe's reader, and a misspelt key in any section (or a
misspelt section) is one did-you-mean error naming the file, the section, the key and the valid keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import ROOT

from disttrain.config import ConfigError, check_keys, did_you_mean, keys_of, read_config

CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def reader(path: Path):
    """The function the domain's recipe reads its config with."""
    if path.parent.name == "nlp":
        from disttrain.nlp import read_recipe_config

        return read_recipe_config
    if path.parent.name == "vision":
        from disttrain.vision import read_yaml

        return read_yaml
    from disttrain.recsys.daily import load_recipe

    return load_recipe


def mappings(config: dict, prefix: str = ""):
    """(dotted section, its mapping) for every mapping in the config whose keys are fixed names (not the free-form
    per-table ``strategy.constraints``)."""
    for key, value in config.items():
        if isinstance(value, dict) and key != "constraints":
            where = f"{prefix}.{key}" if prefix else key
            yield where, value
            yield from mappings(value, where)


def write(tmp_path: Path, name: str, config: dict) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_the_shipped_configs_are_read_by_their_recipes():
    assert {p.parent.name for p in CONFIGS} == {"nlp", "vision", "recsys"} and len(CONFIGS) >= 7
    for path in CONFIGS:
        assert reader(path)(path)["model"], path


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_section_refuses_a_misspelt_key(path, tmp_path):
    config = yaml.safe_load(path.read_text())
    for section, mapping in [("", config), *mappings(config)]:
        key = next(iter(mapping))
        wrong = key[:-1] if len(key) > 4 else key + "s"
        mapping[wrong] = mapping.pop(key)
        bad = write(tmp_path, path.name, config)
        with pytest.raises(ConfigError) as error:
            reader(path)(bad)
        message = str(error.value)
        if section:
            assert message.startswith(f"{bad}: unknown key {wrong!r} in {section}:; did you mean {key!r}? valid keys"
                                      " are: "), message
        else:
            assert message.startswith(f"{bad}: unknown section {wrong!r}; did you mean {key!r}? valid sections"
                                      " are: "), message
        assert "\n" not in message
        mapping[key] = mapping.pop(wrong)


@pytest.mark.parametrize("config, section, wrong, right", [
    ("nlp/dialogue_tiny.yaml", "train", "micro_bach_size", "micro_batch_size"),
    ("nlp/dialogue_tiny.yaml", "data", "seq_length", "seq_len"),
    ("nlp/dialogue_tiny.yaml", "", "trian", "train"),
    ("vision/vit_tiny.yaml", "", "trian", "train"),
    ("recsys/deepfm_tiny.yaml", "train", "batchsize", "batch_size"),
    ("recsys/deepfm_tiny.yaml", "daily", "auc_tolerence", "auc_tolerance"),
    ("recsys/deepfm_tiny.yaml", "", "dialy", "daily"),
    ("recsys/deepfm_tiny.yaml", "strategy", "sharding_type", "sharding_types"),
])
def test_misspellings_users_make(config, section, wrong, right, tmp_path):
    recipe = yaml.safe_load((ROOT / "configs" / config).read_text())
    target = recipe[section] if section else recipe
    target[wrong] = target.pop(right, 1)
    bad = write(tmp_path, "recipe.yaml", recipe)
    with pytest.raises(ConfigError) as error:
        reader(ROOT / "configs" / config)(bad)
    message = str(error.value)
    if section:
        assert message.startswith(f"{bad}: unknown key {wrong!r} in {section}:; did you mean {right!r}? valid keys"
                                  " are: "), message
        assert right in message.split("valid keys are: ")[1].split(", ")
    else:
        sections = sorted([k for k in recipe if k != wrong] + [right])
        assert message == f"{bad}: unknown section {wrong!r}; did you mean {right!r}? valid sections are: " + \
            ", ".join(sections)


def test_the_daily_job_exits_with_the_line(tmp_path):
    """The recipe turns the error into its one-line exit (status 1), before it starts any process."""
    import contextlib
    import io

    from disttrain.recsys.daily import main

    recipe = yaml.safe_load((ROOT / "configs" / "recsys" / "deepfm_tiny.yaml").read_text())
    recipe["daily"]["auc_tolerence"] = recipe["daily"].pop("auc_tolerance")
    bad = write(tmp_path, "recipe.yaml", recipe)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--data-root", str(tmp_path), "--model-root", str(tmp_path / "m"), "--config", str(bad)])
    assert code == 1
    assert err.getvalue() == (
        f"deepfm_daily.py: error: {bad}: unknown key 'auc_tolerence' in daily:; did you mean 'auc_tolerance'? valid"
        " keys are: auc_tolerance, eval_fraction, every, full_every, keep_versions, max_bad_fraction, min_auc,"
        " on_invalid_day, skip_missing_days, timeout, train_late_days, validation\n")


def test_checker_basics(tmp_path):
    schema = {"train": {"lr": None, "nested": {"depth": None}}, "model": None}
    check_keys({"train": {"lr": 1, "nested": {"depth": 2}}, "model": {"anything": 1}}, schema, "x.yaml")
    with pytest.raises(ConfigError, match=r"^x.yaml: unknown key 'deph' in train.nested:; did you mean 'depth'\?"):
        check_keys({"train": {"nested": {"deph": 2}}}, schema, "x.yaml")
    with pytest.raises(ConfigError, match=r"^x.yaml: train: must be a mapping of keys to values, not int 3$"):
        check_keys({"train": 3}, schema, "x.yaml")
    assert did_you_mean("zzz", ["lr"]) == ""
    assert list(keys_of(lambda a, b=1, *args, device=None, **kw: None, exclude=["device"])) == ["a", "b"]
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  a: [1, 2\ntrain: {}\n")
    with pytest.raises(ConfigError, match=rf"^{broken}: not valid YAML at line \d+, column \d+"):
        read_config(broken, schema)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match=rf"^{empty}: has no model: section; start from x$"):
        read_config(empty, schema, example="x")
