"""The generative handler contract: ``setup`` sets ``self.generator`` (``self.engine``, its name before
2026-12-06, is still read, with a FutureWarning), anything else is a clear error naming the attribute."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zserve.generator.generator import Generator, generator_of


def test_generator_of_reads_the_generator_and_the_older_engine_attribute():
    generator = object.__new__(Generator)  # the contract checks the type only
    assert generator_of(SimpleNamespace(generator=generator)) is generator
    with pytest.warns(FutureWarning, match=r"set self\.engine; the attribute is self\.generator"):
        assert generator_of(SimpleNamespace(engine=generator)) is generator
    for broken in (SimpleNamespace(), SimpleNamespace(generator="not one"), SimpleNamespace(engine="not one")):
        with pytest.raises(TypeError, match=r"self\.generator"):
            generator_of(broken)
