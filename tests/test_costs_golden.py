"""The cost model answers what it answered when the golden file was written
(``tests/costs_golden.py``): every coefficient, stage cost, peak moment, bound, simulated time
and refusal message of a few hundred random evaluations, compared exactly. Refactorings of
``solver.costs`` must keep them."""

from __future__ import annotations

import json

import pytest

from tests.costs_golden import answers, load_golden

GOLDEN = load_golden()


def _first_difference(expected, actual, path="$"):
    """Where two JSON-like values first differ (for the failure message)."""
    if type(expected) is not type(actual):
        return f"{path}: {expected!r} != {actual!r}"
    if isinstance(expected, dict):
        for key in sorted(set(expected) | set(actual)):
            if key not in expected or key not in actual:
                return f"{path}.{key}: only in {'expected' if key in expected else 'actual'}"
            found = _first_difference(expected[key], actual[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(expected, list):
        if len(expected) != len(actual):
            return f"{path}: {len(expected)} items != {len(actual)}"
        for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
            found = _first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if expected == actual else f"{path}: {expected!r} != {actual!r}"


def test_the_golden_file_covers_the_model():
    assert len(GOLDEN) >= 300
    refused = [record for record in GOLDEN if "error" in record["answers"]]
    assert 0 < len(refused) < len(GOLDEN) // 10


@pytest.mark.parametrize("start", range(0, len(GOLDEN), 50))
def test_the_cost_model_answers_as_the_golden_file_says(start):
    for number, record in enumerate(GOLDEN[start : start + 50], start=start):
        # through JSON, as stored: tuples become lists
        actual = json.loads(json.dumps(answers(record["input"]), sort_keys=True))
        difference = _first_difference(record["answers"], actual)
        assert difference is None, f"case {number}: {difference}"
