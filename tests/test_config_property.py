"""Property-based tests of the config loader: any YAML text, any --set override either loads or raises one
UserError line (never another exception), and a loaded config survives a YAML round trip unchanged."""

from __future__ import annotations

import string

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mechdiag import config as C
from mechdiag.errors import UserError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEYS = [f"{s}.{k}" if s else k for s, model in [("", C.Config), ("lora", C.LoraConfig), ("task", C.TaskConfig),
                                               ("record", C.RecordConfig), ("model", C.ModelConfig)]
        for k in model.model_fields if k not in ("model", "task", "lora", "rewards", "record")]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(string.printable, max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) |
                      st.dictionaries(st.text(string.ascii_lowercase, min_size=1, max_size=6), inner, max_size=3),
                      max_leaves=6)
typo_keys = st.sampled_from(KEYS).flatmap(lambda k: st.sampled_from([k, k + "x", k[:-1], k.replace("_", "")]))


def _contract(fn):
    try:
        return fn()
    except UserError as e:
        msg = str(e)
        assert msg and "\n" not in msg.strip(), msg
        return None


@SETTINGS
@given(st.text(max_size=200))
def test_any_yaml_text_loads_or_gives_one_line(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text, encoding="utf-8")
    _contract(lambda: C.load(path))


@SETTINGS
@given(st.dictionaries(typo_keys, values, max_size=4))
def test_any_overrides_load_or_give_one_line(overrides):
    items = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
             for k, v in overrides.items()]
    cfg = _contract(lambda: C.load(None, items))
    if cfg is not None:  # loaded: what was set is what is held, and it round-trips through YAML
        again = C.from_dict(yaml.safe_load(C.to_yaml(cfg)))
        assert again == cfg


@SETTINGS
@given(st.sampled_from(KEYS))
def test_a_misspelt_key_names_the_right_one(key):
    section, _, name = key.rpartition(".")
    wrong = name[:-1] + ("q" if name[-1] != "q" else "z") + "x"
    data = {section: {wrong: 1}} if section else {wrong: 1}
    try:
        C.from_dict(data)
    except UserError as e:
        assert str(e).startswith("unknown config key"), str(e)
        assert ("did you mean" not in str(e)) or "?" in str(e)
    else:
        raise AssertionError(f"{wrong} was accepted")
