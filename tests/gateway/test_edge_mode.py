"""The mode ``edge.dtype: auto`` picks, reported where an operator looks: ``edgegw
check-config``, ``/readyz``, ``/v1/models`` (and the start-up log: edge_engine's tests);
and ``edgegw build-kernels`` on a machine without a compiler."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from tests.conftest import ROOT


def edgegw(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )


def test_check_config_says_which_mode_auto_picks_and_why(built_kernels, tmp_path):
    config = str(ROOT / "configs" / "default.yaml")
    built = edgegw("check-config", config, env={**os.environ, "TORCH_EXTENSIONS_DIR": os.path.dirname(built_kernels)})
    assert built.returncode == 0, built.stderr
    assert "edge.dtype: auto -> int4 (auto: int4 on the CPU (kernels: " in built.stdout, built.stdout
    # an installation whose kernels were never built runs float32, and says what to run
    bare = edgegw("check-config", config, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert bare.returncode == 0, bare.stderr
    assert "edge.dtype: auto -> float32" in bare.stdout and "run `edgegw build-kernels`" in bare.stdout, bare.stdout
    # a mode that cannot run here is a warning (the file may be for another machine: a GPU
    # node, an image), and an error with --on-this-machine
    path = tmp_path / "int4.yaml"
    path.write_text("edge:\n  enabled: true\n  dtype: int4\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    warned = edgegw("check-config", str(path), env=env)
    assert warned.returncode == 0 and "warning: edge.dtype: dtype: int4 needs the edge engine's kernels" in warned.stderr, warned.stderr
    refused = edgegw("check-config", "--on-this-machine", str(path), env=env)
    assert refused.returncode == 1 and "error: edge.dtype: dtype: int4 needs the edge engine's kernels" in refused.stderr


def test_build_kernels_without_a_compiler_says_what_to_install(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env.update(PATH=str(tmp_path / "bin"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))  # no c++ on this PATH
    result = edgegw("build-kernels", env=env)
    assert result.returncode == 1
    assert "no C++ compiler" in result.stderr and "apt install g++" in result.stderr, result.stderr
    assert not any((tmp_path / "ext").glob("*/*.so"))


def test_readyz_and_models_report_the_edge_engines_mode(built_kernels, gateways, tiny_model):
    edge = {"enabled": True, "model": tiny_model, "name": "tiny", "num_kv_blocks": 64, "block_size": 4}  # dtype: auto
    gw = gateways({"edge": edge})
    ready = httpx.get(gw.url + "/readyz")
    assert ready.status_code == 200
    mode = ready.json()["edge"]
    assert mode["dtype"] == "int4" and mode["dtype_reason"].startswith("auto: int4 on the CPU (kernels: "), mode
    models = httpx.get(gw.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["auto", "tiny"]  # the alias first, then the edge model
    assert models[1]["metadata"] == mode and "metadata" not in models[0]
