"""docs/configuration.md is generated from zserve/config.py's Structs; it must be what the generator writes now."""

from pathlib import Path

import msgspec.inspect as mi
import pytest

from tools import config_reference
from zserve import config
from zserve.generator.options import GeneratorOptions

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
GENERATION = PAGE.with_name("generation.md")


def test_page_is_current() -> None:
    assert PAGE.read_text() == config_reference.render(), (
        f"docs/configuration.md is stale: regenerate it with `.venv/bin/{config_reference.COMMAND}`"
    )


def test_the_engine_options_table_is_current() -> None:
    """docs/generation.md's "Engine options" table is generated from GeneratorOptions, the one definition."""
    page = GENERATION.read_text()
    assert page == config_reference.engine_options(page), (
        f"docs/generation.md's engine options are stale: regenerate them with "
        f"`.venv/bin/{config_reference.ENGINE_COMMAND}`"
    )


@pytest.mark.parametrize(
    "struct",
    [GeneratorOptions, config.SupervisorConfig, config.BrokerConfig, config.FrontendsConfig, config.ModelConfig],
)
def test_every_key_is_described(struct: type) -> None:
    info = mi.type_info(struct)
    assert isinstance(info, mi.StructType)
    docs = config_reference.field_docs(struct)
    assert [f.name for f in info.fields] == list(docs), "every field needs a docstring under it"
    assert all(len(text) > 10 for text in docs.values())


def test_a_key_without_a_docstring_stops_the_generator() -> None:
    import msgspec

    class Undocumented(msgspec.Struct):
        """A table."""

        described: int = 1
        """Has one."""
        bare: int = 2

    with pytest.raises(config_reference.MissingDescription, match="bare"):
        config_reference.table(Undocumented, "[undocumented]")


def test_types_and_defaults_as_toml_spells_them() -> None:
    fields = {f.name: f for f in mi.type_info(config.ModelConfig).fields}
    assert config_reference.type_name(fields["max_batch_size"].type) == "integer >= 1"
    assert config_reference.type_name(fields["batch_timeout_s"].type) == "float > 0 (or unset)"
    assert config_reference.type_name(fields["devices"].type) == "array of strings"
    assert config_reference.default_text(fields["name"]) == "required"
    assert config_reference.default_text(fields["devices"]) == "`[]`"
    assert config_reference.default_text(fields["engines_per_device"]) == "unset"
    assert config_reference.default_text(fields["max_wait_ms"]) == "`5.0`"
