"""The engines' rules (``solver.engine_rules``) where the search meets them: pinned flags checked
before any search (one line naming the rule, the engines and the values that would do), the
candidates a rule removes counted for the infeasibility message, and the plan's note when the
graph lacks the facts a rule needs."""

from __future__ import annotations

from collections import Counter
from itertools import combinations
from typing import Any

from solver.engine_rules import (
    ModelFacts,
    Refusal,
    degrees_of,
    runtime_refusal,
    skipped_facts,
)
from solver.errors import InputError
from solver.parallel import uses_sequence_parallel
from solver.specs import TrainingConfig

PINNABLE = ("zero", "tp", "ep", "cp", "pp")
"""The degrees a flag can pin to one value (--pp, --tp, one --cp, one --ep, --zero N)."""


def pinned_degrees(training: TrainingConfig) -> dict[str, int]:
    """The degrees the options fix to one value (a single --cp/--ep/--zero value is a pin)."""
    pins: dict[str, Any] = {
        "zero": training.zero_stages[0] if len(training.zero_stages) == 1 else None,
        "tp": training.tp,
        "ep": training.ep[0] if training.ep is not None and len(training.ep) == 1 else None,
        "cp": training.cp[0] if len(training.cp) == 1 else None,
        "pp": training.pp,
    }
    return {key: pins[key] for key in PINNABLE if pins[key] is not None}


def _with_sp(degrees: dict[str, Any], training: TrainingConfig) -> dict[str, Any]:
    """``degrees`` plus sp when tp is known (the sequence-parallel option decides it)."""
    if "tp" in degrees:
        return {**degrees, "sp": uses_sequence_parallel(training.sequence_parallel, degrees["tp"])}
    return degrees


def check_pinned_rules(
    training: TrainingConfig, facts: ModelFacts, ranges: dict[str, list[int]]
) -> None:
    """InputError (exit 2) when pinned degrees break a rule of every engine of the runtime:
    the smallest group of pins that does, the rule, the engines and the values that would pass,
    e.g. '--tp 8: on --runtime megatron, Megatron-LM and DeepSpeed: tensor parallelism splits
    whole heads: needs attention heads (28) divisible by tp (8); use --tp 1, 2 or 4'.
    ``ranges``: the values each pinnable degree could take on the cluster (the suggestions)."""
    pins = pinned_degrees(training)
    # cp 1 and ZeRO 0, the defaults, are known to every group but named by none
    known = {key: pins.pop(key) for key in ("cp", "zero") if pins.get(key) in (1, 0)}
    for size in range(1, len(pins) + 1):
        for group in combinations(pins, size):
            degrees = _with_sp(known | {key: pins[key] for key in group}, training)
            refusal = runtime_refusal(degrees, facts, training.runtime)
            if refusal is not None:
                raise InputError(_pinned_message(group, degrees, refusal, training, facts, ranges))


def _pinned_message(
    group: tuple[str, ...],
    degrees: dict[str, Any],
    refusal: Refusal,
    training: TrainingConfig,
    facts: ModelFacts,
    ranges: dict[str, list[int]],
) -> str:
    flags = " with ".join(f"{_flag(key)} {degrees[key]}" for key in group)
    fixes = []
    for key in group:
        passing = [
            value
            for value in ranges[key]
            if value != degrees[key]
            and runtime_refusal(
                _with_sp({**degrees, key: value}, training),
                facts,
                training.runtime,
            )
            is None
        ]
        if passing:
            fixes.append(f"{_flag(key)} {_or_list(passing)}")
    other = "torch" if training.runtime == "megatron" else "megatron"
    if runtime_refusal(degrees, facts, other) is None:
        fixes.append(f"--runtime {other}")
    fix = f"; use {', or '.join(fixes)}" if fixes else ""
    return f"{flags}: on --runtime {training.runtime}, {refusal.text()}{fix}"


def _flag(key: str) -> str:
    return f"--{key}"


def _or_list(values: list[int]) -> str:
    """'1, 2 or 4' (the first 8 values)."""
    shown = [str(v) for v in values[:8]] + (["..."] if len(values) > 8 else [])
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


class RuleFilter:
    """Counts the candidate configs the rules remove, by the text of the refusal, so an empty
    search can say which rule removed them."""

    def __init__(self, training: TrainingConfig, facts: ModelFacts) -> None:
        self.runtime = training.runtime
        self.facts = facts
        self.removed: Counter[str] = Counter()
        self.example: dict[str, str] = {}

    def refuses(self, config: Any) -> bool:
        """Whether every engine of the runtime refuses ``config`` (a ``ParallelConfig``; then
        counted)."""
        refusal = runtime_refusal(degrees_of(config), self.facts, self.runtime)
        if refusal is None:
            return False
        text = refusal.text()
        self.removed[text] += 1
        self.example.setdefault(text, config.label())
        return True

    def message(self) -> str:
        """'no parallel config passes the engines' rules on --runtime R: N removed by ...'."""
        total = sum(self.removed.values())
        reasons = "; ".join(
            f"{count} by '{text}' (e.g. {self.example[text]})"
            for text, count in self.removed.most_common(3)
        )
        return (
            f"no candidate config passes the engines' rules on --runtime {self.runtime}: all "
            f"{total} were removed, {reasons}; change or free the pinned degrees (--pp, --tp, "
            "--dp, --cp, --ep, --zero) or the GPU count"
        )


def skipped_rules_note(degrees: dict[str, Any], facts: ModelFacts, runtime: str) -> list[str]:
    """A note for the plan when rules for its layout were skipped for facts its graph lacks."""
    missing = skipped_facts(degrees, facts, runtime)
    if not missing:
        return []
    return [
        f"engine rules not checked for this layout: the graph records no {', '.join(missing)} "
        "(meta.architecture, meta.seq_len); re-export it with python -m profiling.export to "
        "have them checked"
    ]
