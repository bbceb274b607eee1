"""A search keeps the recipe unless the space opts in; a study of several recipes ranks each apart."""

from __future__ import annotations

import optuna
import pytest
import yaml
from sweep_testing import cli, private_conf, tiny_space

from moe_vlm_sweep.config.compose import CONF_DIR
from moe_vlm_sweep.config.recipe import TOKEN_DROPPING
from moe_vlm_sweep.config.schema import CudaGraphConf
from moe_vlm_sweep.export.best import export, ranked
from moe_vlm_sweep.export.recipes import RecipeError, chosen, note
from moe_vlm_sweep.sweep.recipe import check_recipe, needs_drop_and_pad, recipe_changes
from moe_vlm_sweep.sweep.space import Space
from moe_vlm_sweep.sweep.spec import SweepSpecError

VISION_SPACE = tiny_space(2, "params:\n  batch.mbs: [1, 2]\n  vision: [trainable, frozen]\n")


@pytest.mark.parametrize(
    "params,varied",
    [
        (
            {"vision": ["trainable", "frozen"]},
            {"vision": ["vision.freeze_encoder", "vision.freeze_projector", "vision.name"]},
        ),
        ({"vision": ["trainable"]}, {}),  # one choice: every trial trains the same model
        (
            {
                "batch.mbs": [1, 2],
                "parallel": ["fsdp", "3d"],
                "dispatcher": ["alltoall", "allgather"],
                "cuda_graph": ["none", "attn"],
                "data.packing": [True, False],
            },
            {},
        ),
        ({"batch.gbs": [4, 8]}, {"batch.gbs": ["batch.gbs"]}),
        ({"train.lr": {"type": "float", "low": 1e-4, "high": 1e-3}}, {"train.lr": ["train.lr"]}),
        ({"dispatcher.capacity_factor": [None, 1.0]}, {"dispatcher.capacity_factor": [TOKEN_DROPPING]}),
        # layer_te graphs the experts, which needs drop-and-pad: token dropping, though no dispatcher field is searched
        ({"cuda_graph": ["none", "layer_te"]}, {"cuda_graph": [TOKEN_DROPPING]}),
        ({"cuda_graph.modules": [["attn"], ["attn", "moe"]]}, {"cuda_graph.modules": [TOKEN_DROPPING]}),
    ],
)
def test_what_a_param_varies(params, varied):
    assert recipe_changes(Space.parse(params), CONF_DIR) == varied


def test_graph_scopes_that_capture_experts_need_drop_and_pad():
    assert needs_drop_and_pad(CudaGraphConf(scope="layer_te", impl="transformer_engine"))
    assert needs_drop_and_pad(CudaGraphConf(scope="layer_local", impl="local"))
    assert not needs_drop_and_pad(CudaGraphConf(scope="attn", impl="transformer_engine", modules=["attn"]))


@pytest.mark.parametrize("allowed", [["vision"], ["vision.freeze_encoder", "vision.freeze_projector", "vision.name"]])
def test_the_opt_in_names_the_param_or_its_fields(allowed):
    space = Space.parse({"vision": ["trainable", "frozen"], "batch.gbs": [4, 8]})
    with pytest.raises(
        SweepSpecError,
        match=r"sweep.params.batch.gbs varies batch.gbs: .*allow_recipe_changes: "
        r"\[batch.gbs\]",
    ):
        check_recipe(space, allowed, CONF_DIR)
    assert set(check_recipe(space, [*allowed, "batch"], CONF_DIR)) == {"vision", "batch.gbs"}


def test_a_space_varying_vision_without_the_opt_in_exits_2_naming_vision(tmp_path):
    conf = private_conf(tmp_path, {"vis": VISION_SPACE})
    proc = cli(["run", "-m", "sweep=vis"], cwd=tmp_path, conf=conf, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: sweep.params.vision varies vision.freeze_encoder" in proc.stderr
    assert "sweep.allow_recipe_changes=[vision]" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs" / "sweeps").exists()  # refused before the study was touched


def _mixed_study(storage=None) -> optuna.Study:
    """Trial #0 (the baseline) trains vision; #1 and #3 freeze it and are faster; #2 is the baseline's recipe."""
    study = optuna.create_study(study_name="mixed", storage=storage, direction="maximize")
    study.set_user_attr("objective_metrics", ["effective_tokens_per_s_per_gpu"])
    frozen = {"vision.name": "frozen", "vision.freeze_encoder": True, "vision.freeze_projector": True}
    for value, recipe, differs, vision in (
        (1.0, "aaaa1111", {}, "trainable"),
        (5.0, "bbbb2222", frozen, "frozen"),
        (2.0, "aaaa1111", {}, "trainable"),
        (4.0, "bbbb2222", frozen, "frozen"),
    ):
        study.add_trial(
            optuna.trial.create_trial(
                value=value,
                user_attrs={
                    "overrides": ["model=tiny", f"vision={vision}"],
                    "data_realism": "synthetic_images",
                    "recipe": recipe,
                    "recipe_differs": differs,
                },
            )
        )
    return study


def test_ranking_stays_within_the_baselines_recipe_unless_another_is_named():
    study = _mixed_study()
    assert [t.number for t in ranked(study)] == [2, 0]
    assert [t.number for t in ranked(study, "bbbb2222")] == [1, 3]
    with pytest.raises(RecipeError, match="--recipe cccc is not a recipe of study mixed"):
        chosen(study, "cccc")
    text = note(study, chosen(study))
    assert "the study holds 2 recipes" in text and "ranked: aaaa1111 (the baseline's" in text
    assert "recipe bbbb2222: 2 completed trial(s), best trial #1 (5)" in text
    assert "vision.freeze_encoder=True" in text and "vision.name=frozen" in text


def test_best_exports_the_baselines_recipe_and_lists_the_other(tmp_path):
    conf = private_conf(tmp_path)
    sweep_dir = tmp_path / "outputs" / "sweeps" / "mixed"
    sweep_dir.mkdir(parents=True)
    _mixed_study(f"sqlite:///{sweep_dir / 'optuna.db'}")
    out = cli(["best", "mixed"], cwd=tmp_path, conf=conf).stdout
    assert "best: trial #2" in out and "recipe bbbb2222: 2 completed trial(s), best trial #1" in out, out
    top = yaml.safe_load((sweep_dir / "best" / "top.yaml").read_text())
    assert [(e["trial"], e["recipe"]) for e in top] == [(2, "aaaa1111"), (0, "aaaa1111")]
    out = cli(["best", "mixed", "--recipe", "bbbb2222"], cwd=tmp_path, conf=conf).stdout
    assert "best: trial #1" in out and "named with --recipe" in out and "recipe aaaa1111" in out
    proc = cli(["best", "mixed", "--recipe", "nope"], cwd=tmp_path, conf=conf, check=False)
    assert proc.returncode == 2 and "--recipe nope is not a recipe" in proc.stderr


def test_export_of_one_recipe(tmp_path):
    exported = export(_mixed_study(), sweep_dir=tmp_path / "s", conf_dir=tmp_path, top_k=3)
    assert [e.trial.number for e in exported] == [2, 0]


@pytest.mark.slow
def test_with_the_opt_in_the_sweep_runs_and_best_ranks_each_recipe_apart(tmp_path):
    space = VISION_SPACE + (
        "allow_recipe_changes: [vision]\nfirst_trials:\n  - {batch.mbs: 1, vision: trainable}\n"
        "  - {batch.mbs: 1, vision: frozen}\n"
    )
    conf = private_conf(tmp_path, {"vis": space})
    out = cli(["run", "-m", "sweep=vis", "sweep.verify=false"], cwd=tmp_path, conf=conf).stdout
    assert "sweep.params.vision may change the recipe" in out
    assert "the study holds 2 recipes" in out, out[-3000:]
    out = cli(["best"], cwd=tmp_path, conf=conf).stdout
    assert "best: trial #0" in out and "ranked: " in out and "1 completed trial(s), best trial #1" in out, out
    assert "vision.freeze_encoder=True" in out


def test_the_opt_in_is_a_command_line_override_too():
    from moe_vlm_sweep.config.compose import compose_config
    from moe_vlm_sweep.sweep.spec import load_spec

    spec = load_spec(compose_config(["sweep=cluster_3d", "sweep.allow_recipe_changes=[vision,batch.gbs]"]).sweep)
    assert spec.allow_recipe_changes == ["vision", "batch.gbs"]
    assert load_spec(compose_config(["sweep=h200_small_s1664"]).sweep).allow_recipe_changes == ["vision"]
