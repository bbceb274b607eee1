"""The compile caches a run gets (``launch/compile_cache.py``): under the outputs directory, per machine and
library versions, with Triton's autotuning kept; the user's own settings win."""

from __future__ import annotations

from moe_vlm_sweep.launch.compile_cache import cache_env, cache_key


def test_caches_live_under_the_outputs_directory_per_machine_and_versions(tmp_path):
    env = cache_env(tmp_path, "h100", {})
    root = tmp_path.resolve() / "compile_cache" / cache_key("h100")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(root / "triton")
    assert env["TRITON_CACHE_AUTOTUNING"] == "1"
    assert "h100" in cache_key("h100") and "torch" in cache_key("h100") and cache_key("h100") != cache_key("h200")


def test_the_users_own_settings_win(tmp_path):
    mine = {"TRITON_CACHE_DIR": "/scratch/triton", "TRITON_CACHE_AUTOTUNING": "0"}
    env = cache_env(tmp_path, "h100", mine)
    assert env["TRITON_CACHE_DIR"] == "/scratch/triton" and env["TRITON_CACHE_AUTOTUNING"] == "0"
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path.resolve()))
