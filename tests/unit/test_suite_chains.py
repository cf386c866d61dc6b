"""The suite's chains (tests/conftest.py): every test named in REAL_ENGINES exists — a renamed one would silently
move to the control chain and run its real vLLM beside the engine chain's."""

from __future__ import annotations

import re

from tests.conftest import LAST_IN_CHAIN, REAL_ENGINES, REPO, chain_of


def test_every_real_engine_entry_names_a_test_that_exists():
    for entry in REAL_ENGINES:
        path, _, test = entry.partition("::")
        source = (REPO / path).read_text()
        if test:
            name = re.sub(r"\[.*\]$", "", test)
            assert re.search(rf"^def {name}\(", source, re.M), f"{entry}: no test {name} in {path}"
        assert chain_of(entry) == "engines"


def test_every_last_in_chain_entry_is_a_file_of_a_chain():
    for entry in LAST_IN_CHAIN:
        assert (REPO / entry).is_file() and chain_of(entry) is not None, entry


def test_the_chains():
    assert chain_of("tests/unit/test_state_store.py::test_x") is None
    assert chain_of("tests/engines/test_engine_contract.py::test_ready_within_90s[paced]") == "engines"
    assert chain_of("tests/engines/test_crash_matrix_moves.py::test_k[paced-retire-1DRAIN]") == "control"
    assert chain_of("tests/integration/test_cluster.py::test_x") == "control"
