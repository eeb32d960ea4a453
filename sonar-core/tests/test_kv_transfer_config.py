"""``kv_transfer_config`` / ``kv_offload_bytes``: what is accepted and how the rest is refused."""

from __future__ import annotations

import pytest

from sonar.cli.main import build_parser, parse_args
from sonar.config import EngineArgs
from sonar.kv_transfer import KVTransferConfig
from sonar.kv_transfer.factory import resolve_kv_transfer_config


def test_vllms_dictionary_resolves() -> None:
    config = resolve_kv_transfer_config({"kv_connector": "SonarConnector", "kv_role": "kv_producer", "kv_port": 0})
    assert config == KVTransferConfig("SonarConnector", "kv_producer")
    assert config.is_producer and not config.is_consumer
    offload = resolve_kv_transfer_config(None, kv_offload_bytes=1 << 20)
    assert offload.kv_connector == "OffloadingConnector" and offload.kv_connector_extra_config == {"kv_offload_bytes": 1 << 20}
    assert resolve_kv_transfer_config(None) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"kv_connector": "Nope"}, "connector 'Nope' is not registered; registered: .*SonarConnector"),
        ({"kv_role": "kv_producer"}, 'needs a "kv_connector"'),
        ({"kv_connector": "SonarConnector", "kv_role": "decoder"}, "kv_role must be kv_producer, kv_consumer or kv_both"),
        ({"kv_connector": "SonarConnector", "kv_rol": "kv_producer"}, "unknown key\\(s\\) 'kv_rol'"),
        ({"kv_connector": "SonarConnector", "kv_port": 70000}, "must be a port number"),
        ({"kv_connector": "SonarConnector", "kv_connector_extra_config": {"kv_transfer_timeout": -1}}, "positive number of seconds"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_a_bad_config_is_refused_with_its_reason(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_kv_transfer_config(value)


def test_nixl_connector_config_is_checked_where_nixl_is_installed_and_refused_where_not() -> None:
    from sonar.kv_transfer.nixl_connector import nixl_module_name

    if nixl_module_name() is None:
        with pytest.raises(ValueError, match="'NixlConnector' needs the nixl package, which is not installed here"):
            resolve_kv_transfer_config({"kv_connector": "NixlConnector"})
        return
    extra = {"backends": ["UCX"], "progress_thread": False, "kv_transfer_timeout": 5}
    config = resolve_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": extra})
    assert config.kv_connector == "NixlConnector" and config.is_consumer
    refused = [
        ({"backends": "UCX"}, "must be a list of NIXL backend names"),
        ({"backends": []}, "must be a list of NIXL backend names"),
        ({"progress_thread": "yes"}, "must be true or false"),
        ({"kv_transfer_timeout": 0}, "positive number of seconds"),
        ({"kv_transport": "tcp"}, "unknown key\\(s\\) 'kv_transport' for NixlConnector; known: backends"),
    ]
    for bad, message in refused:
        with pytest.raises(ValueError, match=message):
            resolve_kv_transfer_config({"kv_connector": "NixlConnector", "kv_connector_extra_config": bad})


def test_offload_and_a_connector_together_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot be combined yet"):
        resolve_kv_transfer_config({"kv_connector": "SonarConnector"}, kv_offload_bytes=1 << 20)


def test_the_flags_parse(capsys) -> None:
    parser = build_parser()
    args = parse_args(parser, ["generate", "--prompt", "hi", "--kv-transfer-config", '{"kv_connector": "SonarConnector"}', "--kv-offload-bytes", "2MiB"])
    assert args.kv_transfer_config == {"kv_connector": "SonarConnector"} and args.kv_offload_bytes == 2 * 1024 * 1024
    with pytest.raises(SystemExit):
        parse_args(parser, ["generate", "--prompt", "hi", "--kv-transfer-config", "{bad"])
    assert "--kv-transfer-config: not valid JSON" in capsys.readouterr().err


def test_the_transfer_timeout_flag_feeds_the_connector_config(capsys) -> None:
    parser = build_parser()
    args = parse_args(parser, ["generate", "--prompt", "hi", "--kv-transfer-config", '{"kv_connector": "SonarConnector"}', "--kv-transfer-timeout", "2.5"])
    assert args.kv_transfer_timeout == 2.5
    config = resolve_kv_transfer_config(args.kv_transfer_config, 0, args.kv_transfer_timeout)
    assert config.kv_connector_extra_config == {"kv_transfer_timeout": 2.5}
    # the extra config's key still works, alone or agreeing with the flag
    extra = {"kv_connector": "SonarConnector", "kv_connector_extra_config": {"kv_transfer_timeout": 4}}
    assert resolve_kv_transfer_config(extra).kv_connector_extra_config == {"kv_transfer_timeout": 4}
    assert resolve_kv_transfer_config(extra, 0, 4.0).kv_connector_extra_config == {"kv_transfer_timeout": 4.0}
    with pytest.raises(ValueError, match="disagree"):
        resolve_kv_transfer_config(extra, 0, 2.0)
    with pytest.raises(ValueError, match="give --kv-transfer-config too"):
        resolve_kv_transfer_config(None, 0, 2.0)
    with pytest.raises(ValueError, match="positive number of seconds"):
        EngineArgs(kv_transfer_timeout=0)
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            parse_args(parser, ["generate", "--prompt", "hi", "--kv-transfer-timeout", bad])
    assert "--kv-transfer-timeout" in capsys.readouterr().err
