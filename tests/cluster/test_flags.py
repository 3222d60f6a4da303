"""The command-line flags against the config fields (cluster/flags.py): every flag sets a real
field with that field's default, type and choices; every field is a flag or listed as YAML-only."""

from __future__ import annotations

import typing

import pytest

from tandem.cluster import flags as F
from tandem.cluster.cli import build_parser
from tandem.cluster.config import serve_config_from_args
from tandem.core.config import EngineConfig, ServeConfig

SERVE_PATHS = {f.path for f in F.SERVE_FLAGS} | {f"engine_config.{f.path}" for f in F.ENGINE_FLAGS}


def test_every_field_is_a_flag_or_yaml_only():
    covered = [p for p in F.serve_field_paths()
               if p in SERVE_PATHS or any(p == y or p.startswith(y + ".") for y in F.YAML_ONLY)]
    assert set(covered) == F.serve_field_paths(), sorted(F.serve_field_paths() - set(covered))
    assert not SERVE_PATHS & F.YAML_ONLY
    for y in F.YAML_ONLY:
        F.field_info(ServeConfig, y)        # raises on a stale entry


@pytest.mark.parametrize("flag", F.SERVE_FLAGS + F.ENGINE_FLAGS, ids=lambda f: f.name)
def test_flag_follows_its_field(flag):
    model = ServeConfig if flag in F.SERVE_FLAGS else EngineConfig
    info = F.field_info(model, flag.path)
    kw = F.argparse_kwargs(model, flag)
    assert kw["default"] is None                      # not given -> the YAML's or the field's value
    kind = F._base_type(info.annotation)
    if typing.get_origin(kind) is typing.Literal:
        assert kw["choices"] == list(typing.get_args(kind))
    if info.default is not None and kind is not bool:
        shown = f"{info.default:g}" if isinstance(info.default, float) else str(info.default)
        assert f"default {shown}" in kw["help"] or "default" in (flag.help or "")


def test_unknown_flag_path_is_refused():
    with pytest.raises(KeyError, match="no field 'page_sise'"):
        F.argparse_kwargs(EngineConfig, F.Flag("--x", "cache.page_sise"))


def test_no_flags_is_the_defaults_and_flags_land_on_their_fields(tmp_path):
    p = build_parser()
    assert serve_config_from_args(p.parse_args(["serve"])) == ServeConfig()
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("prefill: 3\nadmission_max_queue: 5\nengine_config:\n  cache:\n    page_size: 8\n"
                    "  transfer:\n    progress_thread: true\n  hybrid:\n    state_slots: 10\n")
    args = p.parse_args(["serve", "--config", str(yaml), "--decode", "2", "--page-size", "16",
                         "--transfer-timeout", "5", "--disable-prefix-cache", "--threads", "3",
                         "--policy", "least_load", "--eviction-policy", "lfu"])
    cfg = serve_config_from_args(args)
    assert (cfg.prefill, cfg.decode, cfg.admission_max_queue, cfg.transfer_timeout_s, cfg.policy) == \
        (3, 2, 5, 5.0, "least_load")
    ec = cfg.engine_config
    assert (ec.cache.page_size, ec.cache.disable_prefix_cache, ec.num_threads, ec.cache.eviction_policy) == \
        (16, True, 3, "lfu")
    assert ec.transfer.progress_thread and ec.hybrid.state_slots == 10
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--policy", "fastest"])
    with pytest.raises(ValueError):                   # pydantic's bounds apply to flags too
        serve_config_from_args(p.parse_args(["serve", "--page-size", "0"]))


def test_a_bare_serve_on_few_cores_without_a_gpu_is_colocated(tmp_path):
    from tandem.cluster.config import AUTO_COLOCATED_MAX_CORES, choose_mode

    p = build_parser()

    def mode(argv, cores=2, cuda=False):
        args = p.parse_args(["serve", *argv])
        cfg, why = choose_mode(serve_config_from_args(args), args, cores=cores, cuda=cuda)
        assert why is None or (cfg.mode == "colocated" and "chosen for this machine" in why)
        return cfg.mode

    assert mode([]) == "colocated"
    assert mode(["--port", "8311", "--threads", "2"]) == "colocated"    # flags beside the shape
    assert mode([], cores=AUTO_COLOCATED_MAX_CORES) == "colocated"
    assert mode([], cores=AUTO_COLOCATED_MAX_CORES + 1) == "disaggregated"
    assert mode([], cuda=True) == "disaggregated"
    for given in (["--mode", "disaggregated"], ["--prefill", "1"], ["--decode", "2"], ["--engine", "sim"],
                  ["--device", "cuda"]):
        assert mode(given) == "disaggregated", given       # what the user wrote is taken as written
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("port: 8400\n")
    assert mode(["--config", str(yaml)]) == "disaggregated"
    assert mode(["--mode", "colocated"], cores=64) == "colocated"
