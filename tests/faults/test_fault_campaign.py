"""CI runs the fault campaign (tests/faults/fault_campaign.py): every fault of tests/FAULTS.md injected
into a scratch experiments folder; rows lost 0, duplicates 0, hangs 0, tracebacks 0, each claim held."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the campaign's child processes import it by name too
import fault_campaign as campaign  # noqa: E402


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    found = {o.fault: o for o in campaign.run_all(tmp_path_factory.mktemp("campaign"))}
    print("\n" + campaign.table(list(found.values())))
    return found


@pytest.mark.parametrize("fault", [f for f, _ in campaign.CASES])
def test_fault_is_handled(outcomes, fault):
    o = outcomes[fault]
    assert o.passed, o.problem
    assert (o.rows_lost, o.duplicates, o.hang, o.tracebacks) == (0, 0, False, 0), o


def test_campaign_totals(outcomes):
    table = campaign.table(list(outcomes.values()))
    assert "rows lost 0, duplicates 0, hangs 0, tracebacks 0" in table, table
