"""Every config group combination composes, resolves, and builds its optimizer."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from conftest import tiny_gpt2
from helpers_train import EXPERIMENTS, GROUPS, compose_config, compose_many
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from dpmuon.config.roster import group_yaml, optimizer_names, optimizer_roster, stored_settings
from dpmuon.config.schema import ConfigError, validate
from dpmuon.models import hidden_matrices
from dpmuon.optim import OptimizerInputs, build_optimizer
from dpmuon.train import CONFIG_DIR


def test_groups_offer_what_the_docs_promise():
    assert GROUPS["optimizer"] == ["adam", "dp_adam", "dp_muon", "dp_muonbc", "dp_sgd", "muon"]
    assert optimizer_names() == ("dp_sgd", "dp_adam", "dp_muon", "dp_muonbc", "adam", "muon")  # display order
    assert optimizer_names(private=True) == ("dp_sgd", "dp_adam", "dp_muon", "dp_muonbc")
    assert GROUPS["dataset"] == ["dart", "e2e", "hf_example"]
    assert {"tiny", "gpt2", "gpt2-medium", "distilgpt2"} <= set(GROUPS["model"])
    assert {"smoke", "e2e", "dart"} <= set(EXPERIMENTS[1:])


def combinations(experiment):
    """optimizer × dataset crossed in full; model, privacy, recipe and logger cycled so every option of theirs meets every experiment.
    The full 192-way product per experiment would cost minutes of Hydra composition."""
    cycled = [GROUPS["model"], GROUPS["privacy"], GROUPS["recipe"], GROUPS["logger"]]
    for i, (optimizer, dataset) in enumerate(itertools.product(GROUPS["optimizer"], GROUPS["dataset"])):
        overrides = [f"optimizer={optimizer}", f"dataset={dataset}"]
        overrides += [f"{g}={opts[(i // k) % len(opts)]}" for g, opts, k in zip(("model", "privacy", "recipe", "logger"), cycled, (1, 1, 3, 2))]
        yield overrides + ([f"experiment={experiment}"] if experiment else [])


def test_combinations_cover_every_option():
    for experiment in EXPERIMENTS:
        seen = {tuple(o.split("=")) for overrides in combinations(experiment) for o in overrides}
        assert all((g, c) in seen for g, options in GROUPS.items() for c in options)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_combination_composes_and_resolves(experiment):
    for _, cfg in compose_many(combinations(experiment)):
        resolved = OmegaConf.to_container(cfg, resolve=True)
        assert resolved["optimizer"]["_target_"] in {e.target for e in optimizer_roster()}
        assert resolved["privacy"]["delta"] == resolved["dataset"]["delta"]
        assert resolved["optimizer"]["lr"] > 0
        if experiment is None:  # (an experiment may set its own)
            assert resolved["optimizer"]["lr"] == resolved["recipe"]["lr"][resolved["optimizer"]["name"]]
            assert resolved["trainer"]["epochs"] == resolved["recipe"]["epochs"]


def test_experiments_set_the_paper_protocol():
    e2e = compose_config("experiment=e2e")
    assert (e2e.dataset.name, e2e.model.name_or_path, e2e.privacy.expected_lot_size) == ("e2e", "gpt2", 1024)
    assert (e2e.trainer.epochs, e2e.privacy.delta, e2e.privacy.clip_norm, e2e.privacy.target_epsilon) == (10, 8e-6, 0.1, 8.0)
    assert e2e.optimizer.lr == 2e-3  # DP-Adam's E2E rate from prior work
    dart = compose_config("experiment=dart")
    assert (dart.dataset.name, dart.trainer.epochs, dart.privacy.delta, dart.optimizer.lr) == ("dart", 15, 1e-5, 5e-4)
    # An experiment fixes only its deltas: the user's later choices still win.
    assert compose_config("experiment=e2e", "optimizer=dp_muonbc").optimizer.name == "dp_muonbc"


@pytest.mark.parametrize(
    "former, name",
    [("cpu_e2e", "pretrained_tiny_e2e"), ("cpu_dart", "pretrained_tiny_dart"), ("e2e_cpu", "scratch_tiny_e2e"), ("dart_cpu", "scratch_tiny_dart")],
)
def test_a_former_experiment_name_composes_its_renamed_config(former, name):
    """Committed runs record the former names: their commands must still run the same config."""
    old, new = (OmegaConf.to_container(compose_config(f"experiment={e}"), resolve=True) for e in (former, name))
    assert (old.pop("experiment_name"), new.pop("experiment_name")) == (former, name)
    assert old == new


@pytest.mark.parametrize("optimizer", GROUPS["optimizer"])
def test_each_optimizer_config_builds_its_optimizer(optimizer):
    cfg = compose_config(f"optimizer={optimizer}")
    model = tiny_gpt2()
    opt = build_optimizer(
        OmegaConf.to_container(cfg.optimizer, resolve=True),
        OptimizerInputs(params=dict(model.named_parameters()), hidden_matrices=hidden_matrices(model)),
    )
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert cfg.optimizer.private == optimizer.startswith("dp_")


def test_dp_muonbc_is_dp_muon_plus_correction():
    muon, bc = compose_config("optimizer=dp_muon").optimizer, compose_config("optimizer=dp_muonbc").optimizer
    differing = {k for k in set(muon) | set(bc) if muon.get(k) != bc.get(k)}
    assert differing == {"name", "_target_", "display", "bias_correction"}


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer._target_=dpmuon.optim.settings.Lion", "optimizer._target_=dpmuon.optim.settings.Lion: cannot import"),
        ("optimizer._target_=dpmuon.optim.OptimizerInputs", "not a settings class|not a dataclass"),
    ],
)
def test_a_target_that_is_no_settings_class_is_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(compose_config(override))
    assert "\n" not in str(err.value)


def test_an_option_without_a_default_must_be_set():
    """An optimizer the recipe has no rate for must be given one: the error names the key."""
    with pytest.raises(ConfigError, match="optimizer.lr=null: must be set"):
        validate(compose_config("optimizer=dp_muon", "optimizer.name=my_muon", "optimizer.adam.lr=0.001"))


def test_roster_is_read_by_makefile_sweeps_eval_and_scripts():
    """The one list: every consumer takes conf/optimizer/*.yaml's names, flags and colours."""
    from dpmuon.eval.curves import OPTIMIZER_COLORS
    from dpmuon.eval.grouping import _OPTIMIZER_ORDER

    assert {e.name for e in optimizer_roster()} == set(GROUPS["optimizer"])
    assert _OPTIMIZER_ORDER == optimizer_names()
    assert OPTIMIZER_COLORS == {e.name: e.color for e in optimizer_roster()}
    assert len(set(OPTIMIZER_COLORS.values())) == len(OPTIMIZER_COLORS)
    assert "$(shell $(PYTHON) -m dpmuon.config.roster --private)" in (Path(CONFIG_DIR).parent / "Makefile").read_text()
    for sweep in ("sweep_eps", "sweep_clip"):
        swept = OmegaConf.load(Path(CONFIG_DIR) / "experiment" / f"{sweep}.yaml").hydra.sweeper.params.optimizer
        [override] = OverridesParser.create().parse_overrides([f"optimizer={swept}"])  # as Hydra's sweeper does
        assert list(override.sweep_string_iterator()) == list(optimizer_names(private=True))
    # dpmuon.optim.build's names (the classes registered by name) are the private roster's, class for class
    from dpmuon.settings import registered

    built_in = {name: f"{cls.__module__}.{cls.__qualname__}" for name, cls in registered("optimizer").items() if cls.__module__.startswith("dpmuon.")}
    assert built_in == {e.name: e.target for e in optimizer_roster() if e.private}


@pytest.mark.parametrize("optimizer", GROUPS["optimizer"])
def test_the_built_optimizer_holds_the_configured_values(optimizer):
    """What the param groups hold is the composed section's value, a changed default included."""
    changed = "optimizer.momentum=0.5" if optimizer == "dp_sgd" else "optimizer.weight_decay=0.01"
    section = OmegaConf.to_container(compose_config(f"optimizer={optimizer}", changed).optimizer, resolve=True)
    model = tiny_gpt2()
    opt = build_optimizer(section, OptimizerInputs(params=dict(model.named_parameters()), hidden_matrices=hidden_matrices(model)))
    for group in opt.param_groups:
        settings = section["adam"] if group.get("part") == "adam" else section
        for key in ("lr", "momentum", "nesterov", "weight_decay", "eps", "ns_steps", "update_scale"):
            if key in group:
                assert group[key] == settings[key], (optimizer, key)
        if "betas" in group:
            assert list(group["betas"]) == settings["betas"]
        if group.get("bias_correction"):
            assert group["probe_scale"] == section["bias_correction"]["probe_scale"]


def values_set_by_files(optimizer: str) -> dict:
    """Dotted key → value that conf/optimizer/<optimizer>.yaml and the files it extends set themselves."""
    own = OmegaConf.load(Path(CONFIG_DIR) / "optimizer" / f"{optimizer}.yaml")
    files = [entry for entry in own.pop("defaults", []) if entry != "_self_" and not entry.startswith("/")]  # not a class's options
    merged = OmegaConf.to_container(OmegaConf.merge(*(OmegaConf.create(values_set_by_files(f)) for f in files), own))
    return flattened(merged)


def flattened(section: dict) -> dict:
    """Dotted key → value, one level of nesting deep (as optimizer sections have)."""
    out = {}
    for key, value in section.items():
        out.update({f"{key}.{inner}": v for inner, v in value.items()} if isinstance(value, dict) else {key: value})
    return out


def test_the_rosters_light_reader_reads_each_optimizer_yaml_as_hydra_composes_it():
    """The roster reads conf/optimizer/ without Hydra's global state (the driver holds it while a
    run imports the roster's readers), so it merges the defaults lists itself: as Hydra does."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        for name in GROUPS["optimizer"]:
            composed = OmegaConf.to_container(compose(config_name=f"optimizer/{name}").optimizer)
            assert OmegaConf.to_container(group_yaml("optimizer", name)) == composed, name


@pytest.mark.parametrize("optimizer", GROUPS["optimizer"])
def test_an_optimizer_yaml_repeats_none_of_its_class_defaults(optimizer):
    """Options are declared once, in the settings class: a YAML sets only what differs from it."""
    target = group_yaml("optimizer", optimizer)["_target_"]
    defaults = OmegaConf.to_container(stored_settings(f"/settings/optimizer/{target.rsplit('.', 1)[-1]}"))
    defaults = flattened(defaults)
    assert {key for key, value in values_set_by_files(optimizer).items() if defaults.get(key, object()) == value} == set()
