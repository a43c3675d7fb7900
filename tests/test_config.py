import pytest

from mechdiag import config
from mechdiag.errors import UserError


def test_defaults_roundtrip_yaml(tmp_path):
    cfg = config.load()
    path = tmp_path / "c.yaml"
    config.save(cfg, path, header="made by a test\nsecond line")
    text = path.read_text()
    assert text.startswith("# made by a test\n# second line\n")
    again = config.load(path)
    assert again == cfg


def test_overrides_parse_yaml_values():
    cfg = config.load(overrides=["beta=0.01", "lora.layers=first2+last2", "lora.target_modules=[v_proj,o_proj]",
                                 "rewards.weights={correctness: 3.0}"])
    assert cfg.beta == 0.01
    assert cfg.lora.layers == "first2+last2"
    assert cfg.lora.target_modules == ["v_proj", "o_proj"]
    assert cfg.rewards.weights == {"correctness": 3.0}


def test_unknown_key_did_you_mean():
    with pytest.raises(UserError, match=r"unknown config key lora\.rank \(did you mean lora\.r\?\)"):
        config.load(overrides=["lora.rank=8"])
    with pytest.raises(UserError, match=r"did you mean group_size"):
        config.load(overrides=["group_sise=4"])


def test_bad_value_names_field():
    with pytest.raises(UserError, match=r"invalid config value for temperature"):
        config.load(overrides=["temperature=-1"])
    with pytest.raises(UserError, match=r"lora\.layers"):
        config.load(overrides=["lora.layers=middle"])


def test_presets_follow_table7():
    math = config.from_dict({"preset": "math"})
    assert (math.learning_rate, math.beta, math.lora.r, math.lora.alpha, math.epochs) == (1e-5, 0.005, 16, 64, 2)
    code = config.from_dict({"preset": "code", "beta": 0.02})
    assert code.lora.target_modules == config.ATTN_MODULES and code.grad_accum == 64 and code.beta == 0.02
    assert config.from_dict({"preset": "mcq"}).beta == 0.003
    from mechdiag.tasks import reward_weights

    assert reward_weights(code)["correctness"] == 1.0 and reward_weights(code)["complexity"] == 1.0
    with pytest.raises(UserError, match="did you mean math"):
        config.from_dict({"preset": "maths"})


@pytest.mark.parametrize("spec,n,want", [
    ("all", 6, [0, 1, 2, 3, 4, 5]),
    ("first2+last2", 6, [0, 1, 4, 5]),
    ("first2+last2", 3, [0, 1, 2]),
    ("0-2,5", 6, [0, 1, 2, 5]),
    ("last1", 6, [5]),
    ([0, -1], 6, [0, 5]),
])
def test_parse_layers(spec, n, want):
    assert config.parse_layers(spec, n) == want


def test_parse_layers_out_of_range():
    with pytest.raises(UserError, match="out of range"):
        config.parse_layers("0-9", 4)


def test_invalid_yaml_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("beta: [1, 2\n")
    with pytest.raises(UserError, match="invalid YAML"):
        config.load(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="mapping"):
        config.load(p)


@pytest.mark.parametrize("task,domain", [("arith", "math"), ("gsm8k", "math"), ("mbpp", "code"),
                                         ("humaneval", "code"), ("arc", "mcq"), ("openbookqa", "mcq")])
def test_each_task_carries_its_study_reward_weights(task, domain, tmp_path):
    """Table 6 per domain without a preset: MBPP keeps its complexity guard and syntax, ARC its valid_option."""
    from mechdiag.tasks import resolve_rewards
    from mechdiag.tasks.rewards import REWARD_WEIGHTS

    cfg = resolve_rewards(config.load(overrides=[f"task.name={task}"]))
    assert cfg.rewards.weights == REWARD_WEIGHTS[domain]
    config.save(cfg, tmp_path / "c.yaml")  # the resolved config shows what runs
    assert config.read_yaml(tmp_path / "c.yaml")["rewards"]["weights"] == REWARD_WEIGHTS[domain]


def test_task_weights_beat_the_preset_and_user_weights_beat_both():
    from mechdiag.tasks import reward_weights

    def weights(*overrides):
        return reward_weights(config.load(overrides=list(overrides)))

    assert weights("task.name=mbpp")["complexity"] == 1.0
    assert weights("task.name=arc")["valid_option"] == 0.5
    assert "valid_option" in weights("preset=math", "task.name=arc")
    own = weights("task.name=mbpp", "rewards.weights={correctness: 2.0, complexity: 1.0}")
    assert own == {"correctness": 2.0, "complexity": 1.0}
    mixed = weights("task.mixture=[{name: arc}]")  # arith + ARC: ARC's valid_option comes along
    assert mixed["valid_option"] == 0.5 and mixed["numeric"] == 0.5


def test_unknown_reward_component_is_bad_input(cli):
    from mechdiag.tasks import resolve_rewards
    from tests.helpers import assert_bad_input

    cfg = config.load(overrides=["task.name=mbpp", "rewards.weights={correctnes: 2.0}"])
    with pytest.raises(UserError, match=r"unknown reward component 'correctnes'.*did you mean correctness\?"):
        resolve_rewards(cfg)
    with pytest.raises(UserError, match=r"'numeric'.*task arc"):  # a math component on an MCQ task
        resolve_rewards(config.load(overrides=["task.name=arc", "rewards.weights={numeric: 1}"]))
    proc = cli("train", "--dry-run", "--set", "task.name=mbpp", "--set", "rewards.weights={correctnes: 2.0}")
    assert_bad_input(proc)
    assert "did you mean correctness?" in proc.stderr
    proc = cli("train", "--dry-run", "--set", "task.name=mbpp")
    assert proc.returncode == 0, proc.stderr
    assert "complexity: 1.0" in proc.stdout and "syntax: 0.5" in proc.stdout and "numeric" not in proc.stdout


def test_run_directories_of_earlier_versions_still_load():
    """config.yaml of runs written before `sampler` replaced `merged_sampler` reads as the same choice."""
    assert config.from_dict({"merged_sampler": True}).sampler == "merged"
    assert config.from_dict({"merged_sampler": False}).sampler == "adapter"
    assert config.from_dict({}).sampler == "auto"
