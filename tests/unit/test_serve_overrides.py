"""``zserve.serve(..., server=...)``: the retired ``[frontends] server`` key, as the TOML path treats it."""

from __future__ import annotations

import pytest

from zserve.config import ConfigError
from zserve.entrypoints import _config_for

ECHO = "zserve.models.echo:Echo"


def test_server_gunicorn_is_ignored_with_a_future_warning_naming_server() -> None:
    with pytest.warns(FutureWarning, match=r"server is deprecated and ignored"):
        config = _config_for(ECHO, {"server": "gunicorn", "workers": 3})
    assert config.frontends.workers == 3 and not hasattr(config.frontends, "server")


def test_any_other_server_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"server = 'granian'"):
        _config_for(ECHO, {"server": "granian"})


def test_unknown_overrides_are_still_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"unknown overrides \['colour'\]"):
        _config_for(ECHO, {"colour": "red"})
